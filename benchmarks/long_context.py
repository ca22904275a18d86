"""Long reasoning traces: peak memory and time of one drafter training step against the sample length, the TTT
attention layouts side by side in one run, and the memory model's prediction next to each measurement.

    .venv/bin/python benchmarks/long_context.py                       # tiny 1K-32K, kimi-heads 1K-4K (~45 min, 2 cores)
    .venv/bin/python benchmarks/long_context.py --configs tiny --lengths 1024,2048 --layouts flash,doc
    .venv/bin/python benchmarks/long_context.py --json out.json       # the table as structured results too
    .venv/bin/python benchmarks/long_context.py --bf16 --layouts flash  # under torch.autocast("cpu", bfloat16)

One step = drafter forward over the K TTT steps + loss + backward (no optimizer update: its state does not depend on
the length), on ONE packed row holding ONE sample of L tokens (a long trace: the worst case for attention), fp32 (or
bf16 autocast with --bf16: the model's BF16 figures), CPU.
Every (config, layout, L) runs in its own process, so its peak resident memory (ru_maxrss) minus the resident memory
after setup is the step's own: activations, what autograd keeps, transient scores, gradients. Time: the fastest step
after a first one that warms the allocator (up to 5 of them while they take under 3 s in all).

Configs: "tiny" = the tiny verifier's drafter (hidden 192, 3 heads x 64, 1 KV head, K = 3); "kimi-heads" = the
kimi-k2.5 profile's drafter attention (64 heads x 128, 8 KV heads, K = 5) with the hidden size scaled down to 512 so it
fits here. The quadratic layouts are skipped where the memory model says a step needs more than --max-gib.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIGS = {  # DrafterConfig fields besides the vocabulary; "K" = TTT steps
    "tiny": dict(hidden_size=192, intermediate_size=512, num_attention_heads=3, num_key_value_heads=1, head_dim=64,
                 vocab_size=1400, draft_vocab_size=512, K=3),
    "kimi-heads": dict(hidden_size=512, intermediate_size=1024, num_attention_heads=64, num_key_value_heads=8,
                       head_dim=128, vocab_size=4096, draft_vocab_size=2048, K=5),
}
DEFAULT_LENGTHS = {"tiny": [1024, 2048, 4096, 8192, 16384, 32768], "kimi-heads": [1024, 2048, 4096]}  # kimi-heads
# at 8K: ~5 min per step here (--lengths 8192)
LAYOUTS = ["flash", "doc", "sdpa"]
MODELLED = ("flash", "doc")  # the memory model's "sdpa" figure is doc's, an upper bound (SDPA keeps no probabilities)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(config: str, layout: str, L: int, threads: int, sample: int, bf16: bool = False) -> dict:
    """One measurement, in this (fresh) process."""
    import torch

    from eagle3lib.data.packing import MicroBatch
    from eagle3lib.model.drafter import DrafterConfig, Eagle3Drafter
    from eagle3lib.model.ttt import TTTModel

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    c = dict(CONFIGS[config])
    K = c.pop("K")
    cfg = DrafterConfig(**c, ttt_steps=K, max_position_embeddings=max(L, 2048))
    d = Eagle3Drafter(cfg)
    d.reset_parameters(std=0.02)
    d.set_vocab(torch.arange(cfg.draft_vocab_size))
    H = cfg.hidden_size
    model = TTTModel(d, torch.ones(H), torch.randn(cfg.vocab_size, H) * 0.05, 1e-6, K, 0.8, "mask", layout)
    pos = torch.arange(L) % sample  # samples of `sample` tokens packed in the row
    loss_mask = (pos >= sample // 16)[None]  # a short prompt, then the trace
    mb = MicroBatch(aux=torch.randn(1, L, 3, H), final=torch.randn(1, L, H),
                    ids=torch.randint(0, cfg.vocab_size, (1, L)), loss_mask=loss_mask,
                    pos=pos[None], doc=(torch.arange(L) // sample)[None], n_tokens=L, n_samples=-(-L // sample))
    den = torch.full((K,), float(L))
    base = rss_bytes()
    times: list[float] = []
    while len(times) < 2 or (len(times) < 6 and sum(times[1:]) < 3.0):  # short steps: several, the fastest counts
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = model(mb, den)
        loss.backward()
        times.append(time.perf_counter() - t0)
        for p in model.parameters():
            p.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"config": config, "layout": layout, "L": L, "sample_tokens": sample, "K": K, "bf16": bf16,
            "peak_mib": (peak - base) / 2**20,
            "step_s": min(times[1:]), "tokens_per_s": L / min(times[1:])}


def measure(config: str, layout: str, L: int, threads: int, sample: int, bf16: bool = False) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", config, layout, str(L), "--threads", str(threads),
                        "--sample-tokens", str(sample)] + (["--bf16"] if bf16 else []),
                       capture_output=True, text=True)
    if r.returncode:
        return {"config": config, "layout": layout, "L": L, "error": (r.stderr or r.stdout).strip().splitlines()[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny,kimi-heads")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--lengths", default=None, help="comma-separated sample lengths (default per config)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sample-tokens", type=int, default=None, help="pack samples of this length (default: one sample "
                    "per row) -- the demo's rows are ~100-token samples packed into 1,024")
    ap.add_argument("--max-gib", type=float, default=12.0, help="skip runs the memory model puts above this")
    ap.add_argument("--max-step-s", type=float, default=150.0, help="skip a layout's longer lengths once a step took "
                    "more than this")
    ap.add_argument("--bf16", action="store_true", help="run the step under bf16 autocast (model: dtype_bytes=2)")
    ap.add_argument("--json", type=Path, default=None, help="also write the measurements here")
    ap.add_argument("--summarize", type=Path, default=None, help="print the summary of an earlier --json file")
    ap.add_argument("--child", nargs=3, metavar=("CONFIG", "LAYOUT", "L"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], int(a.child[2]), a.threads, a.sample_tokens or int(a.child[2]),
                               a.bf16)))
        return
    if a.summarize:
        results = json.loads(a.summarize.read_text())["results"]
        for r in results:
            print(line(r))
        print("\n".join(["", *summary(results)]))
        return
    from eagle3lib.training.memory_model import step_bytes

    results = []
    too_slow: set[tuple[str, str]] = set()
    print("bf16 autocast (model: dtype_bytes=2)" if a.bf16 else "fp32 (model: dtype_bytes=4)", flush=True)
    for config in a.configs.split(","):
        c = dict(CONFIGS[config])
        K = c.pop("K")
        lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else DEFAULT_LENGTHS[config]
        for L in lengths:
            for layout in a.layouts.split(","):
                sample = min(a.sample_tokens or L, L)
                s = shape_of(c)
                model = step_bytes(s, K=K, row_tokens=L, sample_tokens=sample, layout=layout,
                                   dtype_bytes=2 if a.bf16 else 4) + (2 * s.parameters() if a.bf16 else 0)  # + autocast's
                # bf16 weight copies (run_bytes counts them with the parameters)
                if model > a.max_gib * 2**30:
                    r = {"config": config, "layout": layout, "L": L, "skipped": f"model {model / 2**30:.1f} GiB"}
                elif (config, layout) in too_slow:
                    r = {"config": config, "layout": layout, "L": L, "skipped": f"a shorter step took > {a.max_step_s} s"}
                else:
                    r = measure(config, layout, L, a.threads, sample, a.bf16)
                    if r.get("step_s", 0) > a.max_step_s:
                        too_slow.add((config, layout))
                r["model_mib"] = model / 2**20
                results.append(r)
                print(line(r), flush=True)
    print()
    for s in summary(results):
        print(s)
    if a.json:
        a.json.write_text(json.dumps({"results": results, "summary": summary(results)}, indent=1))


def shape_of(c: dict):
    from eagle3lib.model.drafter_shape import DrafterShape

    return DrafterShape(hidden=c["hidden_size"], intermediate=c["intermediate_size"], heads=c["num_attention_heads"],
                        kv_heads=c["num_key_value_heads"], qk_dim=c["head_dim"], v_dim=c["head_dim"],
                        draft_vocab=c["draft_vocab_size"])


def line(r: dict) -> str:
    head = f"{r['config']:>10} {r['layout']:>6} L={r['L']:>6}"
    if "skipped" in r or "error" in r:
        return f"{head}  {r.get('skipped') or 'error: ' + r['error']}"
    return (f"{head}  peak {r['peak_mib']:9,.0f} MiB (model {r['model_mib']:9,.0f}, x{r['model_mib'] / r['peak_mib']:.2f})"
            f"  step {r['step_s']:7.2f} s  {r['tokens_per_s']:8,.0f} tok/s")


def summary(results: list[dict]) -> list[str]:
    """The ratios the targets are stated in: flash's 16K / 2K peak, flash vs the best other layout at 1K-2K."""
    from eagle3lib.model.ttt_attention import AUTO_DOC_MAX

    ok = {(r["config"], r["layout"], r["L"]): r for r in results if "peak_mib" in r}
    out = []
    for config in sorted({r["config"] for r in results}):
        f2, f16 = ok.get((config, "flash", 2048)), ok.get((config, "flash", 16384))
        if f2 and f16:
            out.append(f"{config}: flash peak 16K / 2K = {f16['peak_mib'] / f2['peak_mib']:.2f}x (linear: 8x; target <= 10x)")
        for lay in LAYOUTS:
            runs = sorted((r for (c, la, _), r in ok.items() if c == config and la == lay), key=lambda r: r["L"])
            if len(runs) > 1:
                a, b = runs[0], runs[-1]
                out.append(f"{config}: {lay} peak {b['L']} / {a['L']} tokens = {b['peak_mib'] / a['peak_mib']:.2f}x "
                           f"(length x{b['L'] / a['L']:.0f})")
        heads = CONFIGS[config]["num_attention_heads"]
        for L in (1024, 2048):
            f = ok.get((config, "flash", L))
            others = [r for (c, lay, n), r in ok.items() if c == config and n == L and lay != "flash"]
            if f and others:
                best = max(others, key=lambda r: r["tokens_per_s"])
                out.append(f"{config}: L={L} flash {f['tokens_per_s']:,.0f} tok/s vs best other ({best['layout']}) "
                           f"{best['tokens_per_s']:,.0f} = {f['tokens_per_s'] / best['tokens_per_s']:.2f}x; peak "
                           f"{f['peak_mib'] / best['peak_mib']:.2f}x")
                # the default ("auto") runs doc or flash by the rule in make_attention: which one, measured here
                pick = ok.get((config, "doc" if heads * L <= AUTO_DOC_MAX else "flash", L))
                if pick:
                    out.append(f"{config}: L={L} auto (the default) runs {pick['layout']}: "
                               f"{pick['tokens_per_s'] / max(r['tokens_per_s'] for r in others + [f]):.2f}x the "
                               f"fastest layout's tok/s")
        for r in (r for r in results if r["config"] == config and "peak_mib" in r and r["layout"] in MODELLED):
            err = r["model_mib"] / r["peak_mib"] - 1
            if abs(err) > 0.2:
                out.append(f"{config}: memory model off by {err:+.0%} at {r['layout']} L={r['L']}")
    return out


if __name__ == "__main__":
    main()
