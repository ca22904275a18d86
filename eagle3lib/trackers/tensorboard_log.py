"""TensorBoard: event files in RUN_DIR/train/tensorboard/ (`tensorboard --logdir runs/` shows every run).

A resumed run opens its writer with `purge_step` = the checkpoint's step + 1: TensorBoard's own readers then drop the
points an interrupted attempt logged past the checkpoint, and the resumed run logs them again, so the curve is the
metrics.jsonl curve exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from eagle3lib.config.train import TrainConfig
from eagle3lib.trackers.base import last_steps, markdown_table, metric_values, records_from_metrics, require, split_tag

LOG_DIR = "tensorboard"


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, train_dir: Path, cfg: TrainConfig, state: dict | None, params: dict[str, Any], resume_step: int):
        require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(train_dir) / LOG_DIR
        fresh = state is None
        if fresh and self.log_dir.exists():
            shutil.rmtree(self.log_dir)  # events of an earlier run in this folder that started over
        self._logged = {} if fresh else last_steps(read_tensorboard(self.log_dir), upto=resume_step)
        self.writer = SummaryWriter(str(self.log_dir), purge_step=None if fresh else resume_step + 1)
        if fresh:
            self.writer.add_text("params", "```\n" + json.dumps(params, indent=2) + "\n```", 0)

    def state(self) -> dict[str, Any]:
        return {"log_dir": LOG_DIR}

    def logged(self) -> dict[str, int]:
        return self._logged

    def log(self, rec: dict[str, Any]) -> None:
        for tag, v in metric_values(rec).items():
            self.writer.add_scalar(tag, v, rec["step"], walltime=rec.get("time"))
        self.writer.flush()

    def summary(self, figures: dict[str, Any], step: int) -> None:
        rows = [{"figure": k, "value": v} for k, v in figures.items() if v is not None]
        self.writer.add_text("summary", markdown_table(rows), step)
        self.writer.flush()

    def table(self, name: str, rows: list[dict[str, Any]], values: dict[str, float], step: int) -> None:
        self.writer.add_text(name, markdown_table(rows), step)
        for k, v in values.items():
            self.writer.add_scalar(f"{name}/{k}", v, step)
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


def event_dirs(path: str | Path) -> list[Path]:
    """Folders under `path` (itself included) that hold TensorBoard event files: one run each."""
    path = Path(path)
    return sorted({f.parent for f in path.rglob("events.out.tfevents.*")})


def read_tensorboard(log_dir: str | Path) -> list[dict[str, Any]]:
    """The scalars of one run folder as metrics.jsonl-shaped records, read with TensorBoard's own EventAccumulator
    (so purged points are gone exactly as TensorBoard shows it). Tags `train/x` and `val/x` become field x of that
    kind; a tag without a prefix (`lr`) goes to the train records."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    ea.Reload()
    points: dict[tuple[str, int], dict[str, float]] = {}
    times: dict[tuple[str, int], float] = {}
    for tag in ea.Tags().get("scalars", []):
        kind, field = split_tag(tag)
        for e in ea.Scalars(tag):
            points.setdefault((kind, e.step), {})[f"{kind}/{field}"] = e.value
            times[(kind, e.step)] = e.wall_time
    recs = records_from_metrics(points)
    for r in recs:
        r["time"] = times[(r["kind"], r["step"])]
    return recs
