"""Validation at the end of every epoch: the held-out rows through the training-time test, stats reduced over ranks."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from eagle3lib.model.ttt import STAT_KEYS, summarize
from eagle3lib.training import distributed as dist


@torch.no_grad()
def validate(t) -> dict[str, Any]:
    cfg, K, device = t.cfg, t.K, t.device
    t.module.eval()
    stats = torch.zeros(len(STAT_KEYS), K, dtype=torch.float64, device=device)
    mine = t.vrows[t.rank :: t.world]
    # every process runs the same number of forwards (FSDP all-gathers are collective); extra ones count nothing
    n_mb = math.ceil(math.ceil(len(t.vrows) / t.world) / cfg.micro_batch_rows)
    tokens = samples = 0
    ones = torch.ones(K, device=device)
    for i in range(n_mb):
        rows = mine[i * cfg.micro_batch_rows : (i + 1) * cfg.micro_batch_rows]
        mb = t.collate_rows(rows or t.vrows[:1], t.plan.locate(t.progress.step - 1)[0], offer=False)
        with t.amp():
            _, st = t.module(mb.to(device), ones)
        if rows:
            stats += st
            tokens += mb.n_tokens
            samples += mb.n_samples
    dist.all_reduce_(stats)
    counts = dist.all_reduce_(torch.tensor([tokens, samples], dtype=torch.float64, device=device))
    step = t.progress.step
    rec = {"kind": "val", "step": step, "epoch": round(t.plan.epoch_float(step - 1), 4), "time": time.time(),
           "elapsed_s": t.elapsed(), "tokens": int(counts[0]), "samples": int(counts[1]),
           "positions": int(stats[0, 0]), **summarize(stats.cpu(), cfg.decay)}  # positions: counted at step 0
    t.module.train()
    return rec
