"""Does vLLM pay for switching K with the batch size? A K schedule against fixed K, interleaved, on one drafter.

  .venv/bin/python benchmarks/k_schedule_switching.py --drafter runs/demo/train/final
  .venv/bin/python benchmarks/k_schedule_switching.py --drafter ... --rounds 8 --concurrency 4 2 --json out.json

The question (docs/howto/choose-k.md): on the demo's grid the served schedule ran at 0.86 of the best fixed K over the
grid (0.45 at 4 requests, where the batch drains across its K = 3 / K = 4 boundary) against fixed K = 3's 0.99. Noise,
or a cost of switching K? Four speculative servers of the tiny verifier and the drafter, all up at once, fp32, eager:

  k3        fixed K = 3
  k4        fixed K = 4
  flat      the schedule [[1, 256, 3]]: the schedule's code path, K never changes (what the machinery alone costs)
  switch    the schedule [[1, 2, 4], [3, 256, 3]]: K = 3 while 3+ requests run, K = 4 once the batch drains to 2 or 1
            (the grid's boundary)

Each round runs one greedy pass per server at each concurrency, the servers in a rotated order (so whatever loads the
machine at the time loads every server alike); a pass is the evaluate grid's (held-out prompts cycled to 8 x
concurrency requests, max_tokens 128). Printed per concurrency: each server's median tokens/s, and the ratios flat/k3,
switch/k3 and switch/k4 as a geometric mean over rounds with a 95% bootstrap interval over rounds. An interval that
holds 1.0 is noise at this machine's resolution; one wholly below 1.0 is a cost. The greedy outputs of every server are
checked against k3's (speculation must not change greedy text).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
from pathlib import Path

SERVERS = {"k3": (3, None), "k4": (4, None), "flat": (3, [[1, 256, 3]]), "switch": (4, [[1, 2, 4], [3, 256, 3]])}
RATIOS = [("flat", "k3"), ("switch", "k3"), ("switch", "k4")]


def geo_interval(logs: list[float], samples: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """Geometric mean of the per-round ratios (given as logs) and its 95% bootstrap interval over rounds."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(samples))
    return (math.exp(statistics.fmean(logs)), math.exp(means[int(0.025 * samples)]),
            math.exp(means[int(0.975 * samples) - 1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True, help="a drafter checkpoint of the tiny verifier (RUN/train/final)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 2])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from eagle3lib.config.stages import open_stage
    from eagle3lib.evaluation.concurrency_grid import grid_prompts, schedule_extra
    from eagle3lib.evaluation.inputs import select_prompts
    from eagle3lib.model.verifier import load_tokenizer
    from eagle3lib.tiny.build import tiny_verifier_path
    from eagle3lib.vllm.measure import run_pass, warmup
    from eagle3lib.vllm.serving import drafter_server

    model = str(tiny_verifier_path(progress=False))
    drafter = Path(a.drafter).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ctx = open_stage("evaluate", "tiny", root, {"evaluate.max_tokens": a.max_tokens, "evaluate.progress": False})
        cfg, vcfg = ctx.cfg, ctx.verifier
        prompts = select_prompts(cfg, load_tokenizer(model), vcfg.max_model_len, 4, None)[0]
        servers = {name: drafter_server(vcfg, model, root / f"{name}.log", drafter, k, spec_extra=schedule_extra(sched),
                                        server_args=cfg.server_args)
                   for name, (k, sched) in SERVERS.items()}
        try:
            for name, s in servers.items():
                print(f"starting {name} ...", flush=True)
                s.start()
            eps = {name: s.endpoint() for name, s in servers.items()}
            for ep in eps.values():
                warmup(ep, prompts, cfg.warmup_requests, 16, 0.0, cfg.request_timeout_s)
            tps: dict[int, dict[str, list[float]]] = {c: {n: [] for n in SERVERS} for c in a.concurrency}
            taus: dict[str, list[float]] = {n: [] for n in SERVERS}
            mismatched: dict[str, int] = {n: 0 for n in SERVERS}
            names = list(SERVERS)
            for r in range(a.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for c in a.concurrency:
                    outs = {}
                    for n in order:
                        p = run_pass(eps[n], grid_prompts(prompts, c), temperature=0.0, max_tokens=a.max_tokens,
                                     concurrency=c, request_timeout_s=cfg.request_timeout_s,
                                     connect_timeout_s=cfg.connect_timeout_s, counters=True, progress=False)
                        tps[c][n].append(p["tokens_per_s"])
                        taus[n].append(p["tau"])
                        outs[n] = p["outputs"]
                    for n in names:
                        mismatched[n] += sum(outs[n][i] != outs["k3"][i] for i in outs["k3"])
                    print(f"round {r + 1}/{a.rounds} c={c}: " +
                          "  ".join(f"{n} {tps[c][n][-1]:.0f}" for n in names), flush=True)
        finally:
            for s in servers.values():
                s.stop()

    result = {"drafter": str(drafter), "rounds": a.rounds, "max_tokens": a.max_tokens, "servers":
              {n: {"k": k, "schedule": s} for n, (k, s) in SERVERS.items()},
              "tau": {n: statistics.median(v) for n, v in taus.items()},
              "greedy_outputs_differing_from_k3": mismatched, "concurrency": {}}
    print("\ntau (median over passes): " + ", ".join(f"{n} {t:.2f}" for n, t in result["tau"].items()))
    print(f"greedy outputs differing from k3's: {mismatched}")
    for c in a.concurrency:
        row = {"tokens_per_s": tps[c], "median_tokens_per_s": {n: statistics.median(v) for n, v in tps[c].items()}}
        print(f"\nconcurrency {c}: median tokens/s " +
              ", ".join(f"{n} {v:.0f}" for n, v in row["median_tokens_per_s"].items()))
        for x, y in RATIOS:
            g, lo, hi = geo_interval([math.log(p / q) for p, q in zip(tps[c][x], tps[c][y], strict=True)])
            row[f"{x}/{y}"] = {"ratio": g, "interval": [lo, hi]}
            print(f"  {x}/{y}: {g:.3f} [{lo:.3f}, {hi:.3f}]")
        result["concurrency"][str(c)] = row
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
