"""Authoring helpers for the committed notebooks (which carry no outputs and a python3 kernelspec).

  python -m eagle3lib.pipeline.notebook_tools from-py SRC.py notebooks/NAME.ipynb   # jupytext percent script -> notebook
  python -m eagle3lib.pipeline.notebook_tools strip notebooks/*.ipynb               # drop outputs before committing
"""

from __future__ import annotations

import sys

import nbformat

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def normalise(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """No outputs, no execution counts, a kernelspec (papermill.inspect_notebook needs it), no jupytext metadata."""
    nb.metadata = {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}}
    for cell in nb.cells:
        cell.metadata = {k: v for k, v in cell.metadata.items() if k == "tags"}
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "from-py":
        import jupytext

        nbformat.write(normalise(jupytext.read(argv[1])), argv[2])
    elif len(argv) >= 2 and argv[0] == "strip":
        for path in argv[1:]:
            nbformat.write(normalise(nbformat.read(path, as_version=4)), path)
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
