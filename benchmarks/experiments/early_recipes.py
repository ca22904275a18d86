"""Drafting recipes early in training, on a real store: each recipe trained on the same training rows (the same
samples in the same order; batch_rows 1 takes twice the steps of 2) from the same seed, scored by its validation
estimate (tau_est on the held-out split), to choose what a short run on CPU should use before paying to serve each.

    .venv/bin/python benchmarks/experiments/early_recipes.py --profile params/smollm2.yaml --run-dir runs/smollm2
    .venv/bin/python benchmarks/experiments/early_recipes.py ... --recipes b2 n31-b1     # some of them

Each recipe is the train stage run again in RUN/early-recipes/<name>/ (resumable, reused when finished: see
eagle3lib/training/variants.py); one line per recipe goes to RUN/early-recipes/results.jsonl and is printed. The
estimate is not the served tau (the evaluate stage and benchmarks/experiments/peer_speculators.py serve drafters
through vLLM), and one seed has no interval: a difference of a few hundredths is noise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# EAGLE 3.1's norms as speculators 0.9 trains EAGLE-3 by default (norm_before_fc, norm_output, norm_before_residual)
N31 = {"train.norm_before_fc": True, "train.norm_output": True, "train.norm_before_residual": True}
ROWS = 160  # training rows each recipe sees (80 steps of 2 rows: ~9 minutes on 2 cores for SmolLM2's drafter)
# every recipe sets each knob it compares, whatever the profile says: the first recipes were measured against the
# profile as it was then (EAGLE-3's norms off, 2 rows a step, the verifier's logits over its whole vocabulary)
BASE = {"train.norm_before_fc": False, "train.norm_output": False, "train.norm_before_residual": False,
        "train.batch_rows": 2, "train.target_logits": "full", "train.loss": "kl", "train.optimizer": "adamw",
        "train.freeze_lm_head": False, "train.lr": 1e-3, "train.packed_row_tokens": 2048}
B1 = {"train.batch_rows": 1, "train.max_steps": ROWS}
RECIPES: dict[str, dict[str, object]] = {name: {**BASE, **over} for name, over in {
    "b2": {"train.max_steps": ROWS // 2},  # the profile's recipe until the 2-hour profile
    "b1": B1,
    "n31-b2": {**N31, "train.max_steps": ROWS // 2},
    "n31-b1": {**N31, **B1},
    "frozen-head-b2": {"train.freeze_lm_head": True, "train.max_steps": ROWS // 2},
    # the loss on the verifier's argmax alone: the one greedy gain over forward KL that two seeds support on the tiny
    # verifier (docs/howto/recipes.md); SmolLM2 samples at 0.2, close to greedy
    "n31-b1-ce": {**N31, **B1, "train.loss": "ce_argmax"},
    # Muon on the drafter's matrices (speculators' optimizer; eagle3lib/training/optimizer.py)
    "n31-b1-muon": {**N31, **B1, "train.optimizer": "muon"},
    # what a short run might gain on top of Muon: a higher peak lr, the lm_head frozen (1.14x the tokens/s,
    # benchmarks/train_options.py), and rows of half the length (twice the steps for the same tokens; 4.2% of this
    # store's tokens lie past 1,024 in their sample and are cut)
    "n31-b1-muon-lr3e-3": {**N31, **B1, "train.optimizer": "muon", "train.lr": 3e-3},
    "n31-b1-muon-lr6e-3": {**N31, **B1, "train.optimizer": "muon", "train.lr": 6e-3},
    "n31-b1-lr3e-3": {**N31, **B1, "train.lr": 3e-3},
    "n31-b1-muon-fh": {**N31, **B1, "train.optimizer": "muon", "train.freeze_lm_head": True},
    # the profile's recipe since 56156dc with the lm_head frozen as speculators freezes it
    "n31-b1-muon-lr3e-3-fh": {**N31, **B1, "train.optimizer": "muon", "train.lr": 3e-3, "train.freeze_lm_head": True},
    "n31-b1-muon-r1024": {**N31, **B1, "train.optimizer": "muon", "train.packed_row_tokens": 1024,
                          "train.max_steps": 2 * ROWS},
}.items()}
KEEP = ("steps", "train_s", "tokens_per_s", "val_tau_est", "val_full_acc_0", "val_full_acc_1", "val_full_acc_2")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="params/smollm2.yaml")
    ap.add_argument("--run-dir", type=Path, required=True, help="a run whose extract stage is complete")
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    from eagle3lib.config.stages import open_stage
    from eagle3lib.training.variants import QUIET, train_variant

    run_dir = open_stage("train", a.profile, a.run_dir, {}, say=lambda _m: None).run_dir
    root = run_dir / "early-recipes"
    root.mkdir(parents=True, exist_ok=True)
    # the variants' own folder as the stage's: train_variant keeps every variant inside it (never the run's train/)
    ctx = open_stage("train", a.profile, run_dir, {}, say=lambda _m: None, out_dir=root)
    print(f"{'recipe':16} {'steps':>6} {'train s':>8} {'tokens/s':>9} {'val tau_est':>12}  acceptance 1 / 2 / 3")
    for name in a.recipes:
        out = root / name
        out.mkdir(exist_ok=True)
        m, _ = train_variant(ctx, out, {"train.seed": a.seed, **QUIET, **RECIPES[name]}, name, echo=lambda _m: None)
        row = {"recipe": name, "seed": a.seed, **{k: m["figures"].get(k) for k in KEEP}}
        with open(root / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        acc = " / ".join(f"{row[f'val_full_acc_{k}']:.3f}" for k in range(3) if row.get(f"val_full_acc_{k}") is not None)
        print(f"{name:16} {row['steps']:>6} {row['train_s']:>8.0f} {row['tokens_per_s']:>9.0f} "
              f"{row['val_tau_est']:>12.3f}  {acc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
