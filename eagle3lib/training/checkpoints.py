"""Step checkpoints of a training run: where they live, which one a run resumes, and the Trainer's saves.

    RUN_DIR/train/checkpoints/step_NNNNNNNN/   the drafter (speculators layout) + training_state.pt (eagle3lib/model/
                                               checkpoint.py writes both, to a temporary folder renamed when complete)
    RUN_DIR/train/best/                        the drafter of the best validation (eagle3lib/training/best.py)

A run resumes the newest step checkpoint that reads (a damaged newer one is skipped and named) when its drafter,
draft vocabulary and frozen parameters match this run's; the newest `train.keep_checkpoints` are kept.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3lib.model.checkpoint import TRAINING_STATE, CheckpointError, load_state, save_drafter
from eagle3lib.model.drafter import DrafterConfig
from eagle3lib.training import distributed as dist
from eagle3lib.training.best import SELECTION, Best, on_resume, selection

if TYPE_CHECKING:  # the Trainer calls these with itself
    from eagle3lib.training.loop import Trainer

CKPT_RE = re.compile(r"^step_(\d{8})$")


def list_checkpoints(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = CKPT_RE.match(p.name)
        if m and (p / TRAINING_STATE).exists() and (p / "model.safetensors").exists():
            out.append((int(m.group(1)), p))
    return sorted(out)


def checkpoint_dir(ckpt_root: str | Path, step: int) -> Path:
    return Path(ckpt_root) / f"step_{step:08d}"


def prune_checkpoints(ckpt_root: str | Path, keep: int) -> None:
    for _, p in list_checkpoints(ckpt_root)[: -keep if keep > 0 else None]:
        shutil.rmtree(p, ignore_errors=True)
    for p in Path(ckpt_root).glob(".tmp-*"):  # a killed writer's leftovers
        shutil.rmtree(p, ignore_errors=True)


def newest_readable(ckpts: list[tuple[int, Path]]) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor], list[str]]:
    """The newest step checkpoint whose training state and weights read, and what was wrong with the newer ones: a
    damaged newer one (a disk that filled up, a copy cut short) is skipped, so a run resumes a little earlier instead
    of failing."""
    damaged = []
    for _, path in reversed(ckpts):
        try:
            return path, load_training_state(path), load_state(path), damaged
        except CheckpointError as e:
            damaged.append(str(e))
    raise CheckpointError("no step checkpoint reads:\n  " + "\n  ".join(damaged) + "\ndelete them to start over "
                          "(or set train.resume=false)")


def load_training_state(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / TRAINING_STATE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read the training state ({type(e).__name__}: {e})") from e


def check_compatible(ckpt_dir: str | Path, cfg: DrafterConfig, draft_ids: torch.Tensor, saved: dict[str, Any],
                     freeze_lm_head: bool = False, optimizer: str = "adamw") -> None:
    """Raise naming every difference between a checkpoint and the run that wants to resume from it."""
    old = DrafterConfig.from_dict(saved["drafter_config"]).structure()
    new = cfg.structure()
    diffs = [f"{k}: checkpoint {old.get(k)!r}, now {new.get(k)!r}" for k in new if old.get(k) != new.get(k)]
    old_ids = saved.get("draft_ids")
    if old_ids is not None and not torch.equal(old_ids.cpu(), draft_ids.cpu()):
        diffs.append("draft vocabulary differs")
    if bool(saved.get("freeze_lm_head", False)) != freeze_lm_head:  # the optimizer state holds other parameters
        diffs.append(f"train.freeze_lm_head: checkpoint {bool(saved.get('freeze_lm_head', False))}, now {freeze_lm_head}")
    if saved.get("optimizer_name", "adamw") != optimizer:  # its state holds another optimizer's moments
        diffs.append(f"train.optimizer: checkpoint {saved.get('optimizer_name', 'adamw')!r}, now {optimizer!r}")
    if diffs:
        raise CheckpointError(f"{ckpt_dir}: cannot resume, the checkpoint was trained with another configuration "
                              f"({'; '.join(diffs)}). Use a new run directory, or set train.resume=false to start over.")


# ------------------------------------------------------------------------------------------- the Trainer's saves

def save_step(t: Trainer, step: int) -> Path:
    """Step checkpoint with the resume state (all ranks take part in gathering; rank 0 writes)."""
    state = dist.model_state(t.module)
    optim = dist.optimizer_state(t.module, t.opt)
    path = checkpoint_dir(t.ckpt_root, step)
    if t.rank == 0:
        training_state = {
            **t.progress.state(), "step": step, "elapsed_s": t.elapsed(), "optimizer": optim,
            "scheduler": {"step": step, "total_steps": t.plan.total_steps},
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state(t.device) if t.device.type == "cuda" else None,
            "drafter_config": t.dcfg.to_dict(), "draft_ids": t.vocab.draft_ids,
            "freeze_lm_head": t.cfg.freeze_lm_head, "optimizer_name": t.cfg.optimizer,
            "data": {"epoch": t.plan.locate(step - 1)[0] if step else 0, "seed": t.cfg.seed},
            "window": t.window.state(), "best": t.best.state(),
        }
        save_drafter(state, t.dcfg, path, training_state)
        prune_checkpoints(t.ckpt_root, t.cfg.keep_checkpoints)
    dist.barrier()
    t.saved_step = step
    return path


def score(t: Trainer, val_rec: dict[str, Any]) -> None:
    """Checkpoint choice by acceptance (eagle3lib/training/best.py): a new best is saved as a step checkpoint (its
    training state names it) and then as best/. Every rank decides alike: the validation stats are reduced."""
    t.best.scored(val_rec)
    if not t.best.is_better(val_rec):
        return
    t.best.take(val_rec, t.last_train, t.cfg.ttt_steps)
    t.best_val = val_rec
    if t.progress.step < t.plan.total_steps:  # the last step's checkpoint is the finish's
        t.last_ckpt = save_step(t, t.progress.step)
    write_best(t)


def write_best(t: Trainer) -> None:
    state = dist.model_state(t.module)
    if t.rank == 0:
        save_drafter(state, t.dcfg, t.out_dir / "best", extra_files={SELECTION: selection(t.best)})
    dist.barrier()


def restore_best(t: Trainer, log) -> None:
    """After a resume: best/ written from the resumed weights, kept, or dropped (eagle3lib/training/best.py)."""
    action = on_resume(t.out_dir / "best", t.best, t.progress.step)
    dist.barrier()  # every rank has read best/ before rank 0 may remove it
    if action == "write":
        write_best(t)
    elif action == "forget":
        if t.rank == 0:
            shutil.rmtree(t.out_dir / "best", ignore_errors=True)
        log(f"best/ is not the resumed checkpoint's best (step {t.best.step}): the validations from here choose again")
        t.best = Best()
