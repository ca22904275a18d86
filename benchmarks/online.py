"""Offline vs online hidden states (train.hidden_states), side by side in one run on the same samples and steps.

  .venv/bin/python benchmarks/online.py                  # offline, online-HF, hybrid-HF and online-vLLM, tiny verifier
  .venv/bin/python benchmarks/online.py --no-vllm        # without the vLLM server
  .venv/bin/python benchmarks/online.py --samples 400 --epochs 3 --json out.json

Each mode runs the extract stage and then the train stage as the pipeline does (in this process, one after the other):
  offline      extract.backend=hf stores bf16 states, training reads them
  online-hf    extract stores tokens only; the trainer's HF verifier computes each micro-batch's states
  hybrid-hf    as online-hf, the first epoch's states cached (budget: all of them) and read back in later epochs
  online-vllm  as online-hf with extract.backend=vllm: the trainer's own vLLM server, a bounded staging folder
Printed per mode: wall seconds of extract + train (setup included: model loads, server start), training tokens/s
(the train stage's own figure: steps only), seconds spent computing states, bytes written (the store's hidden states,
the hybrid cache), the final training loss; then each mode's end-to-end time and bytes over offline's. On 2 CPU cores
the verifier's forward and the drafter's step share the cores, so online's overlap cannot show; on a GPU box the
ratio to read is the verifier's extra passes (epochs - 1) against offline's store.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

MODES = ("offline", "online-hf", "hybrid-hf", "online-vllm")


def dataset(path: Path, n: int) -> Path:
    from eagle3lib.tiny import corpus

    corpus.write_conversations(path, n, 4242, "b")
    return path


def run_mode(mode: str, root: Path, data: Path, epochs: float) -> dict:
    from eagle3lib.config.stages import open_stage
    from eagle3lib.extraction.engine import extract
    from eagle3lib.training.loop import train

    hidden, backend = {"offline": ("offline", "hf"), "online-hf": ("online", "hf"), "hybrid-hf": ("hybrid", "hf"),
                       "online-vllm": ("online", "vllm")}[mode]
    over = {"extract.source": str(data), "extract.backend": backend, "extract.progress": False,
            "train.hidden_states": hidden, "train.cache_budget_gb": 10.0, "train.epochs": epochs,
            "train.log_every": 5, "train.nproc_per_node": 1, "train.packed_row_tokens": 1024, "train.batch_rows": 2}
    run = root / mode
    t0 = time.time()
    ectx = open_stage("extract", "tiny", run, over)
    extract(ectx.cfg, ectx.verifier, ectx.dir, None, hidden_states=hidden)
    t1 = time.time()
    m = train(open_stage("train", "tiny", run, over))
    t2 = time.time()
    f = m["figures"]
    ext = json.loads((run / "extract" / "manifest.json").read_text())["figures"]
    written = (ext["bytes"] if hidden == "offline" else 0) + f.get("states_cache_bytes", 0)
    return {"mode": mode, "extract_s": round(t1 - t0, 1), "train_s": round(t2 - t1, 1), "total_s": round(t2 - t0, 1),
            "train_tokens_per_s": f["tokens_per_s"], "states_verifier_s": f.get("states_verifier_s", 0.0),
            "states_setup_s": f.get("states_setup_s", 0.0), "bytes_written": written,
            "peak_staged_bytes": f.get("states_peak_staged_bytes", 0), "steps": f["steps"],
            "tokens": ext["tokens"], "loss": f.get("final_loss")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=240)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-online-"))
    try:
        data = dataset(root / "convs.jsonl", args.samples)
        rows = [run_mode(m, root, data, args.epochs) for m in MODES if not (args.no_vllm and m == "online-vllm")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = rows[0]
    print(f"\n{args.samples} samples ({base['tokens']:,} tokens), {args.epochs:g} epochs, {base['steps']} steps, tiny "
          "verifier, this machine:")
    head = (f"{'mode':<12} {'extract s':>9} {'train s':>8} {'total s':>8} {'train tok/s':>11} {'verifier s':>10} "
            f"{'bytes written':>14} {'total / offline':>15} {'bytes / offline':>15} {'final loss':>10}")
    print(head)
    for r in rows:
        print(f"{r['mode']:<12} {r['extract_s']:>9.1f} {r['train_s']:>8.1f} {r['total_s']:>8.1f} "
              f"{r['train_tokens_per_s']:>11,.0f} {r['states_verifier_s']:>10.1f} {r['bytes_written']:>14,} "
              f"{r['total_s'] / base['total_s']:>14.2f}x {r['bytes_written'] / max(1, base['bytes_written']):>14.3f}x "
              f"{r['loss'] or float('nan'):>10.4f}")
    if args.json:
        args.json.write_text(json.dumps({"samples": args.samples, "epochs": args.epochs, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
