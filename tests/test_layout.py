# The library's shape: layers that import only downwards, no cycle, no stage importing another, small files.
# Run: .venv/bin/python -m pytest -q tests/test_layout.py
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "eagle3lib"
KERNELS = ROOT / "kernels"
# Lower layers never import higher ones; packages of one layer do not import each other (ARCHITECTURE.md).
LAYERS = {
    "core": 0,
    "config": 1,
    "data": 2, "kernels": 2, "tiny": 2,
    "model": 3, "vllm": 3, "trackers": 3,
    "generation": 4, "extraction": 4, "training": 4, "evaluation": 4, "analysis": 4,
    "reports": 5, "studies": 5,
    "stages": 6,
    "pipeline": 7,
    "__main__": 8,
}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    for path in sorted(KERNELS.glob("*.py")):
        name = "eagle3lib.kernels" if path.stem == "__init__" else f"eagle3lib.kernels.{path.stem}"
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path, unresolved: list[str] | None = None) -> set[str]:
    """eagle3lib modules imported anywhere in the file (function-level imports count too); names that are no module
    of the package go to `unresolved`."""
    found = set()
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    # imports made only for annotations (`if TYPE_CHECKING:`) count too: a module typed against a higher one, or one
    # that imports it, is tied to it all the same
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("eagle3lib")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("eagle3lib"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in MODULES else base)
    if unresolved is not None:
        unresolved += [f"{path.relative_to(ROOT)}: {m}" for m in sorted(found) if m not in MODULES]
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__main__"


def test_every_import_names_a_module_that_exists():
    """Also in tests, benchmarks and notebooks: a module moved without its callers is caught here, not in a run."""
    import json

    unresolved: list[str] = []
    for name, path in MODULES.items():
        _imports(name, path, unresolved)
    for path in [*sorted((ROOT / "tests").glob("*.py")), *sorted((ROOT / "benchmarks").rglob("*.py"))]:
        _imports("x", path, unresolved)
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        src = ROOT / "notebooks" / (path.stem + ".py")  # a virtual file for the message
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        tree_path = src
        tree = ast.parse(code)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eagle3lib"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub not in MODULES and node.module not in MODULES:
                        unresolved.append(f"{tree_path.relative_to(ROOT)}: {sub}")
    assert not unresolved, unresolved


def test_every_package_is_in_a_layer():
    assert {_layer(m) for m in MODULES if m != "eagle3lib"} <= set(LAYERS)


def test_imports_point_down_only():
    bad = []
    for mod, deps in GRAPH.items():
        if mod == "eagle3lib":
            continue
        for dep in deps:
            a, b = _layer(mod), _layer(dep)
            if a != b and LAYERS[b] >= LAYERS[a]:
                bad.append(f"{mod} -> {dep} ({a} is layer {LAYERS[a]}, {b} layer {LAYERS[b]})")
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_no_stage_imports_another_stage():
    bad = [f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
           if _layer(m) == "stages" and _layer(d) == "stages"]
    assert not bad, bad


def test_no_import_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state and (cycle := visit(m)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_files_are_small():
    big = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"library files over {MAX_LINES} lines: {big}"


def test_pyproject_lists_every_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {".".join(p.parent.relative_to(ROOT).parts) for p in PKG.rglob("__init__.py")} | {"eagle3lib.kernels"}
    assert listed == packages


@pytest.mark.parametrize("cwd", ["/", "repo"], ids=["outside", "repo-root"])
def test_kernels_do_not_take_the_top_level_name(cwd):
    """Hugging Face's `kernels` package is what `import kernels` means to transformers; ours is eagle3lib.kernels.
    Both imported in one fresh interpreter, also one started in the repository root (which puts the top-level
    kernels/ folder first on the path: it hands the name over)."""
    code = ("import transformers.activations, kernels, eagle3lib.kernels as ours;"
            "from transformers.utils import is_kernels_available;"
            "print(ours.__file__); print(kernels.__file__); print(hasattr(kernels, 'get_kernel'), is_kernels_available())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(ROOT) if cwd == "repo" else cwd)
    assert out.returncode == 0, out.stderr[-2000:]
    ours, theirs, flags = out.stdout.split("\n")[:3]
    assert Path(ours) == KERNELS / "__init__.py"
    assert not Path(theirs).is_relative_to(ROOT / "kernels") and "site-packages" in theirs
    assert flags == "True True"  # Hugging Face's API, and transformers sees it


def test_transformers_imports_from_the_repository_root_without_hugging_faces_kernels():
    """An environment without HF's `kernels` (a team's own vLLM environment), started from the repository root:
    find_spec("kernels") finds the top-level kernels/ folder, transformers imports it to read a version, and
    `from transformers import PreTrainedModel` failed. The package's absence is simulated (the path finder sees no
    `kernels` outside the repository root, no `kernels` distribution); transformers' own check then runs on the
    folder as it ships."""
    code = f"""
import importlib.machinery, os
root, find = {str(ROOT)!r}, importlib.machinery.PathFinder.find_spec
def hidden(name, path=None, target=None):
    if name == "kernels" and path is not None and root not in [os.path.abspath(p or os.curdir) for p in path]:
        return None  # Hugging Face's kernels is not installed
    return find(name, path, target)
importlib.machinery.PathFinder.find_spec = hidden
import importlib.metadata as md
version = md.version
def no_dist(name):
    if name == "kernels":
        raise md.PackageNotFoundError(name)  # nor its metadata
    return version(name)
md.version = no_dist
from transformers import PreTrainedModel
from transformers.utils import is_kernels_available
import transformers.activations
print(is_kernels_available())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    assert out.returncode == 0 and out.stdout.split() == ["False"], out.stderr[-2000:]
