"""The data_scaling stage: how much data buys how much acceptance, and what a target acceptance costs (the study:
eagle3lib/studies/data_scaling.py). Outputs in RUN_DIR/data_scaling/: fit.json, cost_for_target.csv, manifest.json."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eagle3lib.config.stages import StageContext
from eagle3lib.studies import data_scaling as study


def run(ctx: StageContext, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The stage (the notebook's one call): returns fit.json's content."""
    return study.run(ctx, echo)
