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
    P-EAGLE (parallel_drafting): step k >= 1 reads the mask token and fc(mask_hidden) instead of x_{t+1+k} and
    g_{k-1}, as vLLM's proposer fills the slots after the first (llm_base_proposer: one forward per round); targets,
    positions and attention are the same, so the K outputs come from one forward at inference.
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

Packing: rows of several samples; `doc` [B, S] numbers the samples of a row (-1 = padding). Steps >= 1 run only on
the rows whose output is used (positions counted at this or a later step), since nothing else ever attends to them.
Attention over packed rows: eagle3lib/model/ttt_flash.py (memory linear in the sample length) and four equivalent
layouts in eagle3lib/model/ttt_attention.py; "auto" picks per micro-batch (make_attention).
"""

from __future__ import annotations

import torch
from torch import nn

from eagle3lib import kernels
from eagle3lib.data.packing import MicroBatch
from eagle3lib.model.draft_losses import draft_loss, hidden_state_loss
from eagle3lib.model.drafter import Eagle3Drafter
from eagle3lib.model.ttt_attention import make_attention

# ------------------------------------------------------------------------------------------------------ alignment


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


# ------------------------------------------------------------------------------------------------- forward + loss


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
            used: list[torch.Tensor], mode: str = "auto"):
    """Yield (k, rows bool [B, S], normed drafter output [N_k, H] of those rows in row-major order) for each TTT step.

    `used[k]` must shrink with k (used[k] ⊆ used[k-1]); step 0 always runs on every position (its keys are the
    context of every later query) and returns the rows of used[0].
    """
    B, S = ids.shape
    H = d.config.hidden_size
    attn = make_attention(doc, d.config.num_layers, mode, d.config.num_attention_heads)
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
            hid, tok = feed[idx], ids_k[sel]
            if d.config.parallel_drafting:  # P-EAGLE: slot k reads the mask, not step k-1's state and token
                hid, tok = d.mask_inputs(int(sel.sum()))
                hid = hid.to(feed.dtype)
            out, feed = d.decode(hid[None], tok[None], (pos + k)[sel][None], attn)
            feed = feed[0]
            yield k, sel, out[0]


class TTTModel(nn.Module):
    """The training module: drafter + the verifier's frozen target head. forward(micro-batch) -> (loss, stats).

    Everything runs inside forward so DDP/FSDP hooks see every parameter use. `denominators` [K] are the counted
    positions of the whole global batch; `loss_scale` is the world size (DDP/FSDP average gradients over processes).
    """

    def __init__(self, drafter: Eagle3Drafter, target_norm: torch.Tensor, target_head_full: torch.Tensor,
                 rms_norm_eps: float, ttt_steps: int, decay: float, out_of_vocab: str = "mask",
                 attention: str = "auto", kernels_backend: str = "torch", loss: str = "kl", hidden_weight: float = 0.0,
                 target_logits: str = "full"):
        super().__init__()
        self.drafter = drafter
        self.register_buffer("target_norm", target_norm.detach().clone(), persistent=False)
        self.register_buffer("target_head_full", target_head_full.detach().clone(), persistent=False)
        self.target_logits = target_logits  # train.target_logits: "draft" = training steps use the rows below only
        if target_logits == "draft":
            self.register_buffer("target_head_draft", target_head_full[drafter.draft_ids.cpu()].detach().clone(),
                                 persistent=False)
        self.eps = rms_norm_eps
        self.K = ttt_steps
        self.decay = decay
        self.out_of_vocab = out_of_vocab
        self.attention = attention
        self.kernels_backend = kernels_backend
        self.loss = loss  # train.loss (eagle3lib/model/draft_losses.py)
        self.hidden_weight = hidden_weight  # train.hidden_state_loss_weight

    def normed(self, final: torch.Tensor) -> torch.Tensor:
        """The verifier's final norm applied to its final hidden states (fp32)."""
        x = final.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.target_norm.float()

    @torch.no_grad()
    def targets(self, final: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
        """(target logits on the draft vocab [N, Vd] fp32, verifier argmax over the full vocab [N]) of final [N, H]."""
        x = self.normed(final)
        ids = self.drafter.draft_ids
        draft_only = self.training and self.target_logits == "draft"  # argmax within the draft vocab then
        W = self.target_head_draft if draft_only else self.target_head_full
        tl, am = [], []
        for s in range(0, max(1, x.shape[0]), chunk):  # once at least: a micro-batch may have no counted position
            z = x[s : s + chunk].to(W.dtype) @ W.t()
            am.append(ids[z.argmax(-1)] if draft_only else z.argmax(-1))
            tl.append((z if draft_only else z[:, ids]).float())
        return torch.cat(tl), torch.cat(am)

    def forward(self, mb: MicroBatch, denominators: torch.Tensor, loss_scale: float = 1.0, sample_stats: bool = False):
        """(loss, stats[STAT_KEYS, K]); with `sample_stats` also [B, samples per row, 2, K]: each sample's counted
        positions and fully accepted ones per step (validation keeps them, so scores can be resampled by sample)."""
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
        tgt_hidden = self.normed(mb.final.reshape(B * S, H)[need_idx]).detach() if self.hidden_weight else None
        in_vocab = d.t2d[tgt_argmax]  # verifier argmax inside the draft vocabulary
        row_of = torch.full((B * S,), -1, dtype=torch.long, device=dev)
        row_of[need_idx] = torch.arange(need_idx.numel(), device=dev)

        prod = torch.ones(B, S, dtype=torch.bool, device=dev)  # prod_{j<k} c_j
        stats = torch.zeros(len(STAT_KEYS), K, dtype=torch.float64, device=dev)
        loss = mb.final.new_zeros((), dtype=torch.float32)
        per = torch.zeros(B, int(mb.doc.max()) + 1, 2, K, dtype=torch.float64, device=dev) if sample_stats else None
        draft_ids = d.draft_ids
        for k, sel, out_rows in run_ttt(d, mb.aux, mb.ids, mb.pos, mb.doc, used, self.attention):
            # targets at position t+1+k of the selected rows
            b_idx, i_idx = sel.nonzero(as_tuple=True)
            r = row_of[b_idx * S + i_idx + 1 + k]
            tl, ta, iv = tgt_logits[r], tgt_argmax[r], in_vocab[r]
            cnt = counted[k][sel]
            w = cnt & iv if self.out_of_vocab == "mask" else cnt
            kl_sum, am = self._loss(out_rows, tl, w)  # train.loss, reported as loss_k
            step_loss = kl_sum
            if tgt_hidden is not None:  # hidden-state distillation, added to the optimised loss only
                step_loss = kl_sum + self.hidden_weight * hidden_state_loss(out_rows, tgt_hidden[r], w)
            correct = (draft_ids[am] == ta) & iv
            prod_sel = prod[sel]
            full = prod_sel & correct
            stats[0, k] = cnt.sum()
            stats[1, k] = kl_sum.detach().double()
            stats[2, k] = (full & cnt).sum()
            stats[3, k] = (prod_sel & cnt).sum()
            stats[4, k] = (cnt & ~iv).sum()
            if per is not None:
                at = (b_idx, mb.doc[b_idx, i_idx], torch.zeros_like(b_idx), torch.full_like(b_idx, k))
                per.index_put_(at, cnt.double(), accumulate=True)
                per.index_put_((*at[:2], torch.ones_like(b_idx), at[3]), (full & cnt).double(), accumulate=True)
            new_prod = torch.zeros_like(prod)
            new_prod[sel] = full
            prod = new_prod
            loss = loss + (self.decay ** k) * step_loss / denominators[k].clamp_min(1)
        return (loss * loss_scale, stats, per) if sample_stats else (loss * loss_scale, stats)

    def _loss(self, h: torch.Tensor, target: torch.Tensor, weight: torch.Tensor):
        """(sum over rows of weight * loss(softmax(target), softmax(lm_head(h))), drafter argmax).

        Forward KL (the default): "triton" the fused kernel (no [N, V] logits kept for the backward), "torch" the
        kernel's torch reference with its hand-written backward (eagle3lib/kernels/draft_loss.py). The other losses:
        eagle3lib/model/draft_losses.py (torch, chunked)."""
        if self.loss != "kl":
            return draft_loss(h, self.drafter.lm_head.weight, target, weight, self.loss)
        res = kernels.draft_kl_loss(h, self.drafter.lm_head.weight, target, weight.to(torch.float32), kind="kl",
                                    reduction="sum", backend=self.kernels_backend)
        return res.loss.float(), res.argmax


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
