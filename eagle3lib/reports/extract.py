"""What the extract stage's notebook shows: the disk a store needs, one stored sample's tokens and hidden-state norms."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
import torch

from eagle3lib.data.hidden_store import HiddenStateReader, bytes_per_token

GIB = 2**30


def sample_summary(out_dir: str | Path, index: int = 0, tokenizer: Any = None) -> dict[str, Any]:
    """One stored sample for a look: tokens with the loss mask, and per-layer hidden-state norms per token."""
    r = HiddenStateReader(out_dir)
    s = r[index]
    names = [f"aux_{k}" for k in r.meta["aux_layer_ids"]] + ["final"]
    norms = None if s.aux_hidden is None else torch.cat(  # None: a tokens-only store (states computed in training)
        [s.aux_hidden.float().norm(dim=-1), s.final_hidden.float().norm(dim=-1, keepdim=True)], dim=1).tolist()
    tokens = tokenizer.convert_ids_to_tokens(s.input_ids.tolist()) if tokenizer is not None else None
    return {"id": s.sample_id, "input_ids": s.input_ids.tolist(), "tokens": tokens, "loss_mask": s.loss_mask.tolist(),
            "layer_names": names, "norms": norms, "meta": r.meta, "store": repr(r)}


def disk_table(hidden_size: int, max_sample_tokens: int) -> pl.DataFrame:
    """Bytes per token and GiB at scale for both stored precisions: (3 aux + final) x hidden x bytes, plus id and mask
    (fp8 adds per-token scales). The stage re-checks with the exact token count before it writes."""
    rows = []
    for dtype in ("bfloat16", "float8_e4m3fn"):
        bpt = bytes_per_token(hidden_size, dtype)
        rows.append({"dtype": dtype, "bytes_per_token": bpt, "GiB_per_1M_tokens": round(bpt * 1e6 / GIB, 2),
                     "GiB_per_1k_samples_at_max_len": round(bpt * max_sample_tokens * 1e3 / GIB, 2)})
    return pl.DataFrame(rows)


def tokens_html(summary: dict[str, Any], tokenizer: Any, limit: int = 600) -> str:
    """The sample's first `limit` tokens, assistant (loss-masked) tokens highlighted, token boundaries marked."""
    spans = []
    for t, m in zip(summary["tokens"][:limit], summary["loss_mask"][:limit], strict=True):
        text = html.escape(tokenizer.convert_tokens_to_string([t])).replace("\n", "⏎<br>")
        style = "background:#cfe3ff;" if m else "color:#777;"
        spans.append(f'<span style="{style}border-right:1px solid #ddd">{text}</span>')
    return (f"<p><code>{html.escape(summary['id'])}</code>: {len(summary['tokens'])} tokens, "
            f"{sum(summary['loss_mask'])} in the loss mask (highlighted)</p>"
            f"<div style='font-family:monospace;font-size:12px;line-height:1.6'>{''.join(spans)}</div>")


def norms_plot(summary: dict[str, Any]):
    """L2 norm of each captured hidden state per token, the loss mask shaded (a note for a tokens-only store)."""
    fig, ax = plt.subplots(figsize=(9, 3))
    if summary["norms"] is None:
        ax.text(0.5, 0.5, f"{summary['store']}\nholds tokens only: train.hidden_states={summary['meta'].get('hidden_states')}"
                " computes the states during training", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    norms = np.array(summary["norms"])
    for j, name in enumerate(summary["layer_names"]):
        ax.plot(norms[:, j], label=name, lw=1)
    mask = np.array(summary["loss_mask"])
    ax.fill_between(range(len(mask)), 0, norms.max() * 1.05, where=mask, color="gray", alpha=0.15, step="mid",
                    label="loss mask")
    ax.set(xlabel="token position", ylabel="L2 norm", yscale="log",
           title=f"hidden-state norms per layer, sample {summary['id']}")
    ax.legend(fontsize=8, ncol=5)
    return fig


def ranks_table(figures: dict[str, Any]):
    """A row per extraction rank of a multi-process run (host, samples and tokens this run, tokens/s), or None for a
    single process. The manifest's totals sum these rows; the aggregate tokens/s divides by the slowest rank's time."""
    from eagle3lib.reports.tables import Table

    rows = figures.get("ranks")
    if not rows:
        return None
    keep = ["rank", "host", "samples_this_run", "tokens_this_run", "loop_s", "tokens_per_s", "device"]
    return Table(pl.DataFrame([{k: r.get(k) for k in keep if k in rows[0]} for r in rows]))


def records_table(figures: dict[str, Any]):
    """The generate records: kept by status (truncated = cut at generate.max_tokens, trained on as generated, no
    end-of-turn token) and dropped by reason; None for a store extracted from a dataset."""
    from eagle3lib.reports.tables import Table

    kept, dropped = figures.get("records_kept"), figures.get("records_dropped")
    if kept is None and dropped is None:
        return None
    rows = [{"records": "kept", "why": k, "count": n} for k, n in (kept or {}).items()]
    rows += [{"records": "dropped", "why": k, "count": n} for k, n in (dropped or {}).items()]
    return Table(pl.DataFrame(rows, schema={"records": pl.String, "why": pl.String, "count": pl.Int64}))
