"""Offline vs online vs hybrid hidden states (train.hidden_states), side by side on every hardware row.

The model, on top of eagle3lib/analysis/cost.py's measured throughputs (every input on the page):
- verifier compute per epoch V = extracted tokens / the extract stage's throughput on the row (a prefill of every token).
- offline: V once, then every epoch reads the store; disk = tokens x bytes/token for the length of the run.
- online:  V every epoch, nothing stored (the staging folder is bounded and small).
- hybrid:  V in the first epoch; later epochs recompute the share that did not fit the cache (cache_budget_gb); disk =
           min(cache, the offline store).
- hours = verifier hours + the drafter's training hours (the same in every mode); online computes on the trainer's
  GPUs (in process) or on a server's, so its verifier hours are GPU hours either way, added, not overlapped: an upper
  bound on wall-clock time when a server runs beside the trainer.
- $ = hours x the row's $/hour + disk TB x storage_usd_per_tb_month x storage_months.
- crossover: storing beats recomputing once epochs > 1 + storage $ / (V x $/hour), the epoch count where online's extra
  verifier passes cost what offline's disk does. On owned hardware ($/hour 0 in the table) compute is free and
  online always wins on money; the disk (can the machine hold it at all) decides.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import polars as pl

from eagle3lib.analysis.cost import CostProjection, stage_hours

MODES = ("offline", "online", "hybrid")
TB = 1e12


def hidden_modes(cp: CostProjection, cache_budget_gb: float, usd_per_tb_month: float, months: float,
                 samples: list[int] | None = None) -> pl.DataFrame:
    """A row per (samples, hardware, mode): disk TB, verifier hours per epoch, total hours and $, and the crossover
    epochs; `samples` = hero-run sizes (default: the profile's)."""
    if "extract" not in cp.measured or "train" not in cp.measured:
        raise ValueError("the offline/online/hybrid comparison needs the extract and train throughputs "
                         "(cost_projection.stages must include extract and train)")
    recs: list[dict[str, Any]] = []
    for n in samples or [cp.spec.samples]:
        spec = replace(cp.spec, samples=n)
        tokens = spec.tokens("extract")
        store_bytes = spec.disk_bytes("extract", cp.measured["extract"])
        cached = min(1.0, cache_budget_gb * 1e9 / store_bytes) if store_bytes else 1.0
        for row in cp.rows:
            verifier_h = stage_hours(tokens, cp.rate(row, "extract"))  # one pass of the verifier over the data
            train_h = stage_hours(spec.tokens("train"), cp.rate(row, "train"))
            passes = {"offline": 1.0, "online": spec.epochs,
                      "hybrid": 1.0 + max(0.0, spec.epochs - 1) * (1 - cached)}
            disk = {"offline": store_bytes, "online": 0.0, "hybrid": min(store_bytes, cache_budget_gb * 1e9)}
            storage_usd = store_bytes / TB * usd_per_tb_month * months
            compute_usd_per_pass = verifier_h * row.usd_per_hour
            crossover = 1 + storage_usd / compute_usd_per_pass if compute_usd_per_pass > 0 else None
            for mode in MODES:
                hours = verifier_h * passes[mode] + train_h
                usd = hours * row.usd_per_hour + disk[mode] / TB * usd_per_tb_month * months
                recs.append({"samples": n, "hardware": row.name, "owned": row.owned, "mode": mode,
                             "disk_tb": disk[mode] / TB, "verifier_hours_per_epoch": verifier_h,
                             "verifier_passes": passes[mode], "train_hours": train_h, "hours": hours, "usd": usd,
                             "crossover_epochs": crossover})
    return pl.DataFrame(recs, infer_schema_length=None)


def cheapest(frame: pl.DataFrame) -> pl.DataFrame:
    """Per (samples, hardware): the mode with the lowest $ (ties: the fewest hours)."""
    return (frame.sort(["samples", "hardware", "usd", "hours"])
            .group_by(["samples", "hardware"], maintain_order=True).first()
            .select("samples", "hardware", "mode", "usd", "hours", "disk_tb"))
