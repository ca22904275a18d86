"""The drafter's training losses besides the forward KL (`train.loss`), and the hidden-state term.

With p = softmax(verifier logits on the draft vocabulary) and q = softmax(drafter logits z = h W^T), per row n:

    kl          sum_v p (log p - log q)                 forward KL: covers the verifier's mass (the default; fused
                                                        kernel in kernels/draft_loss.py, not here)
    reverse_kl  sum_v q (log q - log p)                 mode-seeking: the drafter bets on the verifier's likeliest
                                                        tokens, which is what greedy acceptance rewards
    jsd         (KL(p || m) + KL(q || m)) / 2, m = (p + q) / 2     bounded (<= log 2), symmetric
    tv          sum_v |p - q| / 2                       total variation: 1 - TV is the probability a sampled draft is
                                                        accepted by speculative sampling (Leviathan et al.)
    ce_argmax   -log q(argmax p)                        hard labels: the verifier's greedy token only

Rows are processed in chunks under activation checkpointing, so the [rows, draft vocab] logits of one chunk, not of
the whole micro-batch, live at a time (the fused forward-KL kernel keeps none). Log-probabilities are computed in fp32.
Each returns (sum over rows of weight * loss, the drafter's argmax per row), the interface of
`kernels.draft_kl_loss(..., reduction="sum")`; the direct formulas in tests/test_draft_losses.py are the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eagle3lib.config.train import Loss

CHUNK_ROWS = 2048  # rows whose logits are held at once: 2,048 x 32,000 fp32 = 256 MiB at the kimi-k2.5 draft vocabulary


def _kl(log_p: torch.Tensor, log_q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def _reverse_kl(log_p: torch.Tensor, log_q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def _jsd(log_p: torch.Tensor, log_q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # log m = log((p + q) / 2) as a log-sum-exp: finite with finite gradients where p and q both underflow to 0
    # (log(p + q) there is -inf, and its gradient NaN)
    log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
    return 0.5 * ((log_p.exp() * (log_p - log_m)).sum(-1) + (log_q.exp() * (log_q - log_m)).sum(-1))


def _tv(log_p: torch.Tensor, log_q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def _ce_argmax(log_p: torch.Tensor, log_q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return -log_q.gather(-1, target.argmax(-1, keepdim=True)).squeeze(-1)


# train.loss: the one table of losses (config's `Loss` Literal names exactly these: tests/test_draft_losses.py)
LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl": _kl, "reverse_kl": _reverse_kl, "jsd": _jsd, "tv": _tv, "ce_argmax": _ce_argmax,
}


def row_losses(z: torch.Tensor, target: torch.Tensor, loss: Loss) -> torch.Tensor:
    """Per-row loss of drafter logits z [N, V] against verifier logits target [N, V] (both upcast to fp32)."""
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; losses: {', '.join(LOSSES)}")
    return LOSSES[loss](F.log_softmax(target.float(), dim=-1), F.log_softmax(z.float(), dim=-1), target)


def _chunk(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, w: torch.Tensor, loss: str) -> torch.Tensor:
    return (row_losses(h @ weight.t(), target, loss) * w).sum()  # type: ignore[arg-type]


def draft_loss(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, row_weight: torch.Tensor, loss: Loss,
               chunk_rows: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_n row_weight[n] * loss_n, argmax_n of h W^T). h [N, H] after the drafter's final norm, weight [V, H] its
    lm_head, target [N, V] the verifier's logits on the draft vocabulary (no gradient), row_weight [N]."""
    target = target.detach()
    w = row_weight.to(torch.float32)
    total = h.new_zeros((), dtype=torch.float32)
    argmax = []
    for s in range(0, h.shape[0], chunk_rows):
        hs, ts, ws = h[s : s + chunk_rows], target[s : s + chunk_rows], w[s : s + chunk_rows]
        if torch.is_grad_enabled() and (hs.requires_grad or weight.requires_grad):
            total = total + checkpoint(_chunk, hs, weight, ts, ws, loss, use_reentrant=False)
        else:
            total = total + _chunk(hs, weight, ts, ws, loss)
        with torch.no_grad():
            argmax.append((hs @ weight.t()).argmax(-1))
    return total, (torch.cat(argmax) if argmax else torch.zeros(0, dtype=torch.long, device=h.device))


def hidden_state_loss(h: torch.Tensor, target_hidden: torch.Tensor, row_weight: torch.Tensor) -> torch.Tensor:
    """sum_n row_weight[n] * mean_d (h - target)^2: the drafter's normed output state against the verifier's normed
    final state at the same position (hidden-state distillation; both feed an lm_head of the same shape)."""
    return (((h.float() - target_hidden.float()) ** 2).mean(-1) * row_weight.to(torch.float32)).sum()
