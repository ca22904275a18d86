# .venv/bin/python -m pytest -q tests/test_trackers.py
"""TensorBoard, W&B (offline) and MLflow (local SQLite store) get the records metrics.jsonl gets, read back with each
tracker's own reader: TensorBoard's EventAccumulator, the W&B offline run files parsed with W&B's protobuf schema, and
MLflow's client on the store. One real training run is killed with SIGKILL (its whole process group, W&B's service
included) past a checkpoint and resumed: every tracker still holds each step exactly once, in the same tracker run.
Bad tracker settings are clear errors before any training. No network: W&B runs offline, MLflow on a local file."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_fixtures import cached_store, make_run_dir

from eagle3lib.config.profile import ParamsError, load_profile
from eagle3lib.config.stages import open_stage
from eagle3lib.core.manifest import read_manifest
from eagle3lib.trackers.base import TrackerError
from eagle3lib.trackers.mlflow_log import client, read_mlflow, tracking_uri
from eagle3lib.trackers.run import check_trackers, log_evaluation, read_state
from eagle3lib.trackers.tensorboard_log import read_tensorboard
from eagle3lib.trackers.wandb_log import read_summary, read_wandb, run_files
from eagle3lib.training.launch import launch, launch_command, launch_env
from eagle3lib.training.loop import train
from eagle3lib.training.metrics import read_metrics

# ~120 samples, 3 epochs of ~4 steps: validation at steps 4, 8, 12; checkpoints every 5 steps
RUN = {"train.served_eval_every": 0,  # the records of training alone (probes: tests/test_served_probe.py)
       "train.max_samples": 120, "train.epochs": 3, "train.log_every": 1, "train.ckpt_every": 5,
       "train.nproc_per_node": 1, "train.report_to": ["tensorboard", "wandb", "mlflow"]}
KILL_AT = 7  # the first attempt is killed once a record of this step is on disk: past the step-5 checkpoint
TIMINGS = ("time", "elapsed_s", "tokens_per_s", "samples_per_s", "peak_mem_mb")  # not reproduced by a resume


@pytest.fixture(scope="module")
def resumed(tiny_verifier, tmp_path_factory):
    """(train ctx, final manifest, the records of the killed first attempt)."""
    run = make_run_dir(tmp_path_factory.mktemp("trackers"), cached_store(tiny_verifier, 300))
    ctx = open_stage("train", "tiny", run, RUN)
    proc = subprocess.Popen(launch_command(ctx), env=launch_env(ctx), cwd=ctx.dir, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if any(r["step"] >= KILL_AT for r in read_metrics(ctx.dir / "metrics.jsonl")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stdout.read()
    os.killpg(proc.pid, signal.SIGKILL)  # a node that dies: nothing is closed, W&B's service dies too
    proc.wait()
    first = read_metrics(ctx.dir / "metrics.jsonl")
    assert (read_manifest(ctx.dir) or {}).get("status") != "complete"
    m = train(open_stage("train", "tiny", run, RUN))
    assert m["figures"]["resumed_from_step"] == 5
    return ctx, m, first


def _readers(train_dir: Path) -> dict[str, list[dict]]:
    state = read_state(train_dir)
    cfg = load_profile("tiny", {k: v for k, v in RUN.items()}).section("train")
    out = {"tensorboard": read_tensorboard(train_dir / "tensorboard"),
           "wandb": read_wandb(train_dir / "wandb", state["wandb"]["run_id"]),
           "mlflow": read_mlflow(tracking_uri(train_dir, cfg), state["mlflow"]["run_id"])}
    return {k: [r for r in v if r["kind"] in ("train", "val")] for k, v in out.items()}


def _close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


@pytest.mark.slow
def test_each_tracker_holds_every_record_once_after_a_kill_and_resume(resumed):
    ctx, m, first = resumed
    jsonl = read_metrics(ctx.dir / "metrics.jsonl")
    keys = [(r["kind"], r["step"]) for r in jsonl]
    assert ("val", 4) in keys and ("val", 8) in keys and keys[-1] == ("val", m["figures"]["steps"])
    killed_at = max(r["step"] for r in first)
    assert killed_at >= KILL_AT
    before_kill = {(r["kind"], r["step"]): r for r in first if r["step"] > 5}  # logged, then recomputed on resume
    for name, recs in _readers(ctx.dir).items():
        assert [(r["kind"], r["step"]) for r in recs] == keys, name  # no step missing, none twice
        rel = 1e-6 if name == "tensorboard" else 1e-12  # TensorBoard stores float32
        for got, want in zip(recs, jsonl, strict=True):
            fields = set(want) - {"kind", "step"} - {"time"}
            assert fields <= set(got), (name, sorted(fields - set(got)))
            for f in fields:
                if f in TIMINGS and name != "tensorboard" and (want["kind"], want["step"]) in before_kill:
                    # W&B and MLflow keep what the killed attempt got onto disk for these steps (its timings), and
                    # the resumed run logs the rest
                    earlier = before_kill[(want["kind"], want["step"])][f]
                    assert _close(got[f], earlier, rel) or _close(got[f], want[f], rel), (name, want["step"], f)
                else:
                    assert _close(got[f], want[f], rel), (name, want["kind"], want["step"], f, got[f], want[f])


@pytest.mark.slow
def test_the_resumed_run_continues_the_same_tracker_runs(resumed):
    ctx, m, _ = resumed
    state = read_state(ctx.dir)
    assert len(run_files(ctx.dir / "wandb", state["wandb"]["run_id"])) == 2  # two attempts, one run id
    cfg = open_stage("train", "tiny", ctx.run_dir, RUN).cfg
    c = client(tracking_uri(ctx.dir, cfg))
    exp = c.get_experiment_by_name(cfg.tracker_project)
    runs = c.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [state["mlflow"]["run_id"]]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == str(cfg.lr) and run.data.params["profile"] == "tiny"
    assert len(list((ctx.dir / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one writer per attempt
    assert m["outputs"]["trackers"] == "trackers.json" and m["outputs"]["tensorboard"] == "tensorboard"


@pytest.mark.slow
def test_final_figures_are_the_runs_summary(resumed):
    ctx, m, _ = resumed
    fig = m["figures"]
    state = read_state(ctx.dir)
    summary = read_summary(ctx.dir / "wandb", state["wandb"]["run_id"])
    assert summary["val_tau_est"] == fig["val_tau_est"] and summary["steps"] == fig["steps"]
    cfg = open_stage("train", "tiny", ctx.run_dir, RUN).cfg
    run = client(tracking_uri(ctx.dir, cfg)).get_run(state["mlflow"]["run_id"])
    assert _close(run.data.metrics["final/val_tau_est"], fig["val_tau_est"], 1e-12)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(ctx.dir / "tensorboard"))
    ea.Reload()
    assert {"summary/text_summary", "params/text_summary"} <= set(ea.Tags()["tensors"])


@pytest.mark.slow
def test_evaluation_table_goes_to_the_same_runs(resumed):
    ctx, m, _ = resumed
    cfg = open_stage("train", "tiny", ctx.run_dir, RUN).cfg
    steps = m["figures"]["steps"]
    rows = [{"method": "vllm_greedy", "tau": 2.5, "accept_rate_pos_1": 0.7}]
    assert log_evaluation(cfg, ctx.dir, "evaluate", rows, {"tau_vllm_greedy": 2.5}, steps) == []
    tb = [r for r in read_tensorboard(ctx.dir / "tensorboard") if r["kind"] == "evaluate"]
    assert tb == [{"kind": "evaluate", "step": steps + 1, "tau_vllm_greedy": 2.5, "time": tb[0]["time"]}]
    state = read_state(ctx.dir)
    assert read_summary(ctx.dir / "wandb", state["wandb"]["run_id"])["evaluate/tau_vllm_greedy"] == 2.5
    run = client(tracking_uri(ctx.dir, cfg)).get_run(state["mlflow"]["run_id"])
    assert run.data.metrics["evaluate/tau_vllm_greedy"] == 2.5
    # and the training records are untouched
    assert [(r["kind"], r["step"]) for r in _readers(ctx.dir)["tensorboard"]] == \
        [(r["kind"], r["step"]) for r in read_metrics(ctx.dir / "metrics.jsonl")]


@pytest.mark.slow
def test_learning_curves_read_a_tensorboard_folder(resumed):
    from eagle3lib.analysis.curves import load_run
    from eagle3lib.analysis.log_sources import expand_sources

    ctx, _, _ = resumed
    (tb,) = expand_sources([str(ctx.run_dir)], ctx.dir / "metrics.jsonl")  # the folder above: found by its events
    (js,) = expand_sources([str(ctx.dir / "metrics.jsonl")], ctx.dir / "metrics.jsonl")
    a, b = load_run(tb), load_run(js)
    assert a.format == "tensorboard" and a.label == ctx.run_dir.name == b.label
    for col in ("step", "loss", "tau_est", "full_acc_0"):
        x, y = a.frame[col].to_list(), b.frame[col].to_list()
        assert len(x) == len(y) and all(_close(p, q, 1e-6) for p, q in zip(x, y, strict=True) if q is not None), col


# ------------------------------------------------------------------------------------------------ bad settings
def _cfg(**over):
    return load_profile("tiny", {f"train.{k}": v for k, v in over.items()}).section("train")


def test_bad_tracker_settings_are_clear_errors_before_training(tmp_path, monkeypatch):
    with pytest.raises(TrackerError, match=r"train.mlflow_tracking_uri 'foo://bar'"):
        check_trackers(_cfg(report_to=["mlflow"], mlflow_tracking_uri="foo://bar"), tmp_path)
    t0 = time.time()
    with pytest.raises(TrackerError, match=r"train.mlflow_tracking_uri 'http://127.0.0.1:9'.*cannot use"):
        check_trackers(_cfg(report_to=["mlflow"], mlflow_tracking_uri="http://127.0.0.1:9"), tmp_path)
    assert time.time() - t0 < 30  # no minutes of retries against a server that is not there
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(TrackerError, match=r"train.wandb_mode is 'online' but no W&B API key"):
        check_trackers(_cfg(report_to=["wandb"], wandb_mode="online"), tmp_path)
    with pytest.raises(ParamsError, match=r"train.report_to.*twice"):
        _cfg(report_to=["wandb", "wandb"])
    with pytest.raises(ParamsError, match=r"train.report_to"):
        _cfg(report_to=["tensorbord"])


def test_a_tracker_that_is_not_installed_names_its_extra(tmp_path):
    """In a fresh interpreter where importing wandb fails, as on an install without the extra."""
    code = ("import sys; sys.modules['wandb'] = None\n"
            "from eagle3lib.config.profile import load_profile\n"
            "from eagle3lib.trackers.run import check_trackers\n"
            "check_trackers(load_profile('tiny', {'train.report_to': ['wandb']}).section('train'), None)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1
    assert "TrackerError: train.report_to lists 'wandb', but its package is not installed" in r.stderr
    assert "pip install -e '.[wandb]'" in r.stderr


def test_the_stage_fails_before_launching_anything(tmp_path):
    run = tmp_path / "run"
    ctx = open_stage("train", "tiny", run, {"train.report_to": ["mlflow"], "train.mlflow_tracking_uri": "foo://bar"})
    with pytest.raises(TrackerError, match="foo://bar"):
        launch(ctx, echo=lambda *_: None)
    assert sorted(p.name for p in ctx.dir.iterdir()) == []  # no manifest, no metrics: nothing started
    assert json.dumps(read_state(ctx.dir)) == "{}"
