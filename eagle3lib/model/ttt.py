"""Training-time test (TTT): K drafted tokens per position in one forward, aligned exactly with vLLM's inference.

Alignment (one sample x_0..x_{T-1}; a_t = the verifier's 3 feature states at position t, f_t its final hidden state,
P_t = softmax(lm_head(norm(f_t))) = the verifier's distribution of x_{t+1}):

    vLLM, drafting after position t (llm_base_proposer.propose): step 0 runs the drafter on (a_t, token x_{t+1}) at
    position t; step k >= 1 runs it on (g_{k-1}, its own token from step k-1) at position t+k, where g_{k-1} is the
    hidden state step k-1 fed back. Step k's query attends to the step-0 keys of positions 0..t (the drafter's KV cache
    of the context) and to the keys written by steps 1..k of this same round (positions t+1..t+k).

    Training, for every position t of a sample at once (teacher forcing: the drafted token is the ground truth):
        step k input:   hidden  h_k[t] = fc(a_t)                  (k = 0)
                                         g_{k-1}[t]               (k >= 1)
                        token   x_{t+1+k},   position t + k
        step k target:  P_{t+1+k}   (the verifier's distribution of x_{t+2+k}), restricted to the draft vocabulary
        step k counted: t + 2 + k <= T - 1 and loss_mask[t+2+k]  (x_{t+2+k} is an assistant token)
        attention:      query (t, k) sees keys (s, 0) for s <= t of the same sample, and (t, j) for 1 <= j <= k
    Since RoPE depends only on position differences, positions t+k reproduce vLLM's geometry exactly (checked in
    tests/test_train_model.py against incremental decoding with a KV cache).

Loss (forward KL to the verifier on the draft vocabulary V_d, p = softmax(P-logits restricted to V_d), q = drafter):
    L = sum_k decay^k * (1/n_k) * sum_{t counted at k} KL(p_t || q_t),      n_k = counted positions at step k
    counted over the whole global batch (all micro-batches, all processes), so the gradient does not depend on how the
    batch is split. Positions whose verifier argmax lies outside V_d ("out of vocab") can never be drafted: with
    out_of_vocab="mask" they add 0 to the sum (they stay in n_k), with "keep" they are trained on the renormalised rest.
Metrics: c_k[t] = (drafter argmax, mapped to a target id) == (verifier argmax at t+1+k) (False when out of vocab);
    full_acc_k = mean over counted t of prod_{j<=k} c_j[t];  cond_acc_k = sum prod_{j<=k} / sum prod_{j<k};
    tau_est = 1 + sum_k full_acc_k  (expected accepted tokens per verifier step of a chain drafter, bonus included).

Packing: rows of several samples; `doc` [B, S] numbers the samples of a row (-1 = padding); the step-0 mask is
block-diagonal causal (`block_causal_mask`), and steps >= 1 add one diagonal per previous step (`ttt_mask`). Steps >= 1
run only on the rows whose output is used (positions counted at this or a later step), since nothing else ever attends
to them. Four equivalent attention layouts (tests/test_train_model.py checks each against incremental decoding):
  "sdpa"      packed rows, one SDPA call with the boolean `ttt_mask` (keys [step 0 | step 1 | ..]): the plain form
  "dense"     packed rows, scores against the step-0 keys + the diagonals as vectors (no k x S^2 work)
  "doc"       each sample laid out on its own ([n_samples, longest sample]): attention costs sum of L^2 per sample
              instead of S^2 per row; projections and MLPs still run on the packed tokens (the default)
  "doc-sdpa"  the per-sample layout with one boolean-masked SDPA call per step
On GPU, the per-sample layout keeps every kernel's tile independent of the row length (no flex-attention templates,
whose shared-memory needs grow with the block sizes they pick).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle3lib.model.drafter import Eagle3Drafter

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


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x[:, i + n] at i (fill beyond the end)."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def step_token_ids(ids: torch.Tensor, doc: torch.Tensor, k: int) -> torch.Tensor:
    """Input token of TTT step k at each position: x_{t+1+k} of the same sample, 0 where there is none."""
    same = (shift_left(doc, 1 + k, -2) == doc) & (doc >= 0)
    return torch.where(same, shift_left(ids, 1 + k, 0), torch.zeros_like(ids))


def counted_positions(loss_mask: torch.Tensor, doc: torch.Tensor, k: int) -> torch.Tensor:
    """bool [B, S]: positions whose step-k prediction (token t+2+k of the same sample) is trained and measured."""
    same = (shift_left(doc, 2 + k, -2) == doc) & (doc >= 0)
    return same & shift_left(loss_mask, 2 + k, False)


def counted_per_step(loss_mask: torch.Tensor, doc: torch.Tensor, K: int) -> list[int]:
    return [int(counted_positions(loss_mask, doc, k).sum()) for k in range(K)]


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
        """[1, nkv, N, D] values of the selected rows -> dense [B, nkv, S, D] (zeros elsewhere), differentiably."""
        B, S = self.doc.shape
        out = x.new_zeros(B, S, x.shape[1], x.shape[3])
        out = out.index_put((self._b, self._i), x[0].transpose(0, 1))
        return out.transpose(1, 2)

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


def make_attention(doc: torch.Tensor, num_layers: int, mode: str):
    """The attention of one micro-batch. "doc" falls back to "dense" when the per-sample layout would cost more
    (n_samples x longest^2 > rows x row_length^2, e.g. one long sample packed with many short ones): both are exact."""
    if mode in ("doc", "doc-sdpa"):
        B, S = doc.shape
        sizes = torch.unique_consecutive((torch.arange(B, device=doc.device)[:, None] * (S + 1) + doc)[doc >= 0],
                                         return_counts=True)[1]
        if mode == "doc" and sizes.numel() and sizes.numel() * int(sizes.max()) ** 2 > B * S * S:
            return TTTAttention(doc, num_layers, "dense")
        return DocAttention(doc, num_layers, mode)
    return TTTAttention(doc, num_layers, mode)


# ------------------------------------------------------------------------------------------------- forward + loss


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


STAT_KEYS = ("n", "kl", "full", "prev", "oov")  # per-step sums: counted, KL, prod_{j<=k} c_j, prod_{j<k} c_j, out-of-vocab


def used_rows(counted: list[torch.Tensor]) -> list[torch.Tensor]:
    """U_k = rows counted at step k or later: the only rows whose step-k output is ever used."""
    used: list[torch.Tensor] = [counted[0]] * len(counted)
    acc = torch.zeros_like(counted[0])
    for k in reversed(range(len(counted))):
        acc = acc | counted[k]
        used[k] = acc.clone()
    return used


def run_ttt(d: Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor,
            used: list[torch.Tensor], mode: str = "doc"):
    """Yield (k, rows bool [B, S], normed drafter output [N_k, H] of those rows in row-major order) for each TTT step.

    `used[k]` must shrink with k (used[k] ⊆ used[k-1]); step 0 always runs on every position (its keys are the
    context of every later query) and returns the rows of used[0].
    """
    B, S = ids.shape
    H = d.config.hidden_size
    attn = make_attention(doc, d.config.num_layers, mode)
    hidden = d.combine(aux.reshape(B, S, -1))
    feed = None
    for k in range(len(used)):
        sel = used[k]
        ids_k = step_token_ids(ids, doc, k)
        if k == 0:
            attn.set_step(0, None)
            out, feed = d.decode(hidden, ids_k, pos, attn)
            flat = sel.reshape(-1)
            yield 0, sel, out.reshape(B * S, H)[flat]
            feed = feed.reshape(B * S, H)[flat]
        else:
            if not bool(sel.any()):
                return
            attn.set_step(k, sel)
            # the fed-back hidden states are laid out over the previous step's rows (a superset of these)
            idx = (torch.cumsum(used[k - 1].reshape(-1).long(), 0) - 1)[sel.reshape(-1)]
            out, feed = d.decode(feed[idx][None], ids_k[sel][None], (pos + k)[sel][None], attn)
            feed = feed[0]
            yield k, sel, out[0]


class TTTModel(nn.Module):
    """The training module: drafter + the verifier's frozen target head. forward(micro-batch) -> (loss, stats).

    Everything runs inside forward so DDP/FSDP hooks see every parameter use. `denominators` [K] are the counted
    positions of the whole global batch; `loss_scale` is the world size (DDP/FSDP average gradients over processes).
    """

    def __init__(self, drafter: Eagle3Drafter, target_norm: torch.Tensor, target_head_full: torch.Tensor,
                 rms_norm_eps: float, ttt_steps: int, decay: float, out_of_vocab: str = "mask",
                 attention: str = "doc", kernels_backend: str = "torch"):
        super().__init__()
        self.drafter = drafter
        self.register_buffer("target_norm", target_norm.detach().clone(), persistent=False)
        self.register_buffer("target_head_full", target_head_full.detach().clone(), persistent=False)
        self.eps = rms_norm_eps
        self.K = ttt_steps
        self.decay = decay
        self.out_of_vocab = out_of_vocab
        self.attention = attention
        self.kernels_backend = kernels_backend

    @torch.no_grad()
    def targets(self, final: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
        """(target logits on the draft vocab [N, Vd] fp32, verifier argmax over the full vocab [N]) of final [N, H]."""
        x = final.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.target_norm.float()
        W = self.target_head_full
        ids = self.drafter.draft_ids
        tl, am = [], []
        for s in range(0, x.shape[0], chunk):
            full = x[s : s + chunk].to(W.dtype) @ W.t()
            am.append(full.argmax(-1))
            tl.append(full[:, ids].float())
        return torch.cat(tl), torch.cat(am)

    def forward(self, mb: MicroBatch, denominators: torch.Tensor, loss_scale: float = 1.0):
        d = self.drafter
        K = self.K
        B, S = mb.ids.shape
        H = d.config.hidden_size
        dev = mb.ids.device
        counted = [counted_positions(mb.loss_mask, mb.doc, k) for k in range(K)]
        used = used_rows(counted)
        # the verifier's targets are needed only at positions t+1+k of used rows (prompt tokens mostly need none)
        need = torch.zeros(B, S, dtype=torch.bool, device=dev)
        for k in range(K):
            need[:, 1 + k :] |= used[k][:, : S - 1 - k]
        need_idx = need.reshape(-1).nonzero().squeeze(1)
        tgt_logits, tgt_argmax = self.targets(mb.final.reshape(B * S, H)[need_idx])
        in_vocab = d.t2d[tgt_argmax]  # verifier argmax inside the draft vocabulary
        row_of = torch.full((B * S,), -1, dtype=torch.long, device=dev)
        row_of[need_idx] = torch.arange(need_idx.numel(), device=dev)

        prod = torch.ones(B, S, dtype=torch.bool, device=dev)  # prod_{j<k} c_j
        stats = torch.zeros(len(STAT_KEYS), K, dtype=torch.float64, device=dev)
        loss = mb.final.new_zeros((), dtype=torch.float32)
        draft_ids = d.draft_ids
        for k, sel, out_rows in run_ttt(d, mb.aux, mb.ids, mb.pos, mb.doc, used, self.attention):
            # targets at position t+1+k of the selected rows
            b_idx, i_idx = sel.nonzero(as_tuple=True)
            r = row_of[b_idx * S + i_idx + 1 + k]
            tl, ta, iv = tgt_logits[r], tgt_argmax[r], in_vocab[r]
            cnt = counted[k][sel]
            w = cnt & iv if self.out_of_vocab == "mask" else cnt
            kl_sum, am = self._loss(out_rows, tl, w)
            correct = (draft_ids[am] == ta) & iv
            prod_sel = prod[sel]
            full = prod_sel & correct
            stats[0, k] = cnt.sum()
            stats[1, k] = kl_sum.detach().double()
            stats[2, k] = (full & cnt).sum()
            stats[3, k] = (prod_sel & cnt).sum()
            stats[4, k] = (cnt & ~iv).sum()
            new_prod = torch.zeros_like(prod)
            new_prod[sel] = full
            prod = new_prod
            loss = loss + (self.decay ** k) * kl_sum / denominators[k].clamp_min(1)
        return loss * loss_scale, stats

    def _loss(self, h: torch.Tensor, target: torch.Tensor, weight: torch.Tensor):
        """(sum over rows of weight * KL(softmax(target) || softmax(lm_head(h))), drafter argmax).

        "triton": the kernels package's fused kernel (no [N, V] logits kept for the backward). "torch": `DraftKL`
        below, the same definition as kernels' torch reference (tested equal) with a hand-written backward, ~1.5x
        faster on CPU than letting autograd differentiate the reference."""
        w = weight.to(torch.float32)
        if self.kernels_backend == "triton":
            from eagle3lib import kernels
            res = kernels.draft_kl_loss(h, self.drafter.lm_head.weight, target, w, kind="kl", reduction="sum",
                                        backend="triton")
            return res.loss.float(), res.argmax
        rows, argmax = DraftKL.apply(h, self.drafter.lm_head.weight, target, w)
        return rows.sum(), argmax


class DraftKL(torch.autograd.Function):
    """rows[n] = w[n] * KL(softmax(t_n) || softmax(h_n W^T)) and argmax_n of h_n W^T; gradient to h and W only.

    With z = h W^T (fp32), lse = logsumexp(z), p = softmax(t):  KL = sum_v p log p - sum_v p z + lse  (sum p = 1),
    and dKL/dz = softmax(z) - p, so the backward is two matmuls on w * (exp(z - lse) - p)."""

    @staticmethod
    def forward(ctx, h, W, t, w):
        z = (h @ W.t()).float()
        lse = torch.logsumexp(z, dim=-1)
        log_p = torch.log_softmax(t.float(), dim=-1)
        p = log_p.exp()
        plogp = torch.where(p > 0, p * log_p, torch.zeros_like(p)).sum(-1)
        rows = (plogp - (p * z).sum(-1) + lse) * w
        argmax = z.argmax(-1)
        ctx.save_for_backward(h, W, z, p, lse, w)
        ctx.mark_non_differentiable(argmax)
        return rows, argmax

    @staticmethod
    def backward(ctx, g_rows, _g_argmax):
        h, W, z, p, lse, w = ctx.saved_tensors
        dz = z.sub_(lse[:, None]).exp_().sub_(p).mul_((g_rows * w)[:, None])  # z is not needed after this
        dz = dz.to(h.dtype)
        dh = dz @ W.to(h.dtype) if ctx.needs_input_grad[0] else None
        dW = (dz.t() @ h).to(W.dtype) if ctx.needs_input_grad[1] else None
        return dh, dW, None, None


def summarize(stats: torch.Tensor, decay: float) -> dict[str, float]:
    """Per-step sums (from TTTModel.forward, summed over micro-batches and processes) -> the metrics record fields."""
    n, kl, full, prev, _oov = (stats[i] for i in range(len(STAT_KEYS)))
    K = stats.shape[1]
    out: dict[str, float] = {}
    total = 0.0
    tau = 1.0
    for k in range(K):
        nk = float(n[k])
        lk = float(kl[k]) / nk if nk else 0.0
        total += decay**k * lk
        out[f"loss_{k}"] = lk
        fa = float(full[k]) / nk if nk else 0.0
        out[f"full_acc_{k}"] = fa
        out[f"cond_acc_{k}"] = float(full[k]) / float(prev[k]) if float(prev[k]) else 0.0
        tau += fa
    out["loss"] = total
    out["tau_est"] = tau
    return out
