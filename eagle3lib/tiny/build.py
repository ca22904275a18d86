"""The tiny verifier on this machine: the build cache, filled from the weights shipped in the package or by a build.

`tiny_verifier_path()` is the model directory. The package ships a built verifier (eagle3lib/assets/tiny-verifier/,
~15 MB) whose build_report.json names the recipe key it was built with: when that key is the current recipe's, the
first run copies it into the cache (seconds) instead of training (minutes); otherwise, or with
`EAGLE3_TINY_BUILD=1`, it is built from the recipe. tests/test_tiny_verifier.py checks that a rebuild reproduces the
shipped weights' tokenizer and first training losses exactly. After a change to the recipe, rebuild and ship it:
`python -m eagle3lib build-verifier --ship`.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

from eagle3lib.core.paths import ASSETS_DIR, cache_dir
from eagle3lib.tiny.recipe import TinyRecipe, build_tiny_verifier, recipe_key

SHIPPED = ASSETS_DIR / "tiny-verifier"


def shipped_key() -> str | None:
    """The recipe key the shipped verifier was built with (None when the package ships none)."""
    try:
        return json.loads((SHIPPED / "build_report.json").read_text())["recipe_key"]
    except (OSError, ValueError, KeyError):
        return None


def tiny_verifier_path(recipe: TinyRecipe | None = None, *, build: bool = True, progress: bool = True) -> Path:
    """Path of the cached tiny verifier for this recipe, building it first if needed (process-safe via a file lock)."""
    recipe = recipe or TinyRecipe()
    root = cache_dir() / "tiny-verifier"
    out = root / recipe_key(recipe)
    if (out / "build_report.json").exists() or not build:
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the finished build
        if not (out / "build_report.json").exists():
            tmp = root / f".tmp-{out.name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            if shipped_key() == out.name and os.environ.get("EAGLE3_TINY_BUILD") != "1":
                shutil.copytree(SHIPPED, tmp)
            else:
                build_tiny_verifier(recipe, tmp, progress=progress)
            os.replace(tmp, out)  # atomic: a half-built model is never visible under its key
    return out




def ship(recipe: TinyRecipe | None = None) -> Path:
    """Build (or take from the cache) the verifier of this recipe and copy it into the package's assets."""
    src = tiny_verifier_path(recipe)
    tmp = SHIPPED.parent / f".tmp-tiny-verifier-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(SHIPPED, ignore_errors=True)
    os.replace(tmp, SHIPPED)
    return SHIPPED
