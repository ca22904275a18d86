"""The trackers of one training run (`train.report_to`), opened by rank 0, fed the records metrics.jsonl gets.

RUN_DIR/train/trackers.json names each tracker's run (W&B id, MLflow run id and store, TensorBoard folder), so a
resumed run, and the evaluate stage after it, continue the same tracker runs. On resume every tracker is caught up from
metrics.jsonl: the records it lacks up to the checkpoint are logged first, then records it already holds (an
interrupted attempt logged them) are skipped, so no tracker holds a step twice. A tracker that cannot start is a
TrackerError before any training; one that fails mid-run is dropped with a warning and training goes on (metrics.jsonl
stays complete, and the next resume catches it up).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eagle3lib.config.train import TrainConfig
from eagle3lib.core.atomic import write_json_atomic
from eagle3lib.trackers.base import TrackerError, require

STATE_FILE = "trackers.json"


def _classes() -> dict[str, Any]:
    from eagle3lib.trackers.mlflow_log import MlflowTracker
    from eagle3lib.trackers.tensorboard_log import TensorBoardTracker
    from eagle3lib.trackers.wandb_log import WandbTracker

    return {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


def check_trackers(cfg: TrainConfig, train_dir: Path) -> None:
    """Before training starts (and before torchrun spawns anything): each listed tracker's package imports, the MLflow
    store answers, W&B online has a key. Raises TrackerError naming the setting."""
    for name in cfg.report_to:
        if name == "tensorboard":
            require(name, "tensorboard")
        elif name == "wandb":
            require(name, "wandb")
            if cfg.wandb_mode == "online" and not os.environ.get("WANDB_API_KEY") and not _netrc_has_wandb():
                raise TrackerError("train.wandb_mode is 'online' but no W&B API key is set (WANDB_API_KEY or "
                                   "`wandb login`); use train.wandb_mode: offline and `wandb sync` later")
        elif name == "mlflow":
            from eagle3lib.trackers.mlflow_log import client, tracking_uri

            if not (cfg.mlflow_tracking_uri or "").strip():
                (Path(train_dir) / "mlflow").mkdir(parents=True, exist_ok=True)
            client(tracking_uri(train_dir, cfg))


def _netrc_has_wandb() -> bool:
    p = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return p.is_file() and "api.wandb.ai" in p.read_text(errors="replace")


def read_state(train_dir: Path) -> dict[str, Any]:
    p = Path(train_dir) / STATE_FILE
    try:
        return json.loads(p.read_text()) if p.exists() else {}
    except json.JSONDecodeError as e:
        raise TrackerError(f"{p}: not JSON ({e}); delete it to start new tracker runs") from None


class Trackers:
    """Zero or more trackers behind one `log`; empty on ranks other than 0 and when train.report_to is []."""

    def __init__(self, trackers: list | None = None, warn=print):
        self.trackers = list(trackers or [])
        self.errors: list[str] = []
        self.warn = warn

    @classmethod
    def open(cls, cfg: TrainConfig, train_dir: Path, params: dict[str, Any], resume_step: int,
             records: list[dict[str, Any]], warn=print) -> Trackers:
        """Open (or, resuming, reopen) each tracker, then log the `records` (metrics.jsonl up to the checkpoint) that
        a tracker does not hold yet."""
        if not cfg.report_to:
            return cls(warn=warn)
        train_dir = Path(train_dir)
        saved = read_state(train_dir) if resume_step > 0 else {}
        run_name = cfg.tracker_run_name or train_dir.parent.name
        opened: list = []
        try:
            for name in cfg.report_to:
                kw = {} if name == "tensorboard" else {"run_name": run_name}
                opened.append(_classes()[name](train_dir, cfg, saved.get(name), params, resume_step, **kw))
        except BaseException:
            for t in opened:
                t.close("FAILED")
            raise
        write_json_atomic(train_dir / STATE_FILE, {**saved, **{t.name: t.state() for t in opened}})
        out = cls(opened, warn)
        for rec in records:
            out.log(rec)
        return out

    def _each(self, what: str, fn) -> None:
        for t in list(self.trackers):
            try:
                fn(t)
            except Exception as e:  # a tracker must never cost the training run
                msg = f"{t.name}: {what} failed ({type(e).__name__}: {e}); no more records go to {t.name} in this run"
                self.errors.append(msg)
                self.warn(f"tracker {msg}")
                self.trackers.remove(t)

    def log(self, rec: dict[str, Any]) -> None:
        """One metrics.jsonl record, to each tracker that does not hold its step yet."""
        self._each("log", lambda t: t.log(rec) if rec["step"] > t.logged().get(rec["kind"], -1) else None)

    def summary(self, figures: dict[str, Any], step: int) -> None:
        self._each("summary", lambda t: t.summary(figures, step))

    def outputs(self) -> dict[str, str]:
        """What the trackers wrote into the train folder, for the manifest's outputs."""
        local = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
        out = {t.name: local[t.name] for t in self.trackers if (t.name != "mlflow" or t.local)}
        return {"trackers": STATE_FILE, **out} if self.trackers else {}

    def close(self, status: str) -> None:
        """status: FINISHED, FAILED or KILLED (MLflow's names; W&B gets an exit code)."""
        self._each("close", lambda t: t.close(status))
        self.trackers = []


def log_evaluation(train_cfg, train_dir: Path, name: str, rows: list[dict[str, Any]], values: dict[str, float],
                   step: int) -> list[str]:
    """The evaluate stage's table, into the training run's trackers when it has some. Returns warnings (a tracker
    problem is noted, never fatal: the measurement is what matters)."""
    state = read_state(train_dir)
    names = [n for n in train_cfg.report_to if n in state]
    if not names:
        return []
    notes: list[str] = []
    for n in names:
        try:
            kw = {} if n == "tensorboard" else {"run_name": train_cfg.tracker_run_name or Path(train_dir).parent.name}
            t = _classes()[n](Path(train_dir), train_cfg, state[n], {}, step, **kw)
            t.table(name, rows, values, step + 1)  # past the last training step: W&B steps only grow
            t.close("FINISHED")
        except Exception as e:
            notes.append(f"{n}: the evaluation table was not logged ({type(e).__name__}: {e})")
    return notes
