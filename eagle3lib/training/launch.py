"""Launching training: `python -m eagle3lib.stages.train` in a subprocess, under torchrun when
train.nproc_per_node * nnodes > 1, its console lines streamed; what the train stage and the data-scaling stage call."""

from __future__ import annotations

from typing import Any

from eagle3lib.config.stages import StageContext
from eagle3lib.core.stage_lock import running
from eagle3lib.core.torchrun import run_stage_processes, torchrun_command, torchrun_env
from eagle3lib.data.packing import validation_count
from eagle3lib.data.store_index import read_index, store_totals
from eagle3lib.trackers.run import check_trackers
from eagle3lib.training.setup import TrainingError

MODULE = "eagle3lib.stages.train"  # what each training process runs


def launch_command(ctx: StageContext, overrides: dict[str, Any] | None = None) -> list[str]:
    """The command that trains this stage: torchrun when the profile asks for several processes."""
    return torchrun_command(ctx.cfg, MODULE, ctx.rank_args(overrides))


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
    SIGTERM, so the run saves a checkpoint and the next launch resumes.
    """
    if busy := running(ctx.run_dir, "extract"):  # its store is missing or partial until it completes
        raise TrainingError(f"{busy}: {ctx.stage_dir('extract')} is still being written; train once it completes")
    check_trackers(ctx.cfg, ctx.dir)  # a tracker that cannot start fails now, not after torchrun's start-up
    _check_split(ctx)
    return run_stage_processes(ctx.cfg, MODULE, ctx.rank_args(), ctx.dir, "train", "training", TrainingError,
                               echo)
