"""Where the project keeps things that are not in git: the build cache and the run directories."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # valid for the editable install `make setup` makes
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
PARAMS_DIR = REPO_ROOT / "params"
ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"


RUNS_ENV = "EAGLE3LIB_RUNS_DIR"  # where runs live when no run directory is named (default: REPO_ROOT/runs)


def runs_root() -> Path:
    """Where runs live: $EAGLE3LIB_RUNS_DIR, else REPO_ROOT/runs."""
    return Path(os.environ.get(RUNS_ENV) or REPO_ROOT / "runs")


def cache_dir() -> Path:
    """Build cache (tiny verifier, ...). Override with EAGLE3_CACHE, e.g. to share one cache between clones."""
    return Path(os.environ.get("EAGLE3_CACHE", REPO_ROOT / ".cache")).resolve()


RUN_CWD_ENV = "EAGLE3LIB_RUN_CWD"  # the directory a run was started in, for its stage notebooks and torchrun processes


def run_cwd() -> Path:
    """What a profile's relative paths are relative to: the directory the run was started in. A stage notebook starts
    in the repository and torchrun's processes in their stage folder, so the command that starts the run records it
    in RUN_CWD_ENV; any other process resolves against its own working directory."""
    return Path(os.environ.get(RUN_CWD_ENV) or os.getcwd())


@contextmanager
def started_here() -> Iterator[None]:
    """Within the block, processes started from this one resolve a profile's relative paths as this one does."""
    old = os.environ.get(RUN_CWD_ENV)
    os.environ[RUN_CWD_ENV] = str(run_cwd())
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(RUN_CWD_ENV, None)
        else:
            os.environ[RUN_CWD_ENV] = old
