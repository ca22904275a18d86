"""Checkpoint choice by acceptance: every validation scores the drafter by its estimated acceptance length, and
RUN_DIR/train/best/ holds the drafter of the best one (vLLM-loadable, like final/), with `selection.json` saying which
validation it was.

Why acceptance and not loss: the loss keeps falling on the training split long after the held-out acceptance has
peaked (over-trained EAGLE-3 drafters lose acceptance past ~4-5 epochs), and tau is what serving pays for.

Resume: the best so far travels in each step checkpoint's training state. A new best is written as a step checkpoint
first and as best/ second, so a run killed between the two resumes at exactly that step and writes best/ from the
weights it resumed (`on_resume`); best/ from beyond the resumed step (a damaged newer checkpoint was skipped) is dropped.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SELECTION = "selection.json"  # in best/: step, epoch and the validation's tau estimate


@dataclass
class Best:
    step: int = 0  # optimizer step of the best validation; 0 = none yet
    epoch: float = 0.0  # fractional epoch of that validation
    val_tau_est: float = float("-inf")  # its estimated acceptance length on the validation split
    validations: int = 0  # validations scored so far
    since_best: int = 0  # validations since the best one (train.patience stops the run when this reaches it)
    last_val_tau_est: float | None = None  # the latest validation's estimate: is the run still improving?
    train_tau_est: float | None = None  # the last train record's estimate up to that step: the training-split
    train_cond_acc: list[float] | None = None  # estimate of these weights, which evaluate shows beside the measured tau
    by: str = "estimate"  # what the score is (train.best_by): the validation's tau estimate, or a served probe's tau

    def state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> Best:
        return cls(**state) if state else cls()

    def is_better(self, val_rec: dict[str, Any]) -> bool:
        """Strictly better only: on a tie the earlier (cheaper, less trained) drafter stays."""
        tau = val_rec.get("tau_est")
        return tau is not None and float(tau) > self.val_tau_est

    def take(self, val_rec: dict[str, Any], train_rec: dict[str, Any], ttt_steps: int) -> None:
        self.step, self.epoch, self.val_tau_est = int(val_rec["step"]), float(val_rec["epoch"]), float(val_rec["tau_est"])
        self.since_best = 0
        self.train_tau_est = train_rec.get("tau_est")
        self.train_cond_acc = [train_rec[f"cond_acc_{k}"] for k in range(ttt_steps)] if train_rec else None

    def scored(self, val_rec: dict[str, Any]) -> None:
        """Count a validation (before `take` when it is a new best, which resets `since_best`)."""
        self.validations += 1
        self.since_best += 1
        self.last_val_tau_est = float(val_rec["tau_est"]) if val_rec.get("tau_est") is not None else None

    @property
    def still_improving(self) -> bool:
        """The last validation is the best: more epochs or more data may still raise acceptance."""
        return self.validations > 0 and self.last_val_tau_est is not None and self.last_val_tau_est >= self.val_tau_est

    @property
    def score_name(self) -> str:
        """The figure the score is written as: best_val_tau_est, or best_served_greedy_tau / best_served_sampled_tau."""
        return "best_val_tau_est" if self.by == "estimate" else f"best_{self.by}_tau"

    def figures(self, val_rec_of_best: dict[str, Any] | None, ttt_steps: int) -> dict[str, Any]:
        """Manifest figures of the chosen drafter: where it is, its estimate, and its per-step accuracies (so
        evaluate compares the measured tau with the estimate of the drafter it measures)."""
        f: dict[str, Any] = {"best_step": self.step or None, "best_epoch": round(self.epoch, 4) if self.step else None,
                             self.score_name: self.val_tau_est if self.step else None, "best_by": self.by,
                             "still_improving": self.still_improving, "validations": self.validations}
        f["best_train_tau_est"] = self.train_tau_est if self.step else None
        for k in range(ttt_steps):
            f[f"best_val_cond_acc_{k}"] = (val_rec_of_best or {}).get(f"cond_acc_{k}")
            f[f"best_train_cond_acc_{k}"] = self.train_cond_acc[k] if self.step and self.train_cond_acc else None
        return f


def selection(best: Best) -> dict[str, Any]:
    """best/selection.json: which validation chose this drafter."""
    name = best.score_name.removeprefix("best_")
    return {"step": best.step, "epoch": best.epoch, name: best.val_tau_est, "chosen_by": name}


def read_selection(best_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((best_dir / SELECTION).read_text())
    except (OSError, ValueError):
        return None


def on_resume(best_dir: Path, best: Best, resumed_step: int) -> str:
    """What a resumed run does with best/: "keep" (it holds the checkpoint's best), "write" (the checkpoint's best is
    the step it resumed, and best/ was not written before the run was killed: write it from the resumed weights) or
    "forget" (best/ is missing, or from past the resumed step: the caller removes it, and the validations from here
    choose again). Reads only, so every rank can decide alike."""
    sel = read_selection(best_dir)
    on_disk = int(sel["step"]) if sel else 0
    if not best.step or on_disk == best.step:
        return "keep"
    return "write" if best.step == resumed_step else "forget"
