"""MLflow: a local SQLite store in RUN_DIR/train/mlflow/ by default (`mlflow ui --backend-store-uri
sqlite:///RUN_DIR/train/mlflow/mlflow.db`), or the tracking server a team sets in train.mlflow_tracking_uri.

MLflow keeps every value logged for a step, so a resumed run skips the steps this run already holds (the resumed
run recomputes them identically; their timings stay those of the first attempt).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from eagle3lib.config.train import TrainConfig
from eagle3lib.trackers.base import TrackerError, flat_params, metric_values, records_from_metrics, require, split_tag

FOLDER = "mlflow"


def tracking_uri(train_dir: Path, cfg: TrainConfig) -> str:
    if cfg.mlflow_tracking_uri:
        return cfg.mlflow_tracking_uri
    return f"sqlite:///{(Path(train_dir) / FOLDER / 'mlflow.db').resolve()}"


def client(uri: str):
    """A client that fails at once on a server that does not answer (MLflow retries for minutes by default)."""
    require("mlflow", "mlflow")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    try:
        c = MlflowClient(tracking_uri=uri)
        c.search_experiments(max_results=1)  # touches the store: a bad scheme, path or server fails here
    except Exception as e:
        raise TrackerError(f"train.mlflow_tracking_uri {uri!r}: MLflow cannot use this store: "
                           f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
    return c


class MlflowTracker:
    name = "mlflow"

    def __init__(self, train_dir: Path, cfg: TrainConfig, state: dict | None, params: dict[str, Any], resume_step: int,
                 run_name: str):
        self.uri = tracking_uri(train_dir, cfg)
        self.local = not cfg.mlflow_tracking_uri  # the store lives in the run directory
        if self.local:
            (Path(train_dir) / FOLDER).mkdir(parents=True, exist_ok=True)
        self.client = client(self.uri)
        from mlflow.entities import Param

        if state is None:
            exp = self.client.get_experiment_by_name(cfg.tracker_project)
            if exp is not None:
                exp_id = exp.experiment_id
            else:
                where = (Path(train_dir) / FOLDER / "artifacts").resolve().as_uri() if not cfg.mlflow_tracking_uri else None
                exp_id = self.client.create_experiment(cfg.tracker_project, artifact_location=where)
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            items = [Param(k, v) for k, v in flat_params(params).items()]
            for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=items[i : i + 100])
            self._logged: dict[str, int] = {}
        else:
            self.run_id = state["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            self._logged = {}
            for kind in ("train", "val"):
                hist = self.client.get_metric_history(self.run_id, f"{kind}/loss")
                if hist:
                    self._logged[kind] = max(m.step for m in hist)

    def state(self) -> dict[str, Any]:
        # a local store is named relative to the train folder, so a run directory that moves keeps its tracker run
        return {"run_id": self.run_id, "tracking_uri": f"{FOLDER}/mlflow.db" if self.local else self.uri}

    def logged(self) -> dict[str, int]:
        return self._logged

    def _log(self, values: dict[str, float], step: int, t: float | None = None) -> None:
        from mlflow.entities import Metric

        ms = int((t or time.time()) * 1000)
        items = [Metric(k, v, ms, step) for k, v in values.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log(self, rec: dict[str, Any]) -> None:
        self._log(metric_values(rec), rec["step"], rec.get("time"))

    def summary(self, figures: dict[str, Any], step: int) -> None:
        nums = {f"final/{k}": float(v) for k, v in figures.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        self._log(nums, step)
        self.client.log_dict(self.run_id, figures, "train_figures.json")

    def table(self, name: str, rows: list[dict[str, Any]], values: dict[str, float], step: int) -> None:
        self._log({f"{name}/{k}": v for k, v in values.items()}, step)
        self.client.log_dict(self.run_id, {"rows": rows}, f"{name}_table.json")

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


def read_mlflow(uri: str, run_id: str) -> list[dict[str, Any]]:
    """Every logged point of a run, with MLflow's own client, as metrics.jsonl-shaped records. A step logged twice
    comes back as two records, so a duplicate is visible."""
    c = client(uri)
    points: dict[tuple[str, int, int], dict[str, float]] = {}
    for key in c.get_run(run_id).data.metrics:
        kind, field = split_tag(key)
        seen: dict[int, int] = {}
        for m in sorted(c.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)):
            n = seen[m.step] = seen.get(m.step, -1) + 1
            points.setdefault((kind, m.step, n), {})[f"{kind}/{field}"] = m.value
    out = []
    for n in sorted({k[2] for k in points}):
        out += records_from_metrics({(k, s): v for (k, s, i), v in points.items() if i == n})
    return sorted(out, key=lambda r: r["step"])
