"""Numbers as people read them in a report: the figures of a manifest as a two-column table."""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from pathlib import Path, PurePath
from typing import Any

import polars as pl
from pydantic import BaseModel


def fmt(value: Any, column: str = "") -> str:
    """Thousands separators for counts, 4 significant digits for measurements, plain text for the rest; by column
    name, hours to 0.1 and dollars whole. A missing value is a dash."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int | float) and math.isfinite(value):
        if "usd" in column:
            return "$0" if value == 0 else f"${value:,.0f}" if abs(value) >= 0.5 else "<$1"
        if column.endswith("hours") or "hours_" in column:
            return "0" if value == 0 else f"{value:,.1f}" if abs(value) >= 0.05 else "<0.1"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == int(value) and abs(value) < 1e15:
            return f"{int(value):,}"
        if abs(value) >= 1e4:
            return f"{value:,.0f}"
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
        cols = self.frame.columns
        body = "".join("<tr>" + "".join(f"<td>{html.escape(people_text(fmt(v, c)))}</td>" for v, c in zip(row, cols, strict=True))
                       + "</tr>" for row in self.frame.iter_rows())
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def __repr__(self) -> str:
        with pl.Config(tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=200):
            return repr(self.frame)


def figures_table(figures: dict[str, Any], skip: Iterable[str] = ()) -> Table:
    """figure | value, in the manifest's order, every row shown (the stage's manifest.json holds the raw numbers)."""
    skip = set(skip)
    rows = [(k, fmt(v)) for k, v in figures.items() if k not in skip and not isinstance(v, dict)]
    return Table(pl.DataFrame(rows, schema={"figure": pl.String, "value": pl.String}, orient="row"))


_RUN_DIR: list[Path] = []  # the run a notebook shows (set by for_people): paths are shown relative to it


def relative_text(text: str, *roots: str | Path) -> str:
    """Each root's absolute path in `text` made relative to it (inner roots first)."""
    for root in roots:
        text = text.replace(f"{root}/", "").replace(str(root), ".")
    return text


def people_text(text: str) -> str:
    """Paths inside the run shown relative to it, inside the repository relative to its root: a report never shows
    the absolute paths of the machine that ran it."""
    from eagle3lib.core.paths import REPO_ROOT

    return relative_text(text, *_RUN_DIR, REPO_ROOT)


def _config_html(cfg: BaseModel) -> str:
    rows = [(k, str(v) if isinstance(v, dict) else fmt(v)) for k, v in cfg.model_dump(mode="json").items()]
    body = "".join(f"<tr><td><code>{html.escape(k)}</code></td><td>{html.escape(people_text(v))}</td></tr>"
                   for k, v in rows)
    return f"<table><thead><tr><th>{type(cfg).__name__}</th><th>value</th></tr></thead><tbody>{body}</tbody></table>"


def for_people(run_dir: str | Path | None = None) -> None:
    """In this notebook: tables shown whole and formatted (no polars "…" rows, dtype rows or quoted strings), a
    profile section as a parameter table instead of its repr, paths relative to the run directory."""
    if run_dir is not None:
        _RUN_DIR[:] = [Path(run_dir)]
    full_tables()
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    fmts = shell.display_formatter.formatters
    fmts["text/html"].for_type(pl.DataFrame, lambda df: Table(df)._repr_html_())
    fmts["text/html"].for_type(BaseModel, _config_html)
    fmts["text/plain"].for_type(PurePath, lambda p, printer, cycle: printer.text(people_text(str(p))))


def full_tables() -> None:
    """Show polars tables whole in this notebook (no "…" rows or columns): report tables are read, not skimmed."""
    pl.Config.set_tbl_rows(-1)
    pl.Config.set_tbl_cols(-1)
    pl.Config.set_tbl_width_chars(250)
    pl.Config.set_fmt_str_lengths(160)
    pl.Config.set_tbl_hide_dataframe_shape(True)
