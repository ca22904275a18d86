"""Numbers as people read them in a report: the figures of a manifest as a two-column table."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import polars as pl


def fmt(value: Any) -> str:
    """Thousands separators for counts, 4 significant digits for measurements, plain text for the rest."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == int(value) and abs(value) < 1e15:
            return f"{int(value):,}"
        return f"{value:,.4g}" if abs(value) >= 1e-3 else f"{value:.3g}"
    if isinstance(value, list | tuple):
        return ", ".join(fmt(v) for v in value)
    return str(value)


def figures_table(figures: dict[str, Any], skip: Iterable[str] = ()) -> pl.DataFrame:
    """figure | value, in the manifest's order, every row shown (the stage's manifest.json holds the raw numbers)."""
    skip = set(skip)
    rows = [(k, fmt(v)) for k, v in figures.items() if k not in skip and not isinstance(v, dict)]
    return pl.DataFrame(rows, schema={"figure": pl.String, "value": pl.String}, orient="row")


def full_tables() -> None:
    """Show polars tables whole in this notebook (no "…" rows or columns): report tables are read, not skimmed."""
    pl.Config.set_tbl_rows(-1)
    pl.Config.set_tbl_cols(-1)
    pl.Config.set_tbl_width_chars(250)
    pl.Config.set_fmt_str_lengths(160)
    pl.Config.set_tbl_hide_dataframe_shape(True)
