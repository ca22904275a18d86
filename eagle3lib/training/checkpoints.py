"""Step checkpoints of a training run: where they live, which one a run resumes, and the store that saves them.

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
from typing import Any

import torch

from eagle3lib.model.checkpoint import TRAINING_STATE, CheckpointError, load_state, save_drafter
from eagle3lib.model.drafter import DrafterConfig
from eagle3lib.training import distributed as dist
from eagle3lib.training.best import SELECTION, Best, on_resume, selection

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


# ------------------------------------------------------------------------------------------- one run's store

class CheckpointStore:
    """RUN_DIR/train/checkpoints/ and best/ of one run, and which step it saved last (the finish saves the last step
    unless it is saved already) and where. Takes the module and optimizer it saves explicitly; only rank 0 writes,
    every rank takes part in gathering the state."""

    def __init__(self, out_dir: Path, keep: int, rank: int):
        self.out_dir, self.root, self.keep, self.rank = out_dir, out_dir / "checkpoints", keep, rank
        self.saved_step = -1  # the step of the newest checkpoint this run saved or resumed (-1: none)
        self.last: Path | None = None  # that checkpoint

    def open(self, resume: bool) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor], list[str]] | None:
        """The newest step checkpoint that reads (its path, training state, weights and what was wrong with newer
        ones), or None: starting over, when rank 0 clears an earlier run's checkpoints, final/ and best/ so that they
        are never resumed later."""
        ckpts = list_checkpoints(self.root) if resume else []
        if not ckpts:
            if self.rank == 0:
                for d in (self.root, self.out_dir / "final", self.out_dir / "best"):
                    shutil.rmtree(d, ignore_errors=True)
            return None
        found = newest_readable(ckpts)
        self.last, self.saved_step = found[0], int(found[1]["step"])
        return found

    def save(self, step: int, module: Any, optimizer: Any, dcfg: DrafterConfig, training_state: dict[str, Any]) -> Path:
        """The step checkpoint: weights and optimizer gathered from `module`, `training_state` beside them."""
        state = dist.model_state(module)
        optim = dist.optimizer_state(module, optimizer)
        path = checkpoint_dir(self.root, step)
        if self.rank == 0:
            save_drafter(state, dcfg, path, {**training_state, "optimizer": optim})
            prune_checkpoints(self.root, self.keep)
        dist.barrier()
        self.saved_step, self.last = step, path
        return path

    def write_best(self, module: Any, dcfg: DrafterConfig, best: Best) -> None:
        """best/: the drafter as it is now, with selection.json naming the validation that chose it."""
        state = dist.model_state(module)
        if self.rank == 0:
            save_drafter(state, dcfg, self.out_dir / "best", extra_files={SELECTION: selection(best)})
        dist.barrier()

    def restore_best(self, module: Any, dcfg: DrafterConfig, best: Best, step: int, log) -> Best:
        """After a resume at `step`: best/ written from the resumed weights, kept, or dropped (then the validations
        from here choose again: a fresh Best is returned) (eagle3lib/training/best.py)."""
        action = on_resume(self.out_dir / "best", best, step)
        dist.barrier()  # every rank has read best/ before rank 0 may remove it
        if action == "write":
            self.write_best(module, dcfg, best)
        elif action == "forget":
            if self.rank == 0:
                shutil.rmtree(self.out_dir / "best", ignore_errors=True)
            log(f"best/ is not the resumed checkpoint's best (step {best.step}): the validations from here choose again")
            return Best()
        return best
