"""Where the project keeps things that are not in git: the build cache and the run directories."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # valid for the editable install `make setup` makes
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
PARAMS_DIR = REPO_ROOT / "params"
ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"


def cache_dir() -> Path:
    """Build cache (tiny verifier, ...). Override with EAGLE3_CACHE, e.g. to share one cache between clones."""
    return Path(os.environ.get("EAGLE3_CACHE", REPO_ROOT / ".cache")).resolve()
