"""speculators 0.9.0's own EAGLE-3 training on CPU, for benchmarks/experiments/peer_speculators.py. Runs in speculators' virtual
environment (not eagle3lib's):

    .venv-speculators/bin/python benchmarks/experiments/peer_speculators_train.py prepare DATA
    .venv-speculators/bin/python benchmarks/experiments/peer_speculators_train.py train --time-budget 900 --threads 2 -- \\
        --verifier-name-or-path V --data-path DATA --save-path OUT ...   (any `speculators train` flag)

`prepare` turns DATA/rows.jsonl (input_ids, loss_mask per sample, written by peer_speculators.py beside
DATA/hidden_states/hs_{i}.safetensors) into the HF `datasets` folder speculators' ArrowDataset reads, and counts token
frequencies with speculators' own function.

`train` is `speculators train` (speculators.train.cli.main: its config, vocabulary mapping, Eagle3DraftModel, packing
sampler, collation, Trainer and checkpointer) with what CPU needs changed from outside the package (site-packages is
not edited; line numbers are speculators 0.9.0's):
  - the trainer moves the model to `get_local_rank()` = device 0, i.e. CUDA (train/trainer.py:221, 348, 533, 643): "cpu"
  - it picks autocast's device type "cuda" when no accelerator exists (trainer.py:227-228): "cpu"
  - its step timer calls torch.accelerator.synchronize, which raises on CPU (trainer.py:80, 92): plain timestamps
  - resuming reads to "cuda:0" (utils/util.py:17): "cpu"
  - provenance walks up from site-packages to the nearest git repository (train/utils.py:120), which here would be
    eagle3lib's, and writes its diff into the checkpoint: off
and, for a budget in wall time: training stops at `--time-budget` seconds (its epoch loop stops at max_steps,
trainer.py:601-605) and saves once at the end (the stock loop saves and validates after every epoch). Writes
OUT/summary.json: steps, training tokens (non-padding positions of the packed rows), seconds, tokens/s, checkpoint.
Flags the benchmark passes because CPU lacks what the defaults use: --loss-implementation eager (the fused loss is
Triton), --draft-attn-impl sdpa (FlexAttention has no backward on CPU), --num-workers 0, --on-missing raise (a missing
file would otherwise start a vLLM request), --mask-token-id 0 (unused by eagle3; otherwise read from a tokenizer).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def prepare(data: Path) -> None:
    from datasets import Dataset
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    rows = [json.loads(line) for line in (data / "rows.jsonl").read_text().splitlines()]
    ds = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows],
                            "seq_len": [len(r["input_ids"]) for r in rows]})
    ds.set_format(type="torch")  # ArrowDataset compares torch tensors with the hidden-state files' token ids
    ds.save_to_disk(str(data))
    save_token_frequency_distribution(ds, data / "token_freq.pt")
    print(f"prepared {len(rows)} samples in {data}")


def train(budget_s: float | None, threads: int | None, flags: list[str]) -> None:
    import speculators.train.checkpointer as ckpt
    import speculators.train.cli as cli
    import speculators.train.trainer as tr
    import speculators.train.utils as tutils
    from speculators.train.config import TrainConfig

    if threads:
        torch.set_num_threads(threads)

    class StepTimer(tr._StepTimer):
        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    done: dict = {}

    class CPUTrainer(tr.Trainer):
        def setup_trainer(self):
            self.device_type = "cpu"
            super().setup_trainer()

        def setup_model(self):
            super().setup_model()
            self.tokens = 0

            def count(module, _args, kwargs):  # non-padding positions of each training row
                if module.training and "document_ids" in kwargs:
                    self.tokens += int((kwargs["document_ids"] != -1).sum())

            self.model.register_forward_pre_hook(count, with_kwargs=True)

        def run_training(self):
            t0, stop = time.perf_counter(), False

            def on_step():
                nonlocal stop
                if budget_s is not None and time.perf_counter() - t0 >= budget_s:
                    stop = True
                    self.config = self.config._replace(max_steps=self.global_step)

            epoch = self.current_epoch
            for epoch in range(self.current_epoch, self.config.num_epochs):
                self.train_epoch(epoch, step_callback=on_step)
                if stop or (self.config.max_steps is not None and self.global_step >= self.config.max_steps):
                    break
            seconds = time.perf_counter() - t0
            self.maybe_save_checkpoint(epoch)
            done.update(steps=self.global_step, train_tokens=self.tokens, train_seconds=round(seconds, 2),
                        tokens_per_s=round(self.tokens / seconds, 1), epochs=epoch + 1,
                        checkpoint=str(Path(self.config.save_path) / str(epoch)))

    tr._StepTimer = StepTimer
    tr.get_local_rank = lambda: "cpu"
    ckpt.get_current_device = lambda: "cpu"
    tutils.find_repo_root = lambda _path: None
    cli.Trainer = CPUTrainer
    cfg = TrainConfig.resolve(flags)
    cli.main(cfg)
    save = Path(cfg.flatten()["save_path"])
    (save / "summary.json").write_text(json.dumps(done, indent=1) + "\n")
    print("SUMMARY " + json.dumps(done), flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("data", type=Path)
    t = sub.add_parser("train")
    t.add_argument("--time-budget", type=float, default=None, help="stop training after this many seconds")
    t.add_argument("--threads", type=int, default=None)
    a, rest = ap.parse_known_args(argv)
    if a.cmd == "prepare":
        prepare(a.data)
    else:
        train(a.time_budget, a.threads, rest[1:] if rest[:1] == ["--"] else rest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
