# .venv/bin/python -m pytest -q tests/test_golden_loss.py
# Regenerate the golden file after an intended change to the training numerics:
#   .venv/bin/python tests/test_golden_loss.py --update
"""Golden losses (torchtitan style): the first 20 training steps of a tiny drafter, fp32, one thread, on a synthetic
verifier head and hidden-state store built here from fixed seeds, must match tests/golden/train_losses.json. A change
that alters training numerics (loss, TTT alignment, schedule, init, packing order) fails loudly; refactors do not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).parent / "golden" / "train_losses.json"
STEPS = 20
H, V, L, T = 64, 256, 8, 48  # hidden, vocabulary, verifier layers, tokens per sample
# Tolerance: float summation order may differ between CPU kernels (AVX2 vs AVX-512 paths) by ~1e-7 per step;
# 20 steps amplify it to well under 1e-5 relative, while any change to the numerics moves losses by > 1e-3.
RTOL = 1e-4
FIELDS = ("loss", "loss_0", "loss_1", "loss_2", "tau_est", "grad_norm")


def _verifier(path: Path) -> Path:
    """A verifier as the train stage reads one: config.json, and the three tensors the drafter borrows."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    path.mkdir(parents=True, exist_ok=True)
    Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=L, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                tie_word_embeddings=False).save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    save_file({"model.embed_tokens.weight": torch.randn(V, H, generator=g) * 0.5,
               "model.norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
               "lm_head.weight": torch.randn(V, H, generator=g) * 0.3}, str(path / "model.safetensors"))
    return path


def _store(path: Path, n: int = 64) -> Path:
    """Hidden states with structure the drafter can learn: the final state follows the aux states and the token."""
    from eagle3lib.data.hidden_store import HiddenSample, HiddenStateWriter

    g = torch.Generator().manual_seed(2)
    mix = torch.randn(3 * H, H, generator=g) / (3 * H) ** 0.5
    emb = torch.randn(V, H, generator=g)
    meta = {"verifier": "golden", "hidden_size": H, "vocab_size": V, "num_layers": L, "aux_layer_ids": [2, 4, 5]}
    with HiddenStateWriter(path, meta, samples_per_shard=32) as w:
        for i in range(n):
            ids = torch.randint(0, V, (T,), generator=g)
            aux = torch.randn(T, 3, H, generator=g)
            final = aux.reshape(T, 3 * H) @ mix + 0.5 * emb[ids]
            w.add(HiddenSample(f"g{i:03d}", ids, torch.arange(T) >= 8, aux.bfloat16(), final.bfloat16()))
    return path


def golden_run(tmp: Path) -> list[dict[str, float]]:
    from eagle3lib.config.stages import open_stage
    from eagle3lib.training.loop import train
    from eagle3lib.training.metrics import read_metrics

    verifier = _verifier(tmp / "verifier")
    run = tmp / "run"
    run.mkdir()
    _store(run / "extract")
    overrides = {"verifier.model": str(verifier), "train.max_steps": STEPS, "train.log_every": 1,
                 "train.ckpt_every": 1000, "train.nproc_per_node": 1, "train.threads": 1, "train.device": "cpu",
                 "train.precision": "float32", "train.draft_vocab_size": 128, "train.packed_row_tokens": 128,
                 "train.batch_rows": 2, "train.warmup_steps": 5, "train.lr": 3e-3, "train.val_fraction": 0.0,
                 "train.seed": 0}
    train(open_stage("train", "tiny", run, overrides))
    recs = [r for r in read_metrics(run / "train" / "metrics.jsonl") if r["kind"] == "train"]
    return [{"step": r["step"], **{f: r[f] for f in FIELDS}} for r in recs]


def test_first_20_steps_match_the_golden_losses(tmp_path, one_thread):
    got = golden_run(tmp_path)
    want = json.loads(GOLDEN.read_text())["records"]
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want, strict=True):
        for f in FIELDS:
            assert g[f] == pytest.approx(w[f], rel=RTOL, abs=1e-6), (
                f"step {g['step']} {f}: {g[f]!r} vs golden {w[f]!r}; if the change to the training numerics is "
                "intended, regenerate: .venv/bin/python tests/test_golden_loss.py --update")
    first, last = (sum(r["loss"] for r in part) / len(part) for part in (got[:5], got[-5:]))
    assert last < 0.85 * first  # and it learns


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        records = golden_run(Path(d))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"what": "tests/test_golden_loss.py: first 20 steps, fp32, one thread",
                                  "torch": torch.__version__, "records": records}, indent=1) + "\n")
    print(f"wrote {GOLDEN}: loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}")
