"""Weights & Biases: offline by default (files under RUN_DIR/train/wandb/, `wandb sync` uploads them later), or online.

W&B's history is keyed by `_step`, which must only grow within a run, so the optimizer step is passed as `step`: a
resumed run (a new offline folder with the same run id) continues the same steps, and `wandb sync` of both folders
gives one run. A train and a val record of the same step share one history row: the row is held until the next
record of another step arrives (or the run closes), then committed.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path
from typing import Any

from eagle3lib.config.train import TrainConfig
from eagle3lib.trackers.base import TrackerError, last_steps, metric_values, records_from_metrics, require, split_tag

FOLDER = "wandb"


class WandbTracker:
    name = "wandb"

    def __init__(self, train_dir: Path, cfg: TrainConfig, state: dict | None, params: dict[str, Any], resume_step: int,
                 run_name: str):
        wandb = require("wandb", "wandb")
        self.dir = Path(train_dir)
        self.run_id = state["run_id"] if state else uuid.uuid4().hex[:12]  # W&B ids: [a-z0-9]
        self.mode = cfg.wandb_mode
        self._logged = {} if state is None else last_steps(read_wandb(self.dir / FOLDER, self.run_id))
        os.environ.setdefault("WANDB_SILENT", "true")  # its banner and sync hints would fill every report
        try:
            self.run = wandb.init(project=cfg.tracker_project, name=run_name, id=self.run_id, resume="allow",
                                  dir=str(self.dir), mode=self.mode, config=params, reinit="finish_previous")
        except Exception as e:  # no API key online, an unwritable folder, ...
            raise TrackerError(f"wandb (train.wandb_mode={self.mode!r}) could not start a run: "
                               f"{type(e).__name__}: {e}") from None
        self.pending: tuple[int, dict[str, float]] | None = None

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "project": self.run.project, "mode": self.mode}

    def logged(self) -> dict[str, int]:
        return self._logged

    def _commit(self) -> None:
        if self.pending is not None:
            step, values = self.pending
            self.run.log(values, step=step, commit=True)
            self.pending = None

    def log(self, rec: dict[str, Any]) -> None:
        values = metric_values(rec)
        if self.pending is not None and self.pending[0] == rec["step"]:
            self.pending[1].update(values)
        else:
            self._commit()
            self.pending = (rec["step"], values)
        if rec["kind"] == "val":  # the last record of its step
            self._commit()

    def summary(self, figures: dict[str, Any], step: int) -> None:
        self._commit()
        self.run.summary.update({k: v for k, v in figures.items() if v is not None})

    def table(self, name: str, rows: list[dict[str, Any]], values: dict[str, float], step: int) -> None:
        import wandb

        self._commit()
        cols = list(dict.fromkeys(k for r in rows for k in r))
        self.run.log({name: wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])})
        self.run.summary.update({f"{name}/{k}": v for k, v in values.items()})

    def close(self, status: str) -> None:
        self._commit()
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


# ------------------------------------------------------------------------------------------------ the offline files
_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of (crc32, length, type) framed chunks
_HEADER = 7  # b":W&B" + 0xBEE1 + version


def _chunks(path: Path):
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    pos, buf = _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and n == 0:
            pos += left - 7
            continue
        chunk, pos = data[pos : pos + n], pos + n
        if kind == 1:  # full
            yield chunk
        elif kind == 2:  # first
            buf = chunk
        elif kind == 3:  # middle
            buf += chunk
        elif kind == 4:  # last
            yield buf + chunk
            buf = b""


def run_files(folder: Path, run_id: str) -> list[Path]:
    """Every attempt's run file of one run id, oldest first (offline folders are named by their start time)."""
    return sorted(Path(folder).glob(f"*-{run_id}/run-{run_id}.wandb"))


def _records(folder: Path, run_id: str, kind: str):
    """The records of one type ("history", "summary", ...) of every attempt, oldest first, in W&B's protobuf schema."""
    from wandb.proto import wandb_internal_pb2 as pb

    for path in run_files(Path(folder), run_id):
        for chunk in _chunks(path):
            r = pb.Record()
            r.ParseFromString(chunk)
            if r.WhichOneof("record_type") == kind:
                yield r


def _items(updates) -> dict[str, Any]:
    return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in updates}


def read_wandb(folder: str | Path, run_id: str) -> list[dict[str, Any]]:
    """The history rows of every attempt of a run, as metrics.jsonl-shaped records. A step logged twice (by two
    attempts) comes back twice, so a duplicate is visible."""
    out: list[dict[str, Any]] = []
    for r in _records(folder, run_id, "history"):
        row = _items(r.history.item)
        points: dict[tuple[str, int], dict[str, float]] = {}
        for tag, v in row.items():
            if tag.startswith("_") or not isinstance(v, int | float):
                continue
            kind, field = split_tag(tag)
            points.setdefault((kind, int(row["_step"])), {})[f"{kind}/{field}"] = v
        out += records_from_metrics(points)
    return out


def read_summary(folder: str | Path, run_id: str) -> dict[str, Any]:
    """The run's summary values, as W&B would show them after `wandb sync` (the newest update of each key wins)."""
    out: dict[str, Any] = {}
    for r in _records(folder, run_id, "summary"):
        out.update(_items(r.summary.update))
    return out
