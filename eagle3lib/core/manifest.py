"""`RUN_DIR/<stage>/manifest.json`: the structured result of a stage, so nobody ever greps a log for a number.

Layout: {"stage", "status" (running|complete|failed|interrupted), "profile", "params" (the stage section as run),
"verifier", "started_at", "finished_at" (of the last attempt, failed ones too), "completed_at" (of the last attempt that
completed), "output_id" (a fresh id each time the stage completes with new outputs), "input_ids" (the output_id of
the input stage when this attempt started), "wall_s", "figures" (counts, timings, throughputs: stage-specific),
"outputs" (paths relative to the stage dir), "error"}. Written atomically, so a reader never sees half a manifest.

Staleness is decided by ids, never by clocks: a downstream stage is stale when the output_id it started from is not
its input's current one. Timestamps from two machines (or one NTP step) cannot be compared; an id either matches or not.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from eagle3lib.core.atomic import write_json_atomic

T = TypeVar("T")

MANIFEST = "manifest.json"

# the fields the runner reads: a damaged one is named here, not met as a Python error in whatever reads it first
FIELD_TYPES = {"status": str, "params": dict, "figures": dict, "outputs": dict, "input_ids": dict, "output_id": str}


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def read_manifest(stage_dir: str | Path) -> dict[str, Any] | None:
    path = Path(stage_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(m, dict):
        # never read as "no manifest": that would redo the stage and count its downstream stages as stale (deleted)
        raise ValueError(f"{path}: damaged (a JSON {type(m).__name__} where a manifest object belongs); restore it, "
                         "or move the stage folder away to redo the stage")
    for key, kind in FIELD_TYPES.items():
        if m.get(key) is not None and not isinstance(m[key], kind):
            raise ValueError(f"{path}: damaged ({key} is a JSON {type(m[key]).__name__}, not "
                             f"{'an object' if kind is dict else 'a string'}); restore it, or move the stage folder away "
                             "to redo the stage")
    return m


def update_manifest(stage_dir: str | Path, **fields: Any) -> dict[str, Any]:
    """Merge `fields` into the manifest (creating it), `figures` and `outputs` merged key by key."""
    stage_dir = Path(stage_dir)
    m = read_manifest(stage_dir) or {"stage": stage_dir.name}
    for key, value in fields.items():
        if key in ("figures", "outputs") and isinstance(value, dict):
            m.setdefault(key, {}).update(value)
        else:
            m[key] = value
    write_json_atomic(stage_dir / MANIFEST, m)
    return m


def clear_results(stage_dir: str | Path) -> None:
    """Drop the figures and outputs of an earlier run of a stage whose figure names depend on its parameters (one per
    data-scaling fraction), so a rerun with others leaves no stale ones in the merge."""
    m = read_manifest(stage_dir)
    if m is not None:
        write_json_atomic(Path(stage_dir) / MANIFEST, {k: v for k, v in m.items() if k not in ("figures", "outputs")})


def input_ids(input_dir: str | Path | None) -> dict[str, str]:
    """{input stage: its output_id} for a stage consuming the stage folder `input_dir` (its registry row's
    input_stage); {} without one, or when the input has not completed with an id."""
    m = read_manifest(input_dir) if input_dir is not None else None
    ok = m and m.get("status") == "complete" and m.get("output_id")
    return {Path(input_dir).name: m["output_id"]} if ok else {}


def completion(**fields: Any) -> dict[str, Any]:
    """The manifest fields of a stage completing with new outputs: a fresh output_id tells its downstream stages."""
    now = now_iso()
    return {"status": "complete", "finished_at": now, "completed_at": now, "output_id": uuid.uuid4().hex, **fields}


class StageTimer:
    """Marks a stage running on entry (with the input ids it starts from) and complete (with wall time and a new
    output_id) on `finish`; failures are marked by the runner."""

    def __init__(self, stage_dir: str | Path, params: dict[str, Any] | None = None, input_dir: Path | None = None,
                 **extra: Any):
        self.stage_dir = Path(stage_dir)
        self.stage_dir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time()
        update_manifest(self.stage_dir, status="running", started_at=now_iso(), params=params or {}, error=None,
                        input_ids=input_ids(input_dir), **extra)

    def finish(self, figures: dict[str, Any], outputs: dict[str, Any] | None = None) -> dict[str, Any]:
        return update_manifest(self.stage_dir, **completion(wall_s=round(time.time() - self.t0, 2), figures=figures,
                                                            outputs=outputs or {}))


def timed_stage(stage_dir: Path, params: dict[str, Any], body: Callable[[StageTimer], T],
                input_dir: Path | None = None) -> T:
    """A stage body run with its results cleared first and a StageTimer to finish; an exception is recorded in the
    manifest (status failed, the error) before it propagates, so a report never shows a half-run stage as complete."""
    clear_results(stage_dir)
    timer = StageTimer(stage_dir, params, input_dir)
    try:
        return body(timer)
    except BaseException as e:
        update_manifest(stage_dir, status="failed", error=f"{type(e).__name__}: {e}", finished_at=now_iso())
        raise
