"""Extraction benchmarks, every ratio measured side by side in one run on the same samples.

  .venv/bin/python benchmarks/extract.py                 # tiny, tiny-kimi and a mid-size random verifier, HF and vLLM
  .venv/bin/python benchmarks/extract.py --no-vllm       # HF only (no vLLM server starts)
  .venv/bin/python benchmarks/extract.py --verifiers tiny,tiny-kimi --no-naive   # the dense vs MLA + MoE comparison

1. HF-hook backend vs naive `output_hidden_states=True` (the whole CausalLM forward keeping all L+1 states and the
   logits): tokens/s and peak memory of the extraction (each variant in a fresh subprocess; CPU: peak RSS above the
   loaded model via /proc VmHWM reset, GPU: torch.cuda.max_memory_allocated).
2. HF-hook backend vs vLLM backend (extract_hidden_states + eagle3lib's connector): tokens/s, server start excluded;
   each as the stage runs it here (HF: hf_dtype auto = fp32 on CPU; vLLM: verifier.dtype bf16).
3. Bytes per token on disk, bf16 vs fp8, from stores written with each.
Verifiers: the tiny one (hidden 192, 8 layers), its Kimi-K2.5 twin tiny-kimi (DeepSeek-V3: MLA + MoE, hidden 192,
8 layers; vLLM on its CPU_MLA and MoE backends) and a mid-size one built from config (hidden 1024, 16 layers, random
weights, the tiny tokenizer), saved to a temp dir. Then tiny-kimi over tiny per backend, from the same run. Results:
printed, and as JSON with --json PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
HF_DTYPE = {"cpu": "float32", "cuda": "bfloat16"}  # what extract.hf_dtype=auto picks (bf16 matmuls are emulated on most CPUs)


def build_mid_verifier(out: Path, tiny: Path, hidden: int = 1024, layers: int = 16) -> Path:
    from transformers import AutoConfig, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    if (out / "config.json").exists():
        return out
    t = AutoConfig.from_pretrained(tiny)
    cfg = Qwen3Config(vocab_size=t.vocab_size, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
                      max_position_embeddings=t.max_position_embeddings, rope_theta=10000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id,
                      pad_token_id=t.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return out


def samples(tok, n: int, seed: int = 99, repeat: int = 1):
    """Corpus conversations; `repeat` > 1 concatenates several into one longer sample (closer to real lengths)."""
    from eagle3lib.data.chat_tokens import ChatTokenizer, TokenizeStats
    from eagle3lib.data.datasets import Conversation
    from eagle3lib.tiny import corpus

    convs = []
    for i in range(n):
        msgs = []
        for j in range(repeat):
            msgs += corpus.sample(seed, i * repeat + j)["messages"]
        convs.append(Conversation(f"b{i}", msgs))
    # <|im_end|> ends a turn in both chat formats (tiny-kimi's tokenizer eos is [EOS], as Kimi's)
    return list(ChatTokenizer(tok, 2048, end_of_turn=["<|im_end|>"])(convs, TokenizeStats()))


# ------------------------------------------------------------------------------------ 1. hooks vs naive (subprocess)


def _hwm_reset() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
        return True
    except OSError:
        return False


def _hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def child_hf(model_dir: str, mode: str, n: int, repeat: int, batch_tokens: int, threads: int, reps: int = 3) -> dict:
    """Runs in a fresh process. mode "hooks"/"naive": peak memory of one extraction pass after a warm-up;
    mode "both": throughput of the two, alternating pass by pass (best of `reps` each), so load swings on a shared
    machine hit both alike."""
    from transformers import AutoTokenizer

    from eagle3lib.model.hf_extract import HFExtractor, length_batches, pad_batch
    from eagle3lib.model.verifier import default_aux_layers, load_hf_model

    torch.set_num_threads(threads)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = samples(tok, n, repeat=repeat)
    model = load_hf_model(model_dir, dtype=HF_DTYPE[dev]).to(dev)
    L = model.config.num_hidden_layers
    aux = default_aux_layers(L)

    def naive_batch(batch):
        ids, mask = pad_batch(batch, 0)
        with torch.inference_mode():
            out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=True)
        hs = out.hidden_states
        a = torch.stack([hs[k] for k in aux], dim=2).cpu()
        f = hs[L].cpu()  # (post-norm in transformers 5.x: the naive way is also subtly wrong)
        return [(a[b, : len(s)].clone(), f[b, : len(s)].clone()) for b, s in enumerate(batch)]

    def run_pass(which, items):
        toks = 0
        if which == "hooks":
            ex = HFExtractor("", aux, model=model, device=dev, batch_tokens=batch_tokens)
            for s, _a, _f in ex.extract(items):
                toks += len(s)
            ex.close()
        else:
            for idx in length_batches(items, batch_tokens):
                for r in naive_batch([items[i] for i in idx]):
                    toks += r[0].shape[0]
        if dev == "cuda":
            torch.cuda.synchronize()
        return toks

    modes = ["hooks", "naive"] if mode == "both" else [mode]
    for m in modes:
        run_pass(m, data[: max(2, len(data) // 6)])  # warm-up (allocator, kernels) on a few samples
    if mode == "both":
        best = {m: float("inf") for m in modes}
        toks = 0
        for r in range(reps):
            for m in modes if r % 2 == 0 else modes[::-1]:
                t0 = time.perf_counter()
                toks = run_pass(m, data)
                best[m] = min(best[m], time.perf_counter() - t0)
        return {"tokens": toks, "device": dev, "reps": reps,
                **{m: {"seconds": best[m], "tokens_per_s": toks / best[m]} for m in modes}}
    import gc

    gc.collect()
    base = _rss_kib()
    reset_ok = _hwm_reset()
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    run_pass(mode, data)
    out = {"mode": mode, "device": dev, "peak_extra_mib": max(0, _hwm_kib() - base) / 1024, "hwm_reset": reset_ok}
    if dev == "cuda":
        out["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base_cuda) / 2**20
    return out


def hooks_vs_naive(model_dir: Path, n: int, repeat: int, batch_tokens: int, threads: int, reps: int) -> dict:
    res = {}
    for mode in ("both", "hooks", "naive"):
        p = subprocess.run([sys.executable, str(HERE), "--child", str(model_dir), mode, str(n), str(repeat),
                            str(batch_tokens), str(threads), str(reps)], capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"child {mode} failed:\n{p.stderr[-3000:]}")
        res[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    for m in ("hooks", "naive"):
        res[m].update(res["both"][m])
    res["tokens"] = res.pop("both")["tokens"]
    res["speedup"] = res["hooks"]["tokens_per_s"] / res["naive"]["tokens_per_s"]
    res["memory_ratio"] = res["hooks"]["peak_extra_mib"] / max(1e-9, res["naive"]["peak_extra_mib"])
    return res


# --------------------------------------------------------------------------------------------- 2. HF vs vLLM


def hf_vs_vllm(model_dir: Path, n: int, repeat: int, batch_tokens: int, threads: int, concurrency: int, work: Path,
               reps: int = 3) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    from eagle3lib.config.verifier import VerifierConfig
    from eagle3lib.model.hf_extract import HFExtractor
    from eagle3lib.model.verifier import default_aux_layers, load_hf_model
    from eagle3lib.vllm.hidden_states import VLLMExtractor

    tok = AutoTokenizer.from_pretrained(model_dir)
    data = samples(tok, n, repeat=repeat)
    c = AutoConfig.from_pretrained(model_dir)
    aux = default_aux_layers(c.num_hidden_layers)
    tokens = sum(len(s) for s in data)
    out: dict = {"samples": len(data), "tokens": tokens}

    torch.set_num_threads(threads)
    model = load_hf_model(str(model_dir), dtype=HF_DTYPE["cpu"])
    ex = HFExtractor("", aux, model=model, device="cpu", batch_tokens=batch_tokens)
    vcfg = VerifierConfig(model=str(model_dir), max_model_len=2048, kv_cache_gib=2)
    vx = VLLMExtractor(str(model_dir), vcfg, aux, c.num_hidden_layers, work / f"vllm-{model_dir.name}", 2048,
                       concurrency=concurrency, extra_args=["--no-enable-prefix-caching"],
                       max_position_embeddings=c.max_position_embeddings)
    with vx:  # the server idles while HF runs; the two alternate pass by pass (best of `reps` each)
        out["vllm_server_start_s"] = vx.start_s
        runs = {"hf": lambda items: {s.id: (a, f) for s, a, f in ex.extract(items)},
                "vllm": lambda items: {s.id: (a, f) for s, a, f in vx.extract(items)}}
        for run in runs.values():
            run(data[: max(2, n // 8)])  # warm-up
        best = {k: float("inf") for k in runs}
        res = {}
        for r in range(reps):
            for k in (["hf", "vllm"] if r % 2 == 0 else ["vllm", "hf"]):
                t0 = time.perf_counter()
                res[k] = runs[k](data)
                best[k] = min(best[k], time.perf_counter() - t0)
    ex.close()
    hf, vl = res["hf"], res["vllm"]
    out["hf_tokens_per_s"] = tokens / best["hf"]
    out["vllm_tokens_per_s"] = tokens / best["vllm"]
    out["hf_over_vllm"] = out["hf_tokens_per_s"] / out["vllm_tokens_per_s"]
    rel = [((vl[k][1].float() - hf[k][1].float()).norm() / hf[k][1].float().norm()).item() for k in hf]
    out["final_rel_diff_mean"] = sum(rel) / len(rel)
    return out


# ------------------------------------------------------------------------------------------ 3. bytes per token


def bytes_per_token_measured(model_dir: Path, n: int, work: Path, threads: int) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    from eagle3lib.data.hidden_store import HiddenSample, HiddenStateWriter, bytes_per_token
    from eagle3lib.model.hf_extract import HFExtractor
    from eagle3lib.model.verifier import default_aux_layers, load_hf_model

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    c = AutoConfig.from_pretrained(model_dir)
    aux = default_aux_layers(c.num_hidden_layers)
    data = samples(tok, n)
    ex = HFExtractor("", aux, model=load_hf_model(str(model_dir), dtype=HF_DTYPE["cpu"]), device="cpu")
    res = list(ex.extract(data))
    out = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        d = work / f"store-{model_dir.name}-{dtype}"
        meta = {"verifier": str(model_dir), "hidden_size": c.hidden_size, "aux_layer_ids": aux,
                "num_layers": c.num_hidden_layers, "vocab_size": c.vocab_size}
        with HiddenStateWriter(d, meta, samples_per_shard=64, dtype=dtype) as w:
            for s, a, f in res:
                w.add(HiddenSample(s.id, torch.from_numpy(s.input_ids.astype("int64")), torch.from_numpy(s.loss_mask), a, f))
        tot = w.totals()
        out[dtype] = {"bytes_per_token": tot["bytes"] / tot["tokens"], "formula": bytes_per_token(c.hidden_size, dtype)}
    out["fp8_over_bf16"] = out["float8_e4m3fn"]["bytes_per_token"] / out["bfloat16"]["bytes_per_token"]
    for h in (4096, 7168):
        out[f"formula_H{h}"] = {"bfloat16": bytes_per_token(h), "float8_e4m3fn": bytes_per_token(h, "float8_e4m3fn")}
    return out


def kimi_over_tiny(tiny: dict, kimi: dict) -> dict:
    """tiny-kimi's figures over tiny's, measured in this run: tokens/s per backend and bytes per token."""
    out = {}
    for backend in ("hf", "vllm"):
        if "hf_vs_vllm" in tiny and "hf_vs_vllm" in kimi:
            out[f"{backend}_tokens_per_s"] = kimi["hf_vs_vllm"][f"{backend}_tokens_per_s"] / tiny["hf_vs_vllm"][f"{backend}_tokens_per_s"]
    out["bytes_per_token_bf16"] = (kimi["bytes_per_token"]["bfloat16"]["bytes_per_token"]
                                   / tiny["bytes_per_token"]["bfloat16"]["bytes_per_token"])
    return out


def main() -> int:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop vLLM servers, drop temp dirs
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        a = sys.argv[2:]
        print(json.dumps(child_hf(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]), int(a[6]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=48, help="samples per measurement")
    ap.add_argument("--repeat", type=int, default=4, help="conversations concatenated per sample (longer samples)")
    ap.add_argument("--mid-samples", type=int, default=12, help="samples for the mid-size verifier (~30x the compute per token)")
    ap.add_argument("--mid-repeat", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="timed passes per measurement; the best is reported")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-naive", action="store_true", help="skip the hooks vs output_hidden_states comparison")
    ap.add_argument("--verifiers", default="tiny,tiny-kimi,mid", help="comma-separated: tiny, tiny-kimi, mid")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from eagle3lib.tiny.build import tiny_verifier_path
    from eagle3lib.tiny.kimi import TinyKimiRecipe

    tiny = tiny_verifier_path()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        work = Path(tmp)
        runs = {"tiny": lambda: (tiny, args.samples, args.repeat),
                "tiny-kimi": lambda: (tiny_verifier_path(TinyKimiRecipe()), args.samples, args.repeat),
                "mid": lambda: (build_mid_verifier(work / "mid-1024x16", tiny), args.mid_samples, args.mid_repeat)}
        for name in args.verifiers.split(","):
            path, n, rep = runs[name]()
            r = results[name] = {"samples": n, "repeat": rep}
            print(f"== {name} verifier ({path})", flush=True)
            if not args.no_naive:
                r["hooks_vs_naive"] = hooks_vs_naive(path, n, rep, args.batch_tokens, args.threads, args.reps)
                h, nv = r["hooks_vs_naive"]["hooks"], r["hooks_vs_naive"]["naive"]
                print(f"  HF hooks {h['tokens_per_s']:,.0f} tok/s, peak +{h['peak_extra_mib']:,.0f} MiB | naive "
                      f"output_hidden_states {nv['tokens_per_s']:,.0f} tok/s, peak +{nv['peak_extra_mib']:,.0f} MiB | "
                      f"speedup x{r['hooks_vs_naive']['speedup']:.2f}, memory x{r['hooks_vs_naive']['memory_ratio']:.2f}",
                      flush=True)
            if not args.no_vllm:
                r["hf_vs_vllm"] = hf_vs_vllm(path, n, rep, args.batch_tokens, args.threads, args.concurrency, work, args.reps)
                v = r["hf_vs_vllm"]
                print(f"  HF hooks {v['hf_tokens_per_s']:,.0f} tok/s | vLLM {v['vllm_tokens_per_s']:,.0f} tok/s "
                      f"(server start {v['vllm_server_start_s']:.0f} s) | HF/vLLM x{v['hf_over_vllm']:.2f} | "
                      f"final-state rel. diff {v['final_rel_diff_mean']:.4f}", flush=True)
            r["bytes_per_token"] = bytes_per_token_measured(path, 8, work, args.threads)
            b = r["bytes_per_token"]
            print(f"  bytes/token bf16 {b['bfloat16']['bytes_per_token']:,.0f} (formula {b['bfloat16']['formula']}) | fp8 "
                  f"{b['float8_e4m3fn']['bytes_per_token']:,.0f} (formula {b['float8_e4m3fn']['formula']}) | fp8/bf16 "
                  f"x{b['fp8_over_bf16']:.3f}", flush=True)
        if {"tiny", "tiny-kimi"} <= set(results):
            results["tiny_kimi_over_tiny"] = kimi_over_tiny(results["tiny"], results["tiny-kimi"])
            print("== tiny-kimi / tiny: " + ", ".join(f"{k} x{v:.2f}" for k, v in results["tiny_kimi_over_tiny"].items()),
                  flush=True)
    results["env"] = {"torch": torch.__version__, "threads": args.threads, "cpu_count": os.cpu_count(),
                      "cuda": torch.cuda.is_available(), "args": {k: str(v) for k, v in vars(args).items()}}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
