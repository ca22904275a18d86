"""What a run has done so far: the counters, the open logging window and the best checkpoint so far (`LoopState`) are
saved in every checkpoint and restored by the same pair of methods, so a resumed run continues the same counts and
writes the same records. (The learning-rate schedule is a function of the step alone: schedule.py, no state.)"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from eagle3lib.model.ttt import STAT_KEYS
from eagle3lib.training.best import Best


@dataclass
class Progress:
    """What the run has done so far: saved in every checkpoint, so a resumed run continues the same counts."""

    step: int = 0  # optimizer steps taken
    tokens_seen: int = 0
    samples_seen: int = 0
    elapsed_s: float = 0.0  # wall time of earlier invocations (this one's is added on save)
    oov_step0: int = 0  # step-0 positions whose verifier argmax lies outside the draft vocabulary
    counted_step0: int = 0  # step-0 positions counted

    # one pair of methods saves and restores every field (a field added here is saved and restored alike)
    def state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, saved: dict[str, Any]) -> Progress:
        """The counters of a checkpoint's training state; one it predates reads as its default."""
        return cls(**{f.name: type(f.default)(saved[f.name]) for f in fields(cls) if f.name in saved})


class Window:
    """Sums over a logging window (local to this process until reduced); part of the checkpoint, so a run resumed
    mid-window writes the same record as an uninterrupted one."""

    COUNTS = ("seconds", "tokens", "samples", "steps")  # saved and restored with the stats, by the same names

    def __init__(self, K: int, device, saved: dict[str, Any] | None = None):
        self.stats = torch.zeros(len(STAT_KEYS), K, dtype=torch.float64, device=device)
        self.seconds = 0.0  # training time (data wait included, validation and checkpoints excluded)
        self.tokens = 0
        self.samples = 0
        self.steps = 0
        if saved:
            self.stats += saved["stats"].to(device)
            for name in self.COUNTS:
                setattr(self, name, saved[name])

    def state(self) -> dict[str, Any]:
        return {"stats": self.stats.cpu(), **{name: getattr(self, name) for name in self.COUNTS}}


@dataclass
class LoopState:
    """Everything a resumed run continues from besides the weights, the optimizer and the random streams: the
    counters, the open logging window and the best checkpoint so far. Its one owner is the Trainer; `state` writes it
    into a checkpoint's training state and `from_state` reads it back, field by field by name."""

    progress: Progress
    window: Window
    best: Best

    @classmethod
    def start(cls, K: int, device) -> LoopState:
        return cls(Progress(), Window(K, device), Best())

    def state(self, elapsed_s: float) -> dict[str, Any]:
        """The training state's loop fields, the wall time so far (`elapsed_s`, this invocation's included)."""
        return {**self.progress.state(), "elapsed_s": elapsed_s, "window": self.window.state(),
                "best": self.best.state()}

    @classmethod
    def from_state(cls, saved: dict[str, Any], K: int, device) -> LoopState:
        return cls(Progress.from_state(saved), Window(K, device, saved.get("window")), Best.from_state(saved.get("best")))
