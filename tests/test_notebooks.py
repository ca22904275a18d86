# Run: .venv/bin/python -m pytest tests/test_notebooks.py -q
"""Committed notebooks carry no outputs, a kernelspec, and the three standard parameters; each maps to a stage and stays
thin (CONTRIBUTING.md's rules for a notebook)."""

from __future__ import annotations

import nbformat
import papermill as pm
import pytest

from eagle3lib.config.profile import SECTIONS
from eagle3lib.config.stages import STAGES
from eagle3lib.core.paths import NOTEBOOKS_DIR

NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; run `python -m eagle3lib.pipeline.notebook_tools strip {path}`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_valid_without_warnings(path):
    """Every cell has an id (nbformat 4.5): one without printed nbformat's MissingIDFieldWarning on every run."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nbformat.validate(nbformat.read(path, as_version=4))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_standard_parameters(path):
    params = pm.inspect_notebook(str(path))  # also fails without a kernelspec
    assert set(params) == {"profile", "run_dir", "overrides"}, f"{path.name}: parameters cell has {sorted(params)}"
    assert all(p["help"] for p in params.values()), f"{path.name}: every parameter needs a help comment"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_a_stage(path):
    stage = next((s for s in STAGES if s.notebook == path.name), None)
    assert stage is not None, f"{path.name} is not in eagle3lib.config.stages.STAGES"
    assert stage.section in SECTIONS
    src = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
    assert f'open_notebook_stage("{stage.name}"' in src, f"{path.name} must open its stage with open_notebook_stage({stage.name!r}, ...)"


MAX_CODE_CELLS = 12  # CONTRIBUTING.md: a notebook is a parameters cell, open_notebook_stage, one run call and a few reports


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_stays_thin(path):
    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    assert len(cells) <= MAX_CODE_CELLS, f"{path.name}: {len(cells)} code cells; move work into eagle3lib/reports/"
    src = "\n".join(c.source for c in cells)
    assert "def " not in src and "class " not in src, f"{path.name}: defines functions; they belong in the library"
