"""The tiny verifiers on this machine: the build cache, filled from the weights shipped in the package or by a build.

`tiny_verifier_path(recipe)` is the model directory (TinyRecipe: the dense one; eagle3lib.tiny.kimi.TinyKimiRecipe:
the MLA + MoE Kimi twin). The package ships each built verifier (eagle3lib/assets/<name>-verifier/) whose
build_report.json names the recipe key it was built with: when that key is the current recipe's, the first run copies
it into the cache (seconds) instead of training (minutes); otherwise, or with `EAGLE3_TINY_BUILD=1`, it is built from
the recipe. tests/test_tiny_verifier.py and tests/test_tiny_kimi.py check that a rebuild reproduces the shipped
weights' tokenizer and first training losses exactly. After a change to a recipe, rebuild and ship it:
`python -m eagle3lib build-verifier --ship [--name tiny-kimi]`.
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


def shipped_dir(recipe: TinyRecipe | None = None) -> Path:
    return ASSETS_DIR / f"{(recipe or TinyRecipe()).name}-verifier"


def shipped_key(recipe: TinyRecipe | None = None) -> str | None:
    """The recipe key the shipped verifier was built with (None when the package ships none)."""
    try:
        return json.loads((shipped_dir(recipe) / "build_report.json").read_text())["recipe_key"]
    except (OSError, ValueError, KeyError):
        return None


def tiny_verifier_path(recipe: TinyRecipe | None = None, *, build: bool = True, progress: bool = True) -> Path:
    """Path of the cached tiny verifier for this recipe, building it first if needed (process-safe via a file lock)."""
    recipe = recipe or TinyRecipe()
    root = cache_dir() / f"{recipe.name}-verifier"
    out = root / recipe_key(recipe)
    if (out / "build_report.json").exists() or not build:
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the finished build
        if not (out / "build_report.json").exists():
            tmp = root / f".tmp-{out.name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            if shipped_key(recipe) == out.name and os.environ.get("EAGLE3_TINY_BUILD") != "1":
                shutil.copytree(shipped_dir(recipe), tmp)
            elif hasattr(recipe, "build"):  # a recipe that starts from another verifier (eagle3lib/tiny/long.py)
                recipe.build(tmp, progress=progress)
            else:
                build_tiny_verifier(recipe, tmp, progress=progress)
            os.replace(tmp, out)  # atomic: a half-built model is never visible under its key
    return out


def ship(recipe: TinyRecipe | None = None) -> Path:
    """Build (or take from the cache) the verifier of this recipe and copy it into the package's assets."""
    src = tiny_verifier_path(recipe)
    dest = shipped_dir(recipe)
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def tiny_kimi_k25_path() -> Path:
    """The tiny-kimi text weights inside the Kimi-K2.5 multimodal wrapper (eagle3lib/tiny/kimi_wrapper.py), cached
    under the text model's key plus the wrapper code's fingerprint; built in seconds, never shipped."""
    import hashlib
    import inspect

    from eagle3lib.tiny import kimi_wrapper
    from eagle3lib.tiny.kimi import TinyKimiRecipe
    from eagle3lib.tiny.recipe import _code_fingerprint

    text = tiny_verifier_path(TinyKimiRecipe())
    key = hashlib.sha256((text.name + _code_fingerprint(Path(inspect.getfile(kimi_wrapper)))).encode()).hexdigest()[:12]
    root = cache_dir() / "tiny-kimi-k25-verifier"
    out = root / key
    if (out / "config.json").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            kimi_wrapper.kimi_k25_wrapper(text, out)
    return out
