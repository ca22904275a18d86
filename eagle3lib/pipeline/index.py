"""RUN_DIR/index.html: one page linking every stage's report, with its status, wall time and headline figures."""

from __future__ import annotations

import fnmatch
import html
from pathlib import Path

from eagle3lib.config.stages import STAGES
from eagle3lib.core.atomic import write_text_atomic
from eagle3lib.core.manifest import read_manifest
from eagle3lib.core.paths import REPO_ROOT
from eagle3lib.reports.tables import relative_text

STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:60em;color:#222}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;padding:.4em .6em;text-align:left;vertical-align:top}
.complete{color:#1a7f37}.failed{color:#c62828}.running{color:#b26a00}code{font-size:.9em}
"""


def _fmt(v, run_dir: Path) -> str:
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return html.escape(relative_text(str(v), run_dir, REPO_ROOT))  # no absolute paths of this machine on the page


def _headline(figures: dict, patterns: tuple[str, ...], run_dir: Path, limit: int = 8) -> str:
    """The stage's declared headline figures in their order (then, if none is there, its first figures)."""
    shown = {k: v for k, v in figures.items() if isinstance(v, int | float | str) and not isinstance(v, bool)}
    keys = list(dict.fromkeys(k for pat in patterns for k in shown if fnmatch.fnmatchcase(k, pat))) or list(shown)
    return "<br>".join(f"<code>{html.escape(k)}</code> {_fmt(shown[k], run_dir)}" for k in keys[:limit])


def write_index(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    rows = []
    for stage in STAGES:
        m = read_manifest(run_dir / stage.name)
        if m is None:
            continue
        status = m.get("status", "?")
        links = []
        if (run_dir / stage.name / "report.html").exists():
            links.append(f'<a href="{stage.name}/report.html">report</a>')
        links.append(f'<a href="{stage.name}/manifest.json">manifest</a>')
        if m.get("notebook") and (run_dir / stage.name / m["notebook"]).exists():
            links.append(f'<a href="{stage.name}/{m["notebook"]}">notebook</a>')
        err = f"<br><small>{html.escape(relative_text(str(m['error']), run_dir, REPO_ROOT))}</small>" if m.get("error") else ""
        wall = m.get("wall_s")
        rows.append(
            f"<tr><td><b>{stage.name}</b><br><small>{html.escape(stage.title)}</small></td>"
            f'<td class="{status}">{status}{err}</td><td>{"" if wall is None else f"{wall:,.0f} s"}</td>'
            f"<td>{_headline(m.get('figures') or {}, stage.headline, run_dir)}</td><td>{' · '.join(links)}</td></tr>"
        )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>eagle3lib run {html.escape(run_dir.name)}</title>"
        f"<style>{STYLE}</style></head><body><h1>eagle3lib run <code>{html.escape(run_dir.name)}</code></h1>"
        "<table><tr><th>stage</th><th>status</th><th>wall</th><th>figures</th><th>files</th></tr>"
        + "".join(rows)
        + "</table></body></html>\n"
    )
    out = run_dir / "index.html"
    write_text_atomic(out, page)
    return out
