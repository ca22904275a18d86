"""Measurement phases kept once complete (RUN_DIR/evaluate/phases/<name>.json), keyed by everything they depend on,
so a rerun after a failure resumes at the phase that failed and a changed input measures again."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from eagle3lib.core.atomic import write_json_atomic
from eagle3lib.core.manifest import now_iso


def fingerprint(ckpt: Path) -> dict[str, Any]:
    return {"path": str(ckpt), "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns]
                                         for p in sorted(ckpt.iterdir()) if p.is_file()}}


def digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def load_phase(out_dir: Path, name: str, key: dict[str, Any]) -> dict[str, Any] | None:
    """phases/<name>.json's result when it was measured with the same key (everything the phase depends on)."""
    path = out_dir / "phases" / f"{name}.json"
    try:
        saved = json.loads(path.read_text())
        return saved["result"] if saved.get("key") == digest(key) else None
    except (OSError, json.JSONDecodeError, KeyError):
        return None


def save_phase(out_dir: Path, name: str, key: dict[str, Any], result: dict[str, Any]) -> None:
    write_json_atomic(out_dir / "phases" / f"{name}.json", {"key": digest(key), "finished_at": now_iso(),
                                                            "result": result})
