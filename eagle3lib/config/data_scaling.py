"""The `data_scaling` section: how much data buys how much acceptance (eagle3lib/stages/data_scaling.py).

The drafter is trained again on nested fractions of this run's training split (the same held-out split for every
fraction), each scored by its best validation's estimated tau, the largest ones also by vLLM; a saturating curve of
tau against training tokens is fitted (eagle3lib/analysis/scaling.py) and inverted for `target_tau`, whose cost on
each hardware row comes from the cost_projection section's model and measurements.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from eagle3lib.config.base import StageConfig


class ReferencePoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str  # shown on the plot, e.g. "field run (estimate)"
    samples: int = Field(ge=1)  # training samples of that run
    tokens_per_sample: float = Field(gt=0)  # to place it on the tokens axis
    tau: float = Field(ge=1)  # its acceptance length (the middle of `tau_range` when only a range is known)
    tau_range: tuple[float, float] | None = None  # a range instead of one measurement, drawn as an error bar


class DataScalingConfig(StageConfig):
    fractions: list[float] = [0.125, 0.25, 0.5, 1.0]  # shares of the training split, each nested in the next; 1.0 is
    # the train stage's own run when its settings match (not trained again); [] = reference points only
    schedule: Literal["steps", "epochs"] = "steps"  # steps: every fraction trains as many optimizer steps as the full
    # data (epochs / fraction), its best validation chosen: the most that much data can buy, so the curve measures
    # data, not a shorter training; epochs: the same epochs (cheaper: a fraction f costs f of the full run)
    epochs: float | None = Field(None, gt=0)  # of the full data; None = train.epochs
    patience: int | None = Field(3, ge=1)  # train.patience of each fraction: a small one overfits within a few of its
    # many epochs, and stops there (its best/ kept) instead of training all the steps; None = every step
    vllm_points: int = Field(2, ge=0)  # the largest N fractions also measured by vLLM (greedy, evaluate's prompts and
    # settings); the largest reuses the evaluate stage's measurement when it measured the same drafter
    target_tau: float | None = Field(None, gt=1)  # the acceptance length to cost; None = the train stage's best val
    # estimate + 0.2 (what "a bit better than this run" needs)
    reference_points: list[ReferencePoint] = []  # runs measured elsewhere (the field run), drawn beside the fit and
    # fitted with the points when `fit_reference_points`
    fit_reference_points: bool = True  # they are data too; False = drawn only
    bootstrap_draws: int = Field(300, ge=10)  # resamplings of the validation samples, each re-scoring the points and
    # refitting the curve: the points' standard errors and the band (eagle3lib/analysis/scaling_points.py)

    @field_validator("fractions")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        bad = [f for f in v if not 0 < f <= 1]
        if bad:
            raise ValueError(f"fractions must be in (0, 1], got {bad}")
        if len(set(v)) != len(v):
            raise ValueError(f"lists a fraction twice: {v}")
        return sorted(v)
