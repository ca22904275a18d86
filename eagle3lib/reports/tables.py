"""Numbers as people read them in a report: the figures of a manifest as a two-column table."""

from __future__ import annotations

import html
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


class Table:
    """A table a notebook shows whole and formatted for people (polars cuts a long frame to "…" rows and prints dtype
    rows and quoted strings); `.frame` is the data."""

    def __init__(self, frame: pl.DataFrame):
        self.frame = frame

    def rows(self) -> list[tuple]:
        return self.frame.rows()

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.frame.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(v))}</td>" for v in row) + "</tr>"
                       for row in self.frame.iter_rows())
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def __repr__(self) -> str:
        with pl.Config(tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=200):
            return repr(self.frame)


def figures_table(figures: dict[str, Any], skip: Iterable[str] = ()) -> Table:
    """figure | value, in the manifest's order, every row shown (the stage's manifest.json holds the raw numbers)."""
    skip = set(skip)
    rows = [(k, fmt(v)) for k, v in figures.items() if k not in skip and not isinstance(v, dict)]
    return Table(pl.DataFrame(rows, schema={"figure": pl.String, "value": pl.String}, orient="row"))


def full_tables() -> None:
    """Show polars tables whole in this notebook (no "…" rows or columns): report tables are read, not skimmed."""
    pl.Config.set_tbl_rows(-1)
    pl.Config.set_tbl_cols(-1)
    pl.Config.set_tbl_width_chars(250)
    pl.Config.set_fmt_str_lengths(160)
    pl.Config.set_tbl_hide_dataframe_shape(True)
