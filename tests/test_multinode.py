# .venv/bin/python -m pytest -q tests/test_multinode.py
"""Training across nodes through torchrun's own c10d rendezvous (no cluster code of ours): two torchrun agents on
127.0.0.1 (train.nnodes 2, one process each) train the curve one process trains, rank 0 writing every file once; and a
run resumed at another world size (1 process, then 2) continues the same curve."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
from train_fixtures import cached_store, make_run_dir

from eagle3lib.config.stages import open_stage
from eagle3lib.core.manifest import read_manifest
from eagle3lib.training.launch import launch, launch_command, launch_env
from eagle3lib.training.loop import train
from eagle3lib.training.metrics import read_metrics
from eagle3lib.vllm.server import free_port

# one epoch of ~285 samples in 1K-token rows, 2 rows a step: ~17 steps, each logged; a checkpoint every 5
RUN = {"train.epochs": 1, "train.log_every": 1, "train.ckpt_every": 5, "train.nproc_per_node": 1,
       "train.warmup_steps": 4}
FIELDS = ["loss", "loss_0", "loss_1", "loss_2", "full_acc_0", "tau_est", "lr", "tokens_seen", "samples_seen"]


@pytest.fixture(scope="module")
def store(tiny_verifier) -> Path:
    return cached_store(tiny_verifier, 300)


@pytest.fixture(scope="module")
def one_process(store, tmp_path_factory):
    ctx = open_stage("train", "tiny", make_run_dir(tmp_path_factory.mktemp("one"), store), RUN)
    return ctx, train(ctx)


def _curve(train_dir: Path) -> dict:
    # the training curve: train and validation records (the tiny profile's served probes: tests/test_served_probe.py)
    return {(r["kind"], r["step"]): r for r in read_metrics(train_dir / "metrics.jsonl") if r["kind"] in ("train", "val")}


def _same_curve(a: dict, b: dict, rtol: float = 2e-4) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for key in a:
        for f in FIELDS if key[0] == "train" else FIELDS[:6]:
            assert math.isclose(a[key][f], b[key][f], rel_tol=rtol, abs_tol=1e-7), (key, f, a[key][f], b[key][f])


@pytest.mark.slow
def test_two_nodes_equal_one_process(store, one_process, tmp_path):
    ref, m_ref = one_process
    run = make_run_dir(tmp_path / "run", store)
    ctx = open_stage("train", "tiny", run, {**RUN, "train.nnodes": 2,
                                            "train.rdzv_endpoint": f"127.0.0.1:{free_port()}"})
    cmd = launch_command(ctx)
    assert "--nnodes=2" in cmd and "--rdzv-backend=c10d" in cmd
    ctx.dir.mkdir(parents=True, exist_ok=True)
    agents = [subprocess.Popen(cmd, env=launch_env(ctx), cwd=ctx.dir, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]  # "node 0" and "node 1"
    outs = [a.communicate(timeout=600)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    m = read_manifest(ctx.dir)
    assert m["status"] == "complete" and m["figures"]["num_processes"] == 2
    _same_curve(_curve(ref.dir), _curve(ctx.dir))
    # rank 0 wrote every record once (no per-rank duplicates) and each checkpoint once
    recs = read_metrics(ctx.dir / "metrics.jsonl")
    assert len(recs) == len({(r["kind"], r["step"]) for r in recs})
    assert sorted(p.name for p in (ctx.dir / "checkpoints").iterdir()) == sorted(
        p.name for p in (ref.dir / "checkpoints").iterdir())


@pytest.mark.slow
def test_resume_at_another_world_size_continues_the_curve(store, one_process, tmp_path):
    """Killed after step 7 in one process (the newest checkpoint is step 5), resumed by torchrun with 2: the plan
    deals the same global batch to any process count, and the checkpoint holds full (unsharded) states."""
    ref, _ = one_process
    run = make_run_dir(tmp_path / "run", store)

    class Killed(Exception):
        pass

    def kill_after_step_7(rec):
        if rec["kind"] == "train" and rec["step"] == 7:
            raise Killed

    with pytest.raises(Killed):
        train(open_stage("train", "tiny", run, RUN), on_record=kill_after_step_7)
    m = launch(open_stage("train", "tiny", run, {**RUN, "train.nproc_per_node": 2}), echo=lambda _l: None)
    assert m["figures"]["resumed_from_step"] == 5 and m["figures"]["num_processes"] == 2
    _same_curve(_curve(ref.dir), _curve(run / "train"))
