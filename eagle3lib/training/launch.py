"""Launching training: `python -m eagle3lib.stages.train` in a subprocess, under torchrun when
train.nproc_per_node * nnodes > 1, its console lines streamed; what the train stage and the data-scaling stage call."""

from __future__ import annotations

import json
from typing import Any

from eagle3lib.config.stages import StageContext
from eagle3lib.core.manifest import read_manifest
from eagle3lib.core.stage_lock import running
from eagle3lib.core.torchrun import failure_cause, run_streamed, torchrun_command, torchrun_env
from eagle3lib.data.packing import validation_count
from eagle3lib.data.store_index import read_index, store_totals
from eagle3lib.trackers.run import check_trackers
from eagle3lib.training.setup import TrainingError


def launch_command(ctx: StageContext, overrides: dict[str, Any] | None = None) -> list[str]:
    """The command that trains this stage: torchrun when the profile asks for several processes."""
    args = ["--profile", str(ctx.profile.path), "--run-dir", str(ctx.run_dir),
            "--overrides-json", json.dumps(overrides if overrides is not None else ctx.profile.overrides)]
    if ctx.out_dir is not None:
        args += ["--out-dir", str(ctx.out_dir)]
    return torchrun_command(ctx.cfg, "eagle3lib.stages.train", args)


def launch_env(ctx: StageContext) -> dict[str, str]:
    return torchrun_env(ctx.cfg.nproc_per_node)


def _check_split(ctx: StageContext) -> None:
    """A validation split that leaves no training samples, known from the store's index before any process starts
    (each rank found it after torchrun's start-up)."""
    store = ctx.stage_dir("extract")
    if not (store / "index.jsonl").exists():
        return  # no store yet, or one the loop names better
    cfg = ctx.cfg
    n = store_totals(read_index(store, strict=False))["samples"]
    n = n if cfg.max_samples is None else min(n, cfg.max_samples)
    if n and n - validation_count(n, cfg.val_fraction, cfg.val_max_samples) <= 0:
        raise TrainingError(f"train.val_fraction={cfg.val_fraction}: the validation split takes all {n} samples of "
                            f"{store}; lower it (or train.val_max_samples)")


def launch(ctx: StageContext, *, echo=print) -> dict[str, Any]:
    """Run training in a subprocess (torchrun for several processes), streaming its console lines.

    A subprocess even for one process: the notebook kernel stays small and responsive, a crash (out of memory) does
    not take the kernel with it, and one and many processes run exactly the same code. Interrupting the notebook sends
    SIGTERM, so the run saves a checkpoint and the next launch resumes. The processes start in the stage folder, not
    the repository: `python -m` puts its folder on the path, and the repository's top-level `kernels/` must not shadow
    Hugging Face's `kernels` package there (ours is `eagle3lib.kernels`).
    """
    if busy := running(ctx.run_dir, "extract"):  # its store is missing or partial until it completes
        raise TrainingError(f"{busy}: {ctx.stage_dir('extract')} is still being written; train once it completes")
    check_trackers(ctx.cfg, ctx.dir)  # a tracker that cannot start fails now, not after torchrun's start-up
    _check_split(ctx)
    ctx.dir.mkdir(parents=True, exist_ok=True)  # the processes start in it
    log = ctx.dir / "train.log"  # every line of every process; the console and the error keep the one that matters
    returncode, tail = run_streamed(launch_command(ctx), str(ctx.dir), launch_env(ctx),
                                    lambda line: line.startswith("[train"), echo, log)
    m = read_manifest(ctx.dir) or {}
    if returncode == 0 and ctx.cfg.nnodes > 1 and m.get("status") != "complete":
        echo(f"[train] this node's processes finished; rank 0 ran on another node and wrote the results to its "
             f"{ctx.dir}")  # a RUN_DIR that is not shared between the nodes
        return m
    if returncode != 0 or m.get("status") != "complete":
        msg = m.get("error") or failure_cause(tail) or f"exit code {returncode}"
        raise TrainingError(f"training failed: {msg} (every process's output: {log})")
    return m
