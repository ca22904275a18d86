"""Per-sample validation counts: RUN/train/val_samples.jsonl, one line per validation, written by the trainer
(eagle3lib/training/validate.py) and read by the data-scaling points (eagle3lib/analysis/scaling_points.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SAMPLES_FILE = "val_samples.jsonl"


def write_sample_counts(path: Path, step: int, ids: list[str], n: list[list[int]], full: list[list[int]]) -> None:
    """One line: {"step", "ids", "n": per sample, positions counted at each TTT step k, "full": of those, fully
    accepted at k}. Appended and flushed at once; a torn last line is skipped by the reader."""
    line = {"step": step, "ids": ids, "n": n, "full": full}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line, separators=(",", ":")) + "\n")


def read_sample_counts(path: Path, steps: set[int] | None = None) -> dict[int, dict[str, Any]]:
    """step -> that validation's counts; the last line for a step wins (a resumed run validates it again), torn lines
    skipped; only `steps` (those metrics.jsonl holds) when given."""
    out: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and (steps is None or rec["step"] in steps):
            out[rec["step"]] = rec
    return out
