"""Attention of the training-time test over packed rows: four equivalent layouts of the same masks, whose memory grows
with the square of the sample length; "flash" (eagle3lib/model/ttt_flash.py) grows linearly, and `make_attention`'s
"auto" (the default) takes it beyond short samples.

Step 0 attends block-diagonally causally (`block_causal_mask`: same sample, key <= query); step k >= 1 adds one
diagonal per previous step (`ttt_mask`: the query's own key written at each step 1..k). tests/test_train_model.py
checks each layout against incremental decoding:
  "sdpa"      packed rows, one SDPA call with the boolean `ttt_mask` (keys [step 0 | step 1 | ..]): the plain form
  "dense"     packed rows, scores against the step-0 keys + the diagonals as vectors (no k x S^2 work)
  "doc"       each sample laid out on its own ([n_samples, longest sample]): attention costs sum of L^2 per sample
              instead of S^2 per row; projections and MLPs still run on the packed tokens
  "doc-sdpa"  the per-sample layout with one boolean-masked SDPA call per step
On GPU, the per-sample layout keeps every kernel's tile independent of the row length (no flex-attention templates,
whose shared-memory needs grow with the block sizes they pick). Each object is the `attend(layer, q, k, v)` callback
the drafter's layers call (eagle3lib/model/drafter.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3lib.model.ttt_flash import FlashTTTAttention, scatter_rows

# ------------------------------------------------------------------------------------------------------------- masks


def block_causal_mask(doc: torch.Tensor) -> torch.Tensor:
    """bool [B, S, S]: query i sees key s iff s <= i in the same sample (padding sees only itself)."""
    S = doc.shape[-1]
    same = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)
    causal = torch.ones(S, S, dtype=torch.bool, device=doc.device).tril()
    eye = torch.eye(S, dtype=torch.bool, device=doc.device)
    return (same & causal) | eye


def ttt_mask(doc: torch.Tensor, step: int) -> torch.Tensor:
    """bool [B, S, (step+1) S]: keys laid out as [step-0 keys | step-1 keys | ... | step-`step` keys]."""
    B, S = doc.shape
    eye = torch.eye(S, dtype=torch.bool, device=doc.device).expand(B, S, S)
    return torch.cat([block_causal_mask(doc)] + [eye] * step, dim=-1)


# --------------------------------------------------------------------------------------------------------- attention


def _expand_kv(x: torch.Tensor, nh: int) -> torch.Tensor:
    """[B, nkv, S, D] -> [B, nh, S, D] (SDPA's fused CPU kernel is several times faster than enable_gqa's fallback)."""
    nkv = x.shape[1]
    if nkv == nh:
        return x
    B, _, S, D = x.shape
    return x[:, :, None].expand(B, nkv, nh // nkv, S, D).reshape(B, nh, S, D)


class TTTAttention:
    """The `attend` callback of one TTT forward over packed rows [B, S], with dense [S, S] masks.

    Keeps each layer's step-0 keys/values and the later steps' own keys. Step 0 runs on all B x S positions; step
    k >= 1 on the selected positions `rows` (flattened row-major, so each batch row's queries are contiguous) and
    stores its keys back into dense [B, nkv, S, D] tensors for later steps.
    mode "sdpa": one SDPA call per batch row over [step-0 keys | step-1.. keys] with the boolean `ttt_mask`
    ((k+1) x the key length); "dense": scores against the step-0 keys plus the k diagonal scores as vectors, one
    softmax (no k x S^2 work).
    """

    def __init__(self, doc: torch.Tensor, num_layers: int, mode: str = "dense"):
        if mode not in ("sdpa", "dense"):
            raise ValueError(f"attention mode {mode!r} (sdpa|dense|doc)")
        self.doc = doc
        self.mode = mode
        self.mask0 = block_causal_mask(doc)  # [B, S, S]
        self.k0: list[torch.Tensor | None] = [None] * num_layers
        self.v0: list[torch.Tensor | None] = [None] * num_layers
        self.kd: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]  # dense [B, nkv, S, D] per step >= 1
        self.vd: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.step = 0
        self.rows: torch.Tensor | None = None  # bool [B, S] for steps >= 1
        self._b = self._i = None
        self._segments: list[tuple[int, int, int]] = []

    def set_step(self, step: int, rows: torch.Tensor | None) -> None:
        self.step = step
        self.rows = rows
        if step > 0:
            b, i = rows.nonzero(as_tuple=True)
            self._b, self._i = b, i
            counts = rows.sum(1).tolist()
            self._segments, start = [], 0
            for bb, n in enumerate(counts):
                if n:
                    self._segments.append((bb, start, start + n))
                start += n

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_rows(x, self._b, self._i, self.doc.shape)

    def __call__(self, idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        nh = q.shape[1]
        if self.step == 0:
            self.k0[idx], self.v0[idx] = k, v
            return F.scaled_dot_product_attention(q, _expand_kv(k, nh), _expand_kv(v, nh), attn_mask=self.mask0[:, None])
        self.kd[idx].append(self._dense(k))
        self.vd[idx].append(self._dense(v))
        outs = []
        for b, s, e in self._segments:
            qi = q[:, :, s:e]  # [1, nh, n, D]
            pos = self._i[s:e]
            m0 = self.mask0[b, pos]  # [n, S]
            k0, v0 = _expand_kv(self.k0[idx][b : b + 1], nh), _expand_kv(self.v0[idx][b : b + 1], nh)
            kds = [_expand_kv(kd[b : b + 1, :, pos], nh) for kd in self.kd[idx]]  # each [1, nh, n, D]
            vds = [_expand_kv(vd[b : b + 1, :, pos], nh) for vd in self.vd[idx]]
            if self.mode == "sdpa":
                # keys of this row: [step-0 keys (S) | step j keys at the n selected positions (n each)]
                n = e - s
                eye = torch.eye(n, dtype=torch.bool, device=q.device)
                mask = torch.cat([m0] + [eye] * len(kds), dim=-1)
                outs.append(F.scaled_dot_product_attention(qi, torch.cat([k0, *kds], dim=2), torch.cat([v0, *vds], dim=2),
                                                           attn_mask=mask[None, None]))
            else:
                outs.append(_attend_with_diagonals(qi, k0, v0, kds, vds, m0[None, None]))
        return torch.cat(outs, dim=2)


def _attend_with_diagonals(q, k0, v0, kds, vds, mask0):
    """softmax over [q.k0 (masked) | q.kd_1 .. q.kd_k] (the diagonal keys as vectors) -> weighted values.
    q [.., n, D]; k0/v0 [.., L, D]; kds/vds lists of [.., n, D]; mask0 broadcastable to [.., n, L]."""
    scale = q.shape[-1] ** -0.5
    s0 = torch.matmul(q, k0.transpose(-1, -2)) * scale
    s0 = s0.masked_fill(~mask0, float("-inf"))
    sd = torch.stack([(q * kj).sum(-1) for kj in kds], dim=-1) * scale  # [.., n, k]
    p = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(q.dtype)
    L = s0.shape[-1]
    return torch.matmul(p[..., :L], v0) + (p[..., L:, None] * torch.stack(vds, dim=-2)).sum(-2)


class DocAttention:
    """The `attend` callback of one TTT forward in a per-sample ("varlen") layout: each sample of the packed rows
    becomes one row of an [n_docs, L] batch (L = the longest sample), so attention costs n_docs x L^2 instead of
    B x S^2 and its masks are plain causal (+ the TTT diagonals). Projections and MLPs still run on the packed tokens.

    Step 0: SDPA(is_causal) per sample. Step k >= 1: the selected queries are scattered into the sample layout and
    attend to the step-0 keys (causal) and their own keys of steps 1..k (diagonals), via `_attend_with_diagonals`
    ("doc") or one SDPA with the boolean mask [causal | eye | .. | eye] ("doc-sdpa").
    """

    def __init__(self, doc: torch.Tensor, num_layers: int, mode: str = "doc"):
        B, S = doc.shape
        dev = doc.device
        flat_doc = doc.reshape(-1)
        real = flat_doc >= 0
        # sample id over the flattened rows: (row, doc) pairs in row-major order
        key = torch.arange(B, device=dev).repeat_interleave(S) * (S + 1) + flat_doc
        starts = torch.ones(B * S, dtype=torch.bool, device=dev)
        starts[1:] = key[1:] != key[:-1]
        sample = torch.cumsum(starts.long(), 0) - 1  # consecutive tokens of one (row, doc) share an id
        real_ids = sample[real]
        uniq, inv = torch.unique(real_ids, return_inverse=True)
        n_docs = int(uniq.numel())
        first = torch.full((n_docs,), B * S, dtype=torch.long, device=dev)
        flat_idx = torch.arange(B * S, device=dev)[real]
        first = first.scatter_reduce(0, inv, flat_idx, reduce="amin")
        local = flat_idx - first[inv]
        self.L = int(local.max()) + 1 if n_docs else 1
        self.n_docs = n_docs
        self.mode = mode
        # token -> slot in the [n_docs * L] layout; padding tokens -> an extra zero slot
        self.slot = torch.full((B * S,), n_docs * self.L, dtype=torch.long, device=dev)
        self.slot[flat_idx] = inv * self.L + local
        self.causal = torch.ones(self.L, self.L, dtype=torch.bool, device=dev).tril()
        self.k0: list[torch.Tensor | None] = [None] * num_layers
        self.v0: list[torch.Tensor | None] = [None] * num_layers
        self.kd: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.vd: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.step = 0
        self.sel_slot: torch.Tensor | None = None

    def set_step(self, step: int, rows: torch.Tensor | None) -> None:
        self.step = step
        if step > 0:
            self.sel_slot = self.slot[rows.reshape(-1)]

    def _to_docs(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """[1 or B, h, N, D] tokens at `slots` -> [n_docs, h, L, D] (zeros in empty slots)."""
        h, D = x.shape[1], x.shape[3]
        flat = x.transpose(1, 2).reshape(-1, h, D)
        out = x.new_zeros(self.n_docs * self.L + 1, h, D).index_put((slots,), flat)
        return out[:-1].view(self.n_docs, self.L, h, D).transpose(1, 2)

    def _from_docs(self, y: torch.Tensor, slots: torch.Tensor, B: int) -> torch.Tensor:
        """[n_docs, h, L, D] -> the tokens at `slots`, as [B, h, N/B, D]."""
        h, D = y.shape[1], y.shape[3]
        flat = torch.cat([y.transpose(1, 2).reshape(-1, h, D), y.new_zeros(1, h, D)])
        return flat[slots].view(B, -1, h, D).transpose(1, 2)

    def __call__(self, idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        nh = q.shape[1]
        B = q.shape[0]
        if self.step == 0:
            kd, vd = self._to_docs(k, self.slot), self._to_docs(v, self.slot)
            self.k0[idx], self.v0[idx] = kd, vd
            o = F.scaled_dot_product_attention(self._to_docs(q, self.slot), _expand_kv(kd, nh), _expand_kv(vd, nh),
                                               is_causal=True)
            return self._from_docs(o, self.slot, B)
        slots = self.sel_slot
        self.kd[idx].append(self._to_docs(k, slots))
        self.vd[idx].append(self._to_docs(v, slots))
        qd = self._to_docs(q, slots)
        k0, v0 = _expand_kv(self.k0[idx], nh), _expand_kv(self.v0[idx], nh)
        kds = [_expand_kv(x, nh) for x in self.kd[idx]]
        vds = [_expand_kv(x, nh) for x in self.vd[idx]]
        if self.mode == "doc-sdpa":
            eye = torch.eye(self.L, dtype=torch.bool, device=q.device)
            mask = torch.cat([self.causal] + [eye] * len(kds), dim=-1)
            o = F.scaled_dot_product_attention(qd, torch.cat([k0, *kds], dim=2), torch.cat([v0, *vds], dim=2),
                                               attn_mask=mask)
        else:
            o = _attend_with_diagonals(qd, k0, v0, kds, vds, self.causal)
        return self._from_docs(o, slots, 1)


AUTO_DOC_MAX = 4096  # "auto" lays rows out per sample ("doc") while heads x longest sample stays under this: its
# [heads, L, L] scores then cost a bounded number of bytes per token (linear in the row), and on short samples its
# one batched layout is as fast as flash's windows or faster (tiny drafter, 1,024 tokens of ~100-token samples: doc
# 6,600 vs flash 5,700 tok/s); beyond it flash is as fast or faster and its memory stays linear in the sample length
# (benchmarks/long_context.py prints which layout auto picks and its speed against the fastest)


def sample_sizes(doc: torch.Tensor) -> torch.Tensor:
    """Tokens of each sample of the packed rows [B, S] (padding not counted)."""
    B, S = doc.shape
    return torch.unique_consecutive((torch.arange(B, device=doc.device)[:, None] * (S + 1) + doc)[doc >= 0],
                                    return_counts=True)[1]


def make_attention(doc: torch.Tensor, num_layers: int, mode: str, heads: int = 1):
    """The attention of one micro-batch. "flash" keeps memory linear in the sample length
    (eagle3lib/model/ttt_flash.py); the layouts here are its references and what it was measured against; "auto" is
    "doc" for short samples (`AUTO_DOC_MAX`), else "flash". "doc" falls back to "dense" when the per-sample layout
    would cost more (n_samples x longest^2 > rows x row_length^2, e.g. one long sample packed with many short ones):
    both are exact."""
    sizes = sample_sizes(doc)
    longest = int(sizes.max()) if sizes.numel() else 0
    if mode == "auto":
        mode = "doc" if heads * longest <= AUTO_DOC_MAX else "flash"
    if mode in ("doc", "doc-sdpa"):
        B, S = doc.shape
        if mode == "doc" and sizes.numel() * longest**2 > B * S * S:
            return TTTAttention(doc, num_layers, "dense")
        return DocAttention(doc, num_layers, mode)
    if mode == "flash":
        return FlashTTTAttention(doc, num_layers)
    return TTTAttention(doc, num_layers, mode)
