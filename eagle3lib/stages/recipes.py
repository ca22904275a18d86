"""The recipes stage: which drafting recipe accepts most, measured the way it will be served (the study:
eagle3lib/studies/recipes.py). Outputs in RUN_DIR/recipes/: recipes.json, recipes.csv, recipes.png, manifest.json."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eagle3lib.config.stages import StageContext
from eagle3lib.reports.recipes import plot_recipes
from eagle3lib.studies import recipes as study


def run(ctx: StageContext, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The stage (the notebook's one call): returns recipes.json's content."""
    return study.run(ctx, echo, plot=plot_recipes)
