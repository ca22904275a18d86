"""Drafter training throughput, side by side in one run: packing vs one sample per step, the TTT attention layouts, and
the peer library speculators 0.9.0 (its Eagle3DraftModel forward + backward, eager/sdpa attention) on the same config
and the same packed batches.

    .venv/bin/python benchmarks/train_throughput.py                 # tiny (real store) + mid (hidden 1024, synthetic)
    .venv/bin/python benchmarks/train_throughput.py --configs tiny --steps 30

Needs `pip install --no-deps speculators==0.9.0` for the peer columns (skipped otherwise). speculators' eagle3 package
imports its training-data pipeline (`datasets`, `hs_connectors`), which this benchmark does not use: placeholder modules
stand in for those two imports so that the heavy `datasets`/pyarrow stack need not be installed.

Each variant trains a fresh drafter from the same initialisation recipe for `--steps` optimizer steps on the same rows
(AdamW, same constant learning rate, grad clip 0.5), after `--warmup` untimed steps; all variants advance in lockstep
(rotating order) so that load from other processes on a shared machine affects them alike. Reported:
tokens/s (real tokens, no padding), each library's own final training loss, and a common held-out evaluation of every
trained drafter with eagle3lib's vLLM-aligned TTT evaluator (loss and tau_est), since the two libraries align and
normalise their training losses differently.

Measured here (2 cores, quiet machine, --threads 2; tiny 20 steps, mid 3 steps):
  tiny  eagle3lib packed (doc) 6,692 tok/s | packed (sdpa mask) 3,881 | unpacked 2,107 | speculators sdpa 2,481, eager
        1,748  ->  2.70x speculators (sdpa), 3.18x unpacked; held-out loss 5.01 vs 5.43, tau_est 1.657 vs 1.664
  mid   eagle3lib packed 342 tok/s | unpacked 210 | speculators sdpa 228, eager 212  ->  1.50x; held-out loss
        1.5440 vs 1.5446
With other processes competing for the cores, use --threads 1 (2-thread OpenMP regions stall when a thread is
descheduled; measured 10x slowdowns): then tiny 2.61x, mid 1.46x.

Configs: "tiny" = the tiny verifier and a real hidden-state store of its corpus (built by tests/train_fixtures.py,
cached); "mid" = a synthetic verifier head (hidden 1024, 8 heads x 128, 2 KV heads, intermediate 2816, vocab 32000,
draft vocab 8192) with random hidden states of the same length distribution.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from eagle3lib.data.hidden_store import HiddenSample  # noqa: E402
from eagle3lib.data.packing import (  # noqa: E402
    MicroBatch,  # noqa: E402
    collate,
    pack_rows,
)
from eagle3lib.model.draft_vocab import build_draft_vocab, count_loss_tokens  # noqa: E402
from eagle3lib.model.drafter import (  # noqa: E402
    DrafterConfig,
    Eagle3Drafter,
    init_from_verifier,
)
from eagle3lib.model.ttt import TTTModel, counted_per_step, summarize  # noqa: E402
from eagle3lib.model.verifier import VerifierHead, load_verifier_head  # noqa: E402

# ------------------------------------------------------------------------------------------------------ data



def _optimizer_step(loss: torch.Tensor, model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    """The same update for every variant: backward, clip to 0.5 (the EAGLE-3 reference), AdamW step."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())

class SyntheticReader:
    """Random hidden states with given lengths; deterministic per index (the HiddenStateReader interface used here)."""

    def __init__(self, lengths: list[int], hidden: int, vocab: int, seed: int = 0):
        self.lengths = lengths
        self.hidden, self.vocab, self.seed = hidden, vocab, seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> HiddenSample:
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        T = self.lengths[i]
        ids = torch.randint(0, self.vocab // 4, (T,), generator=g)  # a skewed token distribution (draft vocab matters)
        return HiddenSample(f"s{i}", ids, torch.arange(T) >= T // 3,
                            torch.randn(T, 3, self.hidden, generator=g).bfloat16(),
                            torch.randn(T, self.hidden, generator=g).bfloat16())


@dataclass
class Setup:
    name: str
    reader: object
    head: VerifierHead
    verifier_dir: Path
    dcfg: DrafterConfig
    draft_ids: torch.Tensor
    packed_row_tokens: int
    lr: float


def tiny_setup() -> Setup:
    from train_fixtures import cached_store

    from eagle3lib.data.hidden_store import HiddenStateReader
    from eagle3lib.tiny.build import tiny_verifier_path

    vp = tiny_verifier_path()
    reader = HiddenStateReader(cached_store(vp, 400))
    head = load_verifier_head(vp)
    c = head.config
    vocab = build_draft_vocab(count_loss_tokens(reader, list(range(len(reader))), c.vocab_size), 512)
    dcfg = DrafterConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                         head_dim=c.head_dim, vocab_size=c.vocab_size, draft_vocab_size=512, rms_norm_eps=c.rms_norm_eps,
                         aux_layer_ids=[2, 4, 5], ttt_steps=3, verifier=str(vp))
    return Setup("tiny", reader, head, vp, dcfg, vocab.draft_ids, 1024, 3e-3)


def mid_setup(workdir: Path, lengths: list[int]) -> Setup:
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    H, V, VD = 1024, 32000, 8192
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
                      tie_word_embeddings=False)
    vdir = workdir / "mid-verifier"
    vdir.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(vdir)
    g = torch.Generator().manual_seed(1)
    save_file({"model.embed_tokens.weight": torch.randn(V, H, generator=g) * 0.02,
               "model.norm.weight": torch.ones(H),
               "lm_head.weight": torch.randn(V, H, generator=g) * 0.05}, str(vdir / "model.safetensors"))
    head = load_verifier_head(vdir)
    reader = SyntheticReader(lengths, H, V)
    counts = count_loss_tokens(reader, list(range(len(reader))), V)
    vocab = build_draft_vocab(counts, VD)
    dcfg = DrafterConfig(hidden_size=H, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=128, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[2, 4, 5], ttt_steps=3,
                         max_position_embeddings=4096, verifier=str(vdir))
    return Setup("mid", reader, head, vdir, dcfg, vocab.draft_ids, 1024, 1e-3)


# ------------------------------------------------------------------------------------------------ eagle3lib


def ours_model(s: Setup, attention: str) -> TTTModel:
    torch.manual_seed(0)
    d = Eagle3Drafter(s.dcfg)
    d.set_vocab(s.draft_ids)
    init_from_verifier(d, s.head)
    # out_of_vocab="keep": speculators trains every position on the renormalised draft-vocab target, so the same here
    return TTTModel(d, s.head.norm_weight, s.head.lm_head, s.head.rms_norm_eps, 3, 0.8, "keep", attention)


class OursRunner:
    def __init__(self, s: Setup, attention: str):
        self.m = ours_model(s, attention)
        self.opt = torch.optim.AdamW([p for p in self.m.parameters() if p.requires_grad], lr=s.lr, betas=(0.9, 0.95))

    def step(self, mb: MicroBatch) -> float:
        den = torch.tensor(counted_per_step(mb.loss_mask, mb.doc, 3), dtype=torch.float32)
        loss, _ = self.m(mb, den)
        return _optimizer_step(loss, self.m, self.opt)

    def drafter(self) -> Eagle3Drafter:
        return self.m.drafter


# ---------------------------------------------------------------------------------------------------- speculators


def import_speculators():
    for name, attrs in {"datasets": ["load_from_disk", "load_dataset", "Dataset"],
                        "hs_connectors": ["FileTransfer", "HiddenStatesTransfer"]}.items():
        if name not in sys.modules:
            try:
                __import__(name)
            except ImportError:
                mod = types.ModuleType(name)
                for a in attrs:
                    setattr(mod, a, type(a, (), {}))
                sys.modules[name] = mod
    import speculators
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel

    return speculators, Eagle3DraftModel, resolve_loss_config


def spec_batch(mb: MicroBatch) -> dict:
    """Our packed row -> speculators' packed row: per sample shift_batch (input x1.., hidden g0.., verifier y1..,
    loss l1.., positions 1..), concatenated with document ids. One row (their trainer's batch size)."""
    assert mb.ids.shape[0] == 1
    parts = {k: [] for k in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask", "position_ids",
                             "document_ids")}
    doc = mb.doc[0]
    for d in range(int(doc.max()) + 1):
        idx = (doc == d).nonzero().flatten()
        T = idx.numel()
        parts["input_ids"].append(mb.ids[0, idx[1:]])
        parts["hidden_states"].append(mb.aux[0, idx[:-1]].reshape(T - 1, -1))
        parts["verifier_last_hidden_states"].append(mb.final[0, idx[1:]])
        parts["loss_mask"].append(mb.loss_mask[0, idx[1:]])
        parts["position_ids"].append(torch.arange(1, T))
        parts["document_ids"].append(torch.full((T - 1,), d))
    return {k: torch.cat(v)[None] for k, v in parts.items()}


def spec_model(s: Setup, attn: str):
    from transformers import LlamaConfig

    _, Eagle3DraftModel, _ = import_speculators()
    c = s.dcfg
    tl = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
                     num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act="silu",
                     max_position_embeddings=c.max_position_embeddings, initializer_range=0.02,
                     rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[s.draft_ids] = True
    d2t = s.draft_ids - torch.arange(c.draft_vocab_size)
    torch.manual_seed(0)
    m = Eagle3DraftModel.from_training_args(tl, t2d=t2d, d2t=d2t, draft_vocab_size=c.draft_vocab_size,
                                            norm_before_residual=False, ttt_steps=3,
                                            verifier_name_or_path=str(s.verifier_dir), target_layer_ids=[2, 4, 5],
                                            draft_attn_impl=attn)
    m.lm_head.weight.requires_grad_(True)  # eagle3lib trains its lm_head (initialised from the verifier's rows) too
    return m.float().train()


class SpecRunner:
    def __init__(self, s: Setup, attn: str):
        _, _, resolve_loss_config = import_speculators()
        self.s = s
        self.m = spec_model(s, attn)
        self.loss_cfg = resolve_loss_config("kl_div", "eager")
        self.opt = torch.optim.AdamW([p for p in self.m.parameters() if p.requires_grad], lr=s.lr, betas=(0.9, 0.95))

    def step(self, mb: MicroBatch) -> float:
        b = spec_batch(mb)  # layout conversion is a few copies; included in the timing (their data pipeline does it)
        _, loss, _ = self.m(b["hidden_states"].float(), b["input_ids"], b["document_ids"], loss_mask=b["loss_mask"],
                            position_ids=b["position_ids"],
                            verifier_last_hidden_states=b["verifier_last_hidden_states"].float(), ttt_steps=3,
                            ttt_step_loss_decay=0.8, loss_config=self.loss_cfg)
        return _optimizer_step(loss, self.m, self.opt)

    def drafter(self) -> Eagle3Drafter:
        """Their weights carry our tensor names (fc, layers.0.*, norm, lm_head): load them into our drafter."""
        d = Eagle3Drafter(self.s.dcfg)
        d.set_vocab(self.s.draft_ids)
        init_from_verifier(d, self.s.head)
        theirs = {k: v for k, v in self.m.state_dict().items()
                  if not k.startswith(("verifier_", "embed_tokens", "d2t", "t2d"))}
        missing, unexpected = d.load_state_dict(theirs, strict=False)
        assert not unexpected and set(missing) <= {"d2t", "t2d"}, (missing, unexpected)
        return d


# ----------------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(s: Setup, drafter: Eagle3Drafter, val: list[MicroBatch]) -> dict:
    m = TTTModel(drafter, s.head.norm_weight, s.head.lm_head, s.head.rms_norm_eps, 3, 0.8, "mask", "doc").eval()
    stats = None
    for mb in val:
        _, st = m(mb, torch.ones(3))
        stats = st if stats is None else stats + st
    out = summarize(stats, 0.8)
    return {"val_loss": out["loss"], "val_tau_est": out["tau_est"]}


# ------------------------------------------------------------------------------------------------------------ main


def run_config(s: Setup, steps: int, warmup: int, peers: list[str], variants: list[str]) -> list[dict]:
    """All variants train in lockstep (one packed row's worth of tokens each, in rotating order), so load changes on a
    shared machine hit them alike; each variant's own step time is summed."""
    n = len(s.reader)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(n, generator=g).tolist()
    val_idx, train_idx = perm[:20], perm[20:]
    lengths = s.reader.lengths
    rows = pack_rows(train_idx, lengths, s.packed_row_tokens, True)
    need = steps + warmup
    if len(rows) < need:
        rows = rows * math.ceil(need / len(rows))
    rows = rows[:need]
    packed = [collate(s.reader, [r], s.packed_row_tokens) for r in rows]
    # unpacked: one sample per step, the samples of the same rows in order (same tokens, same order)
    singles = [[collate(s.reader, [[i]], s.packed_row_tokens) for i in r] for r in rows]
    val = [collate(s.reader, [r], s.packed_row_tokens) for r in pack_rows(val_idx, lengths, s.packed_row_tokens, True)]
    tokens_per_row = sum(b.n_tokens for b in packed[warmup:]) / steps
    print(f"\n== {s.name}: hidden {s.dcfg.hidden_size}, draft vocab {s.dcfg.draft_vocab_size}, {steps} timed steps of "
          f"one packed row (~{tokens_per_row:.0f} tokens, packed_row_tokens {s.packed_row_tokens}); unpacked: the same "
          "samples, "
          f"one per step ({sum(len(x) for x in singles[warmup:])} steps)", flush=True)
    runners: list[tuple[str, object, bool]] = [(f"eagle3lib packed, attention={v}", OursRunner(s, v), True)
                                                for v in variants]
    runners.append(("eagle3lib unpacked (1 sample/step)", OursRunner(s, "doc"), False))
    for attn in peers:
        try:
            runners.append((f"speculators 0.9.0 packed, attn={attn}", SpecRunner(s, attn), True))
        except ImportError as e:
            print(f"  speculators not installed ({e}); skipping the peer columns")
            break
    secs = [0.0] * len(runners)
    steps_run = [0] * len(runners)
    last = [[] for _ in runners]
    for i in range(need):
        order = list(range(len(runners)))
        order = order[i % len(order):] + order[: i % len(order)]
        for j in order:
            _, r, is_packed = runners[j]
            t = time.perf_counter()
            losses = [r.step(packed[i])] if is_packed else [r.step(mb) for mb in singles[i]]
            if i >= warmup:
                secs[j] += time.perf_counter() - t
                steps_run[j] += len(losses)
                last[j] = (last[j] + losses)[-3:]
        if (i + 1) % max(1, need // 5) == 0:
            print(f"  .. {i + 1}/{need} rows", flush=True)
    tokens = sum(b.n_tokens for b in packed[warmup:])
    results = []
    for j, (label, r, _) in enumerate(runners):
        ev = evaluate(s, r.drafter(), val)
        res = {"config": s.name, "variant": label, "steps": steps_run[j], "tokens": tokens,
               "tokens_per_s": tokens / secs[j], "final_train_loss": sum(last[j]) / len(last[j]), **ev}
        results.append(res)
        print(f"  {label:<36} {res['tokens_per_s']:>8.0f} tok/s   own loss {res['final_train_loss']:8.4f}   "
              f"held-out loss {res['val_loss']:8.4f}   tau_est {res['val_tau_est']:.3f}", flush=True)
    for r in results[1:]:
        r["first_row_speedup"] = results[0]["tokens_per_s"] / r["tokens_per_s"]
    print(f"  {results[0]['variant']} vs: " + ", ".join(
        f"{r['variant']} {r['first_row_speedup']:.2f}x" for r in results[1:]), flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny,mid")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: tiny 20, mid 3)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers", default="sdpa,eager", help="speculators attention implementations to run")
    ap.add_argument("--variants", default=None, help="eagle3lib attention layouts (default tiny: doc,sdpa; mid: doc)")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} threads")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = tiny_setup() if "tiny" in a.configs or "mid" in a.configs else None
        for name in a.configs.split(","):
            s = tiny if name == "tiny" else mid_setup(Path(tmp), list(tiny.reader.lengths))
            steps = a.steps or (20 if name == "tiny" else 3)
            variants = (a.variants or ("doc,sdpa" if name == "tiny" else "doc")).split(",")
            results += run_config(s, steps, a.warmup, [p for p in a.peers.split(",") if p], variants)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
