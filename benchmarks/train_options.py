"""Training tokens/s of the train options that buy speed, side by side on one run's hidden-state store: each variant is
the train stage's own Trainer (the profile's settings plus the variant's overrides) taking optimizer steps on the same
rows, one step of every variant per round in rotating order, so the machine's load hits all alike.

    .venv/bin/python benchmarks/train_options.py --profile params/smollm2.yaml --run-dir runs/smollm2 [--rounds 8]
    .venv/bin/python benchmarks/train_options.py --profile tiny --run-dir runs/demo --variants target_logits=draft

Prints per variant: tokens/s (non-padding tokens of the packed rows over the summed step times) and its ratio to the
first variant (the profile as it is) with a 95% bootstrap interval over rounds. The learning side of each option (what
it costs per step in acceptance) is a training run's figure, not this benchmark's: docs/howto/real-model.md.
Nothing is written to the run; the variants' folders are temporary.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VARIANTS = ["target_logits=draft", "freeze_lm_head=true", "target_logits=draft,freeze_lm_head=true"]


def parse_variant(text: str) -> dict[str, object]:
    """"a=1,b=x" -> {"train.a": 1, "train.b": "x"} (values read as JSON where they parse)."""
    out: dict[str, object] = {}
    for part in filter(None, text.split(",")):
        key, _, raw = part.partition("=")
        try:
            out[f"train.{key.strip()}"] = json.loads(raw)
        except json.JSONDecodeError:
            out[f"train.{key.strip()}"] = raw.strip()
    return out


def ratio_ci(base: list[float], other: list[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(tokens/s ratio other/base, 95% interval) from per-round step seconds (same tokens per round for both)."""
    rng = random.Random(seed)
    point = sum(base) / sum(other)
    draws = []
    for _ in range(n_boot):
        idx = [rng.randrange(len(base)) for _ in base]
        draws.append(sum(base[i] for i in idx) / sum(other[i] for i in idx))
    draws.sort()
    return point, draws[int(0.025 * n_boot)], draws[int(0.975 * n_boot) - 1]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="params/smollm2.yaml")
    ap.add_argument("--run-dir", type=Path, default=REPO / "runs" / "smollm2", help="a run whose extract stage is done")
    ap.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS, help="key=value[,key=value] train overrides")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds (one step of every variant each)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    a = ap.parse_args(argv)

    from eagle3lib.config.stages import open_stage
    from eagle3lib.training.loop import Trainer

    names = ["profile", *a.variants]
    overs = [{}, *(parse_variant(v) for v in a.variants)]
    steps = a.warmup + a.rounds
    base = {"train.max_steps": steps, "train.resume": False, "train.report_to": [], "train.log_every": 10**6}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = []
        for name, over in zip(names, overs, strict=True):
            ctx = open_stage("train", a.profile, a.run_dir, {**base, **over}, say=lambda _m: None,
                             out_dir=Path(tmp) / name.replace("=", "-").replace(",", "+"))
            t = Trainer(ctx)
            t.last_ckpt = None
            trainers.append(t)
        seconds: list[list[float]] = [[] for _ in trainers]
        tokens = [0] * len(trainers)
        for r in range(steps):
            order = list(range(len(trainers)))
            order = order[r % len(order):] + order[: r % len(order)]
            for i in order:
                t = trainers[i]
                mbs = t.load_step(r)
                t0 = time.perf_counter()
                t._step(mbs)
                t.progress.step += 1
                if r >= a.warmup:
                    seconds[i].append(time.perf_counter() - t0)
                    tokens[i] += sum(mb.n_tokens for mb in mbs)
            print(f"round {r + 1}/{steps}" + (" (warm-up)" if r < a.warmup else ""), file=sys.stderr, flush=True)
    print(f"{'variant':<44} {'tokens/s':>9}  ratio to the profile [95% interval over {a.rounds} rounds]")
    for i, name in enumerate(names):
        tps = tokens[i] / sum(seconds[i])
        if i == 0:
            print(f"{name:<44} {tps:>9.0f}")
        else:
            r, lo, hi = ratio_ci(seconds[0], seconds[i])
            print(f"{name:<44} {tps:>9.0f}  {r:.3f}x [{lo:.3f}, {hi:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
