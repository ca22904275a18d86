# .venv/bin/python -m pytest -q tests/test_progress.py
"""Progress bars where they are shown: a widget in a notebook kernel (as JupyterLab gets it), one summary line per
bar in a notebook the runner executes headless (what the HTML report keeps), tqdm's text bar in a terminal."""

from __future__ import annotations

import os
import subprocess
import sys

import nbformat
import papermill as pm

from eagle3lib.core.progress import HEADLESS_ENV

CELL = """from eagle3lib.core.progress import progress_bar
import time
for _ in progress_bar(range(40), desc="generate", unit="sample", mininterval=0):
    time.sleep(0.01)
bar = progress_bar(total=5000, desc="extract", unit="tok", unit_scale=True, mininterval=0)
for _ in range(10):
    bar.update(250)
bar.close()
"""


def _run(tmp_path, headless: bool):
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(CELL))
    src, out = tmp_path / "in.ipynb", tmp_path / f"out-{headless}.ipynb"
    nbformat.write(nb, src)
    env_before = os.environ.get(HEADLESS_ENV)
    os.environ[HEADLESS_ENV] = "1" if headless else "0"
    try:
        return pm.execute_notebook(str(src), str(out), kernel_name="python3", progress_bar=False).cells[0].outputs
    finally:
        if env_before is None:
            del os.environ[HEADLESS_ENV]
        else:
            os.environ[HEADLESS_ENV] = env_before


def test_a_headless_notebook_keeps_one_summary_line_per_bar(tmp_path):
    outputs = _run(tmp_path, headless=True)
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert all(o.get("name") == "stdout" for o in outputs if o.get("output_type") == "stream")  # no red stderr block
    lines = text.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("generate: 40 sample in ") and lines[0].endswith(" sample/s)")
    assert lines[1].startswith("extract: 2.50k tok in "), lines[1]  # stopped at half: the count it reached
    assert "\r" not in text and "it/s]" not in text


def test_a_notebook_kernel_gets_widget_bars(tmp_path):
    outputs = _run(tmp_path, headless=False)
    widgets = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(widgets) == 2, outputs
    assert not any("IProgress not found" in o.get("text", "") for o in outputs)


def test_a_terminal_gets_tqdm_text_bars():
    r = subprocess.run([sys.executable, "-c", CELL], capture_output=True, text=True,
                       env={**os.environ, HEADLESS_ENV: "0"})
    assert r.returncode == 0, r.stderr
    assert "generate: 100%" in r.stderr and "40/40" in r.stderr
