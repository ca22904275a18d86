"""The optimizer a training run steps: AdamW over every trained parameter (the EAGLE recipe), or Muon on the drafter's
hidden weight matrices with AdamW on the rest (`train.optimizer: muon`, speculators' choice).

Muon (torch.optim.Muon) replaces each matrix's momentum by the nearest semi-orthogonal matrix (five Newton-Schulz
iterations) before stepping, so all of the matrix's directions move at one rate instead of the few the gradient
favours. Moonshot's scaling (`adjust_lr_fn="match_rms_adamw"`: the update times 0.2 sqrt(max(rows, cols))) gives its
update AdamW's RMS, so `train.lr` carries over between the two ("Muon is Scalable for LLM Training", 2025). Muon is
defined for matrices only, and the lm_head stays on AdamW: its rows are tokens, like an embedding's, which the Muon
papers keep on AdamW. One object steps both, so the schedule, clipping and checkpoints see one optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class Optimizers:
    """Several torch optimizers stepped as one (the run's schedule sets every group's lr)."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.parts for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.parts:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts:
            opt.zero_grad(set_to_none=set_to_none)


def muon_split(named: Iterable[tuple[str, torch.nn.Parameter]]) -> tuple[list[str], list[str]]:
    """(names Muon steps, names AdamW steps) among the trained parameters: Muon takes the 2-D weights but the lm_head."""
    muon, adamw = [], []
    for name, p in named:
        if p.requires_grad:
            (muon if p.ndim == 2 and "lm_head" not in name else adamw).append(name)
    return muon, adamw


def make_optimizer(module: torch.nn.Module, name: str, lr: float, betas: tuple[float, float], weight_decay: float,
                   foreach: bool) -> Optimizers:
    named = dict(module.named_parameters())
    if name == "adamw":
        params = [p for p in named.values() if p.requires_grad]
        return Optimizers([torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, foreach=foreach)])
    muon, adamw = muon_split(named.items())
    parts: list[torch.optim.Optimizer] = [torch.optim.Muon([named[n] for n in muon], lr=lr, weight_decay=weight_decay,
                                                           adjust_lr_fn="match_rms_adamw")]
    if adamw:
        parts.append(torch.optim.AdamW([named[n] for n in adamw], lr=lr, betas=betas, weight_decay=weight_decay,
                                       foreach=foreach))
    return Optimizers(parts)
