"""What a run has done so far and how its learning rate moves: the counters and the open logging window are saved in
every checkpoint, so a resumed run continues the same counts and writes the same records; the schedule is a function
of the step alone, so it needs no state."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from eagle3lib.config.train import TrainConfig
from eagle3lib.model.ttt import STAT_KEYS


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warmup over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    p = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))


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
