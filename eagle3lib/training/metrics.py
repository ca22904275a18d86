"""Training metrics: RUN_DIR/train/metrics.jsonl, one JSON record per logging step (rank 0 only, reduced over ranks).

Record schema (the learning-curves notebook reads it):
  train: {"kind": "train", "step", "total_steps", "epoch" (float), "tokens_seen", "samples_seen", "lr", "loss",
          "loss_0".."loss_{K-1}", "full_acc_0".., "cond_acc_0".., "tau_est", "tokens_per_s", "samples_per_s",
          "grad_norm", "peak_mem_mb", "time" (unix), "elapsed_s"}
  val:   {"kind": "val", "step", "epoch", "time", "elapsed_s", "tokens", "samples", "loss", "loss_k", "full_acc_k",
          "cond_acc_k", "tau_est"}
  served: {"kind": "served", "step", "epoch", "prompts", "tau_greedy", "accept_rate_pos_greedy", "output_tokens_greedy",
          the same for "sampled" (train.served_eval_temperature > 0), "probe_s", "load_s", "time", "elapsed_s"}
          (train.served_eval_every: eagle3lib/training/served_probe.py)
The file is appended and flushed record by record, so a reader can follow it live; `read_metrics` ignores a torn last
line. On resume, records past the checkpoint's step are dropped first (atomically), so the file has no duplicates.
"""

from __future__ import annotations

import json
import math
import os
import resource
from pathlib import Path
from typing import Any

import torch

from eagle3lib.core.atomic import write_text_atomic


class MetricsError(ValueError):
    """A metrics.jsonl record that parses but cannot be one of ours (a hand edit, another tool's line)."""


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # torn last line of a killed writer
        if isinstance(rec, dict):
            step = rec.get("step", 0)
            if isinstance(step, bool) or not isinstance(step, int | float):
                raise MetricsError(f"{path}:{n}: step is {step!r}, not a number; fix or delete that line (a resumed run "
                                   "rewrites the records after its checkpoint)")
            out.append(rec)
    return out


class MetricsWriter:
    """Append-only JSONL writer; does nothing on ranks other than 0."""

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        """Drop records with step > `step` (a resumed run rewrites them); step < 0 empties the file."""
        if not self.enabled or not self.path.exists():
            return
        keep = [r for r in read_metrics(self.path) if r.get("step", -1) <= step] if step >= 0 else []
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
            os.fsync(f.fileno())


def ordered_record(rec: dict[str, Any], K: int) -> dict[str, Any]:
    """A train record with its keys in the schema's order (the file reads the same for every run)."""
    keys = ["kind", "step", "total_steps", "epoch", "tokens_seen", "samples_seen", "lr", "loss"]
    keys += [f"loss_{k}" for k in range(K)] + [f"full_acc_{k}" for k in range(K)] + [f"cond_acc_{k}" for k in range(K)]
    keys += ["tau_est", "tokens_per_s", "samples_per_s", "grad_norm", "peak_mem_mb", "time", "elapsed_s"]
    return {k: rec[k] for k in keys}


def console_line(rec: dict[str, Any], K: int) -> str:
    if rec["kind"] == "served":
        modes = [m for m in ("greedy", "sampled") if f"tau_{m}" in rec]
        taus = " ".join(f"{m} {rec[f'tau_{m}']:.3f}" for m in modes)
        return (f"[served] step {rec['step']:>5} epoch {rec['epoch']:.2f} | tau {taus} | {rec['prompts']} prompts | "
                f"probe {rec['probe_s']:.1f} s")
    if rec["kind"] == "val":
        accs = " ".join(f"{rec[f'full_acc_{k}']:.3f}" for k in range(K))
        return (f"[val]   step {rec['step']:>6} epoch {rec['epoch']:.2f} | loss {rec['loss']:.4f} | full_acc {accs} | "
                f"tau_est {rec['tau_est']:.3f}")
    accs = " ".join(f"{rec[f'full_acc_{k}']:.3f}" for k in range(K))
    return (f"[train] step {rec['step']:>6}/{rec['total_steps']} epoch {rec['epoch']:.2f} | loss {rec['loss']:.4f} | "
            f"full_acc {accs} | tau_est {rec['tau_est']:.3f} | lr {rec['lr']:.2e} | gnorm {rec['grad_norm']:.3f} | "
            f"{rec['tokens_per_s']:.0f} tok/s | {rec['peak_mem_mb']:.0f} MB")


def peak_mem_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
