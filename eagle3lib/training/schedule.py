"""The learning-rate schedule: a function of the step alone, so a resumed run needs no state for it."""

from __future__ import annotations

import math

from eagle3lib.config.train import TrainConfig


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warmup over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    p = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))
