"""Training a DFlash drafter (eagle3lib/model/dflash.py) on an extract store: one process, the store's own split.

Each step takes `samples_per_step` training sequences, draws up to `anchors` block starts in each (positions whose
first draft is an answer token), and scores every slot of every block against the verifier's distribution in one
forward per sequence. Validation: on the held-out sequences, every answer position is a block start and the estimate
is greedy acceptance, tau_est = 1 + sum_j P(slots 1..j all equal the verifier's argmax), vLLM's accounting.

Resumable: every `save_every` steps (and at the end) the drafter and the step go to OUT/last/ (safetensors + JSON); a
rerun loads them and continues at that step (the optimizer's moments start again: a short warm-up, not a replay).
OUT/manifest.json holds the figures; OUT/final/ the checkpoint vLLM serves (`method: dflash`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3lib.data.hidden_store import HiddenStateReader
from eagle3lib.data.packing import split_samples
from eagle3lib.model.dflash import (
    DFlashDrafter,
    config_from_verifier,
    dflash_loss,
    load_dflash,
    pick_anchors,
    save_dflash,
)
from eagle3lib.model.draft_losses import Loss
from eagle3lib.model.verifier import load_verifier_head


@dataclass
class DFlashTrainConfig:
    block: int = 3  # K: drafts per round, the num_speculative_tokens it will be served with
    num_layers: int = 1  # drafter layers (the tiny verifier has 4; one layer already reads the whole context)
    steps: int = 400  # optimizer steps
    lr: float = 3e-3  # AdamW peak; cosine to 10% after `warmup_steps` (a fresh small model, like the EAGLE recipe)
    warmup_steps: int = 20  # linear warm-up: the first steps see random attention
    samples_per_step: int = 4  # sequences per step
    anchors: int = 32  # block starts per sequence per step: more blocks per forward is more signal per context pass
    loss: Loss = "kl"  # the same choices as train.loss (eagle3lib/model/draft_losses.py)
    val_fraction: float = 0.05  # held out, as the train stage splits (same seeded split by sample id)
    val_max_samples: int = 64  # caps validation time
    seed: int = 0  # anchors, order and split
    save_every: int = 100  # steps between resumable saves in OUT/last/


def _targets(head, sample) -> torch.Tensor:
    return head.target_logits(sample.final_hidden)


@torch.no_grad()
def validate(model: DFlashDrafter, head, reader: HiddenStateReader, idx: list[int]) -> dict[str, Any]:
    """Greedy acceptance of the held-out sequences with a block at every answer position."""
    K, runs, n = model.config.block, torch.zeros(model.config.block), 0
    for i in idx:
        s = reader[i]
        T = len(s)
        anchors = torch.nonzero(s.loss_mask[2:]).flatten() + 1
        anchors = anchors[anchors + K < T]  # whole blocks only: a cut block would count as rejected
        if not anchors.numel():
            continue
        draft = model.logits(model.blocks(s.aux_hidden.float(), s.input_ids[anchors], anchors)[:, 1:]).argmax(-1)
        pos = anchors[:, None] + torch.arange(1, K + 1)
        target = _targets(head, s)[pos - 1].argmax(-1)
        runs += (draft == target).int().cumprod(1).float().sum(0)  # slot j counts when 1..j all matched
        n += anchors.numel()
    rates = (runs / max(n, 1)).tolist()
    return {"val_blocks": n, "val_accept_rate_pos": [round(r, 4) for r in rates], "val_tau_est": 1 + sum(rates)}


def train_dflash(store: Path, verifier: str, out: Path, cfg: DFlashTrainConfig, progress: bool = True) -> dict:
    reader = HiddenStateReader(store)
    head = load_verifier_head(verifier)
    vc = getattr(head.config, "text_config", None) or head.config
    aux_ids = list(reader.meta["aux_layer_ids"])
    last = out / "last"
    if (last / "config.json").exists():
        model, start = load_dflash(last), json.loads((last / "step.json").read_text())["step"]
    else:
        model = DFlashDrafter(config_from_verifier(vc, aux_ids, cfg.block, cfg.num_layers), head.embed_tokens,
                              head.lm_head)
        start = 0
    split = split_samples(len(reader), cfg.val_fraction, cfg.val_max_samples, cfg.seed, reader.ids)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    g = torch.Generator().manual_seed(cfg.seed + start)
    order: list[int] = []
    curve, slots, t0 = [], 0, time.time()
    model.train()
    for step in range(start, cfg.steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step)
        opt.zero_grad()
        total, n_slots = 0.0, 0
        for _ in range(cfg.samples_per_step):
            if not order:
                order = [split.train[j] for j in torch.randperm(len(split.train), generator=g).tolist()]
            s = reader[order.pop()]
            anchors = pick_anchors(s.loss_mask, cfg.anchors, g)
            if not anchors.numel():
                continue
            loss, k = dflash_loss(model, s.aux_hidden.float(), s.input_ids, _targets(head, s), s.loss_mask, anchors,
                                  cfg.loss)
            (loss / cfg.samples_per_step).backward()
            total, n_slots = total + float(loss.detach()) / cfg.samples_per_step, n_slots + k
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        slots += n_slots
        curve.append({"step": step + 1, "loss": round(total, 5), "lr": lr_at(step)})
        if progress and (step + 1) % 20 == 0:
            print(f"[dflash] step {step + 1}/{cfg.steps} loss {total:.4f}", flush=True)
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save_dflash(model, last, verifier)
            (last / "step.json").write_text(json.dumps({"step": step + 1}))
    train_s = time.time() - t0
    model.eval()
    figures = {"steps": cfg.steps, "resumed_at_step": start, "train_s": round(train_s, 1),
               "scored_slots_per_s": round(slots / max(train_s, 1e-9), 1), "train_samples": len(split.train),
               "val_samples": len(split.val), "final_loss": curve[-1]["loss"] if curve else None,
               "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
               **validate(model, head, reader, split.val)}
    save_dflash(model, out / "final", verifier)
    manifest = {"stage": "dflash_train", "config": asdict(cfg), "store": str(store), "verifier": verifier,
                "figures": figures}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in curve))
    return manifest
