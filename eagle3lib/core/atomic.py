"""Crash-safe file writes: write to a temporary file in the same folder, fsync, then rename over the target.

A reader therefore sees either the old file or the complete new one, never a torn write, even after `kill -9`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def write_error(path: str | Path, e: BaseException) -> str:
    """Why writing `path` failed, for a message that names it: the error, and the space left on that disk (a full disk
    shows up as OSError, or as a library's own error type wrapping errno 28)."""
    reason = f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"
    d = Path(path)
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        free = shutil.disk_usage(d).free
    except OSError:
        return reason
    return f"{reason}; {free / 2**20:,.1f} MiB free on that disk"
