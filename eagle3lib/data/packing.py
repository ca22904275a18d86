"""The data plan: which samples go into which row, step, process and micro-batch, deterministically from the seed.

- Split: a seeded `val_fraction` of the samples (at most `val_max_samples`, at least 1 when there are >= 20) is held out;
  `train_fraction` < 1 then trains on a nested seeded subset of the rest (the same held-out split for every fraction).
- Rows: with packing, each epoch's seeded permutation is cut into windows of 512 samples, and each window is packed
  first-fit-decreasing into rows of at most `packed_row_tokens` tokens (a sample longer than that is truncated); the
  rows are then shuffled. Without packing, a row is one sample.
- Steps: `batch_rows` rows per optimizer step (the global batch; a partial last step is dropped). The rows of a step are
  dealt to the processes longest-first, each to the least-loaded process (by tokens), then cut into micro-batches of
  `micro_batch_rows` similar-length rows. The same global batch therefore gives the same rows to any process count.
- Resume: the plan is a pure function of (lengths, config, epoch), so a resumed run skips to its step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eagle3lib.config.train import TrainConfig


@dataclass
class MicroBatch:
    """One micro-batch of packed rows on one device. Shapes [B, S] unless noted."""

    aux: torch.Tensor  # [B, S, 3, H] verifier features
    final: torch.Tensor  # [B, S, H] verifier final hidden state (pre-norm)
    ids: torch.Tensor  # token ids
    loss_mask: torch.Tensor  # bool, True on assistant tokens
    pos: torch.Tensor  # position inside its sample
    doc: torch.Tensor  # sample number inside the row, -1 on padding
    n_tokens: int  # real (non-padding) tokens
    n_samples: int

    def to(self, device) -> MicroBatch:
        return MicroBatch(*(getattr(self, f).to(device, non_blocking=True) for f in ("aux", "final", "ids", "loss_mask",
                                                                                      "pos", "doc")),
                          self.n_tokens, self.n_samples)


WINDOW = 512  # samples per first-fit-decreasing window: packing efficiency ~99% while keeping the order random


@dataclass
class Split:
    train: list[int]
    val: list[int]


def validation_count(n: int, val_fraction: float, val_max: int) -> int:
    """How many of n samples the validation split takes (at least one of 20 or more when val_fraction > 0)."""
    n_val = min(int(round(n * val_fraction)), val_max)
    return max(n_val, 1) if val_fraction > 0 and n >= 20 else n_val


def split_samples(n: int, val_fraction: float, val_max: int, seed: int, ids: list[str] | None = None) -> Split:
    """Seeded train/validation split of store indices 0..n-1. With the samples' ids, both the split and the order the
    epochs shuffle from follow the ids, not the store's order: a store written in a different order (a generate run
    that was interrupted and resumed finishes its prompts in another order) gives the same split and the same steps."""
    canonical = sorted(range(n), key=ids.__getitem__) if ids is not None else list(range(n))
    g = torch.Generator().manual_seed(seed)
    perm = [canonical[j] for j in torch.randperm(n, generator=g).tolist()]
    n_val = validation_count(n, val_fraction, val_max)
    rank = {i: r for r, i in enumerate(canonical)}
    return Split(sorted(perm[n_val:], key=rank.__getitem__), sorted(perm[:n_val], key=rank.__getitem__))


def nested_subset(indices: list[int], fraction: float, seed: int, ids: list[str] | None = None) -> list[int]:
    """The first `fraction` of `indices` in a seeded order that follows the samples' ids: a smaller fraction is always
    a subset of a larger one (data-scaling points differ only in how much data they saw), whatever the store's order."""
    if fraction >= 1:
        return list(indices)
    canonical = sorted(indices, key=ids.__getitem__) if ids is not None else sorted(indices)
    g = torch.Generator().manual_seed(seed + 1_000_003)  # not the split's stream: the subset is not the split's order
    order = [canonical[j] for j in torch.randperm(len(canonical), generator=g).tolist()]
    keep = set(order[: max(1, math.ceil(len(order) * fraction))])
    return [i for i in indices if i in keep]


def pack_rows(indices: list[int], lengths: list[int], packed_row_tokens: int, packing: bool,
              generator: torch.Generator | None = None) -> list[list[int]]:
    """Rows of sample indices; `indices` are taken in the given order (shuffle before)."""
    if not packing:
        return [[i] for i in indices]
    rows: list[list[int]] = []
    for w in range(0, len(indices), WINDOW):
        window = sorted(indices[w : w + WINDOW], key=lambda i: -min(lengths[i], packed_row_tokens))
        bins: list[list[int]] = []
        room: list[int] = []
        for i in window:
            n = min(lengths[i], packed_row_tokens)
            for b, r in enumerate(room):
                if n <= r:
                    bins[b].append(i)
                    room[b] -= n
                    break
            else:
                bins.append([i])
                room.append(packed_row_tokens - n)
        rows.extend(bins)
    if generator is not None:
        order = torch.randperm(len(rows), generator=generator).tolist()
        rows = [rows[j] for j in order]
    return rows


def row_tokens(row: list[int], lengths: list[int], packed_row_tokens: int) -> int:
    return sum(min(lengths[i], packed_row_tokens) for i in row)


def epoch_rows(train: list[int], lengths: list[int], packed_row_tokens: int, packing: bool, seed: int,
               epoch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = [train[j] for j in torch.randperm(len(train), generator=g).tolist()]
    return pack_rows(perm, lengths, packed_row_tokens, packing, g)


def deal(rows: list[list[int]], lengths: list[int], packed_row_tokens: int, world: int,
         micro_batch_rows: int) -> list[list[list[list[int]]]]:
    """One step's rows -> per process, a list of micro-batches (each a list of rows). Longest-first to the least loaded
    process that still has room, so every process gets len(rows)/world rows and about the same tokens."""
    per = len(rows) // world
    order = sorted(range(len(rows)), key=lambda r: (-row_tokens(rows[r], lengths, packed_row_tokens), r))
    load = [0] * world
    got: list[list[list[int]]] = [[] for _ in range(world)]
    for r in order:
        p = min((p for p in range(world) if len(got[p]) < per), key=lambda p: (load[p], p))
        got[p].append(rows[r])
        load[p] += row_tokens(rows[r], lengths, packed_row_tokens)
    # got[p] is already longest-first: consecutive rows have similar lengths, so micro-batches pad little
    return [[got[p][m : m + micro_batch_rows] for m in range(0, per, micro_batch_rows)] for p in range(world)]


@dataclass
class Plan:
    """Steps of every epoch: steps[e][s] = the rows of global step s of epoch e."""

    steps: list[list[list[list[int]]]]
    epochs: float
    total_steps: int
    epoch_steps: list[int]  # full length of each epoch (a max_steps cap may cut the last one short)

    def locate(self, step: int) -> tuple[int, int]:
        """Global step number -> (epoch, step inside the epoch)."""
        for e, st in enumerate(self.steps):
            if step < len(st):
                return e, step
            step -= len(st)
        raise IndexError("step beyond the plan")

    def epoch_float(self, step: int) -> float:
        """Epochs completed after global step `step` (0-based) finishes."""
        e, s = self.locate(step)
        return e + (s + 1) / self.epoch_steps[e]


def make_plan(train: list[int], lengths: list[int], cfg: TrainConfig, max_steps: int | None = None) -> Plan:
    import math

    n_full = math.ceil(cfg.epochs)
    steps = []
    lengths_full: list[int] = []
    total = 0
    for e in range(n_full):
        rows = epoch_rows(train, lengths, cfg.packed_row_tokens, cfg.packing, cfg.seed, e)
        n = len(rows) // cfg.batch_rows
        if e == n_full - 1 and cfg.epochs < n_full:
            n = max(1, int(round(n * (cfg.epochs - e))))
        st = [rows[i * cfg.batch_rows : (i + 1) * cfg.batch_rows] for i in range(n)]
        full_n = len(rows) // cfg.batch_rows
        if max_steps is not None and total + len(st) > max_steps:
            st = st[: max_steps - total]
        if st:
            steps.append(st)
            lengths_full.append(max(full_n, 1))
        total += len(st)
        if max_steps is not None and total >= max_steps:
            break
    return Plan(steps, cfg.epochs, total, lengths_full)


def val_rows(val: list[int], lengths: list[int], packed_row_tokens: int, packing: bool) -> list[list[int]]:
    return pack_rows(list(val), lengths, packed_row_tokens, packing)


# ------------------------------------------------------------------------------------------------------ collation


def collate(reader, rows: list[list[int]], packed_row_tokens: int, samples: dict | None = None) -> MicroBatch:
    """Read the samples of `rows` (or take them from `samples`: states computed online) and lay them out as [B, S]
    (S = the longest row), padding with doc = -1."""
    samples = samples if samples is not None else {i: reader[i] for row in rows for i in row}
    B = len(rows)
    S = max(row_tokens(r, reader.lengths, packed_row_tokens) for r in rows)
    first = next(iter(samples.values()))
    n_aux, H = first.aux_hidden.shape[1], first.aux_hidden.shape[2]
    aux = torch.zeros(B, S, n_aux, H, dtype=first.aux_hidden.dtype)
    final = torch.zeros(B, S, H, dtype=first.final_hidden.dtype)
    ids = torch.zeros(B, S, dtype=torch.long)
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    pos = torch.zeros(B, S, dtype=torch.long)
    doc = torch.full((B, S), -1, dtype=torch.long)
    n_tokens = 0
    for b, row in enumerate(rows):
        off = 0
        for d, i in enumerate(row):
            s = samples[i]
            n = min(len(s), packed_row_tokens)
            aux[b, off : off + n] = s.aux_hidden[:n]
            final[b, off : off + n] = s.final_hidden[:n]
            ids[b, off : off + n] = s.input_ids[:n]
            loss_mask[b, off : off + n] = s.loss_mask[:n]
            pos[b, off : off + n] = torch.arange(n)
            doc[b, off : off + n] = d
            off += n
        n_tokens += off
    return MicroBatch(aux, final, ids, loss_mask, pos, doc, n_tokens, sum(len(r) for r in rows))
