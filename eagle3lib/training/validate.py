"""Validation at the end of every epoch: the held-out rows through the training-time test, stats reduced over ranks.

Besides the summed record (metrics.jsonl), each sample's counts are kept in `val_samples.jsonl` (rank 0, one line
per validation: sample ids, counted positions and fully accepted ones per TTT step). The data-scaling stage uses them
to choose a checkpoint on some samples and score it on others, and to resample by sample (eagle3lib/analysis/scaling.py):
positions of one answer are correlated, so a per-position binomial error understates the spread.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from eagle3lib.data.val_counts import SAMPLES_FILE, write_sample_counts
from eagle3lib.model.ttt import STAT_KEYS, summarize
from eagle3lib.training import distributed as dist


@torch.no_grad()
def validate(t) -> dict[str, Any]:
    cfg, K, device = t.cfg, t.K, t.device
    t.module.eval()
    stats = torch.zeros(len(STAT_KEYS), K, dtype=torch.float64, device=device)
    where = {i: j for j, i in enumerate(i for row in t.vrows for i in row)}  # sample index -> its slot
    per_sample = torch.zeros(len(where), 2, K, dtype=torch.float64, device=device)
    mine = t.vrows[t.rank :: t.world]
    # every process runs the same number of forwards (FSDP all-gathers are collective); extra ones count nothing
    n_mb = math.ceil(math.ceil(len(t.vrows) / t.world) / cfg.micro_batch_rows)
    tokens = samples = 0
    ones = torch.ones(K, device=device)
    for i in range(n_mb):
        rows = mine[i * cfg.micro_batch_rows : (i + 1) * cfg.micro_batch_rows]
        mb = t.collate_rows(rows or t.vrows[:1], t.plan.locate(t.loop.progress.step - 1)[0], offer=False)
        with t.amp():
            _, st, per = t.module(mb.to(device), ones, sample_stats=True)
        if rows:
            stats += st
            tokens += mb.n_tokens
            samples += mb.n_samples
            for b, row in enumerate(rows):
                for d, idx in enumerate(row):
                    per_sample[where[idx]] += per[b, d]
    dist.all_reduce_(stats)
    dist.all_reduce_(per_sample)
    counts = dist.all_reduce_(torch.tensor([tokens, samples], dtype=torch.float64, device=device))
    step = t.loop.progress.step
    rec = {"kind": "val", "step": step, "epoch": round(t.plan.epoch_float(step - 1), 4), "time": time.time(),
           "elapsed_s": t.elapsed(), "tokens": int(counts[0]), "samples": int(counts[1]),
           "positions": int(stats[0, 0]), "positions_outside_draft_vocab": int(stats[4, 0]),  # counted at step 0
           **summarize(stats.cpu(), cfg.decay)}
    if t.rank == 0:
        ids = [t.reader.ids[i] for i in where]
        per_sample = per_sample.cpu().long()
        write_sample_counts(t.out_dir / SAMPLES_FILE, step, ids, per_sample[:, 0].tolist(), per_sample[:, 1].tolist())
    t.module.train()
    return rec
