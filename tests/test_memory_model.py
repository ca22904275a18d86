# .venv/bin/python -m pytest -q tests/test_memory_model.py
"""The memory model of a training step (eagle3lib/training/memory_model.py): its per-token activation bytes against
what the autograd graph really keeps, for drafter shapes it was not fitted on; the longest row that fits; a profile
whose rows cannot fit is refused by the train stage before training, naming the keys and the length that fits.
(Peak memory against measurement: benchmarks/long_context.py prints the ratio for every run.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from train_fixtures import fake_store

from eagle3lib.config.stages import open_stage
from eagle3lib.data.packing import MicroBatch
from eagle3lib.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3lib.model.ttt import TTTModel
from eagle3lib.training.loop import train
from eagle3lib.training.memory_model import (
    GIB,
    HEADROOM,
    DoesNotFit,
    DrafterShape,
    check_fits,
    longest_that_fits,
    once_bytes,
    per_step_bytes,
    run_bytes,
    target_logits_bytes,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from memory_table import profile_plan  # noqa: E402  (the docs table's script)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def ttt_and_batch(cfg: DrafterConfig, L: int = 192, target_logits: str = "full") -> tuple[TTTModel, MicroBatch]:
    """A TTT module of this drafter shape and one packed row of one L-token sample (a 1/16 prompt, then the answer)."""
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    d.reset_parameters(std=0.02)
    d.set_vocab(torch.arange(cfg.draft_vocab_size))
    m = TTTModel(d, torch.ones(cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size), 1e-6, cfg.ttt_steps,
                 0.8, "mask", "flash", target_logits=target_logits)
    pos = torch.arange(L)
    mb = MicroBatch(torch.randn(1, L, 3, cfg.hidden_size), torch.randn(1, L, cfg.hidden_size),
                    torch.randint(0, cfg.vocab_size, (1, L)), (pos >= L // 16)[None], pos[None],
                    torch.zeros(1, L, dtype=torch.long), L, 1)
    return m, mb


def is_weight_copy(t: torch.Tensor) -> bool:
    """autocast's bf16 copy of a parameter (saved transposed): the memory model counts it with the parameters."""
    g = t.grad_fn
    while g is not None and g.name() in ("TBackward0", "ViewBackward0"):
        g = g.next_functions[0][0]
    return g is not None and g.name() == "ToCopyBackward0" and type(g.next_functions[0][0]).__name__ == "AccumulateGrad"


def kept_bytes_per_token(cfg: DrafterConfig, L: int = 192, bf16: bool = False) -> float:
    """Bytes of the tensors autograd keeps for the backward of one TTT forward + loss (parameters, autocast's copies
    of them and inputs aside), in fp32 or under torch.autocast("cpu", dtype=torch.bfloat16)."""
    m, mb = ttt_and_batch(cfg, L)
    skip = {t.untyped_storage().data_ptr() for t in [*m.parameters(), *m.buffers(), mb.aux, mb.final]}
    kept: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip and not is_weight_copy(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(mb, torch.full((cfg.ttt_steps,), float(L)))
    return sum(kept.values()) / L


@pytest.mark.parametrize("shape", [dict(hidden_size=80, intermediate_size=200, num_attention_heads=6,
                                        num_key_value_heads=3, head_dim=24, draft_vocab_size=300, ttt_steps=3),
                                   dict(hidden_size=48, intermediate_size=96, num_attention_heads=2,
                                        num_key_value_heads=2, head_dim=40, draft_vocab_size=100, ttt_steps=6)])
def test_activation_bytes_match_the_autograd_graph(shape):
    cfg = DrafterConfig(vocab_size=512, max_position_embeddings=512, **shape)
    s = DrafterShape.of(cfg)
    K = cfg.ttt_steps
    model = K * per_step_bytes(s) + once_bytes(s)
    assert model == pytest.approx(kept_bytes_per_token(cfg), rel=0.03)


@pytest.mark.parametrize("shape", [dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=64, draft_vocab_size=300, ttt_steps=3),
                                   dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                                        num_key_value_heads=2, head_dim=64, draft_vocab_size=300, ttt_steps=3)])
def test_bf16_activation_bytes_match_the_autograd_graph(shape):
    """Under bf16 autocast the norms keep fp32 internals: the model's BF16 coefficients (fitted on other shapes), not
    the fp32 ones halved (1.32x and 1.33x too little for these two shapes)."""
    cfg = DrafterConfig(vocab_size=512, max_position_embeddings=512, **shape)
    s = DrafterShape.of(cfg)
    model = cfg.ttt_steps * per_step_bytes(s, dtype_bytes=2) + once_bytes(s, dtype_bytes=2)
    assert model == pytest.approx(kept_bytes_per_token(cfg, bf16=True), rel=0.03)


@pytest.mark.parametrize("target_logits", ["full", "draft"])
def test_target_logits_and_heads_are_counted(target_logits):
    """The target logits a step holds (TTTModel.targets' output: draft-vocabulary rows, fp32, with either setting) and
    the verifier's frozen head and embedding (+ the head's draft rows with target_logits draft) are the model's."""
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=32, vocab_size=700, draft_vocab_size=100, max_position_embeddings=512, ttt_steps=2)
    m, mb = ttt_and_batch(cfg, 96, target_logits)
    held = []
    targets = m.targets
    m.targets = lambda final: held.append(targets(final)) or held[-1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(mb, torch.full((cfg.ttt_steps,), 96.0))
    (logits, argmax), = held
    s = DrafterShape.of(cfg)
    assert logits.dtype == torch.float32 and logits.shape[1] == cfg.draft_vocab_size
    assert logits.nbytes + argmax.nbytes == len(logits) * target_logits_bytes(s)
    terms = run_bytes(s, 2, 96, 96, target_logits=target_logits)
    assert terms["target_logits"] == 96 * target_logits_bytes(s)  # every token of the row: an upper bound
    heads = [m.target_head_full, m.drafter.embed_tokens] + ([m.target_head_draft] if target_logits == "draft" else [])
    assert terms["verifier_head"] == sum(t.nbytes for t in heads)


def test_parameter_count_matches_the_module():
    cfg = DrafterConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=300, draft_vocab_size=50)
    d = Eagle3Drafter(cfg)
    assert DrafterShape.of(cfg).parameters() == sum(p.numel() for p in d.parameters() if p.requires_grad)


KIMI = DrafterShape(hidden=7168, intermediate=18432, heads=64, kv_heads=8, qk_dim=128, v_dim=128, draft_vocab=32000,
                    vocab=163840)


def test_longest_that_fits_is_the_boundary():
    mem = 96e9
    n = longest_that_fits(KIMI, 5, mem, dtype_bytes=2)
    assert n > 0
    assert run_bytes(KIMI, 5, n, n, dtype_bytes=2)["total"] <= mem * HEADROOM
    assert run_bytes(KIMI, 5, n + 1024, n + 1024, dtype_bytes=2)["total"] > mem * HEADROOM
    # memory linear in the row with flash: twice the device, more than twice the row (the fixed terms amortise)
    assert longest_that_fits(KIMI, 5, 2 * mem, dtype_bytes=2) > 2 * n
    with pytest.raises(DoesNotFit, match=rf"packed_row_tokens and extract.max_sample_tokens to at most {n}\b"):
        check_fits(KIMI, 5, 4 * n, 4 * n, mem, layout="auto", dtype_bytes=2, rows=1, store_dtype_bytes=2, shards=1,
                   where="x")


def test_a_row_that_cannot_fit_is_refused_before_training(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "extract").symlink_to(fake_store(tmp_path / "store", 24), target_is_directory=True)
    ctx = open_stage("train", "tiny", run, {"train.packed_row_tokens": 4096, "train.memory_gb": 0.1,
                                            "train.epochs": 1, "train.val_fraction": 0.0})
    with pytest.raises(DoesNotFit, match=r"packed row of 4096 tokens .* more than 90% of the 0\.1 GiB .* at most \d+"):
        train(ctx)
    assert not (run / "train" / "checkpoints").exists() and not (run / "train" / "metrics.jsonl").exists()
    assert run_bytes(DrafterShape(192, 512, 3, 1, 64, 64, 512, 1472), 3, 4096, 40)["total"] > 0.1 * GIB * HEADROOM


def test_the_kimi_profile_row_fits_a_96_gb_card():
    """params/kimi-k2.5.yaml's packed_row_tokens against the model (bf16, DDP with gradient_as_bucket_view, the target
    logits counted): it fits 90% of a 96 GB card (96 GiB; CUDA reports ~95.6 for the RTX PRO 6000), and is the
    longest row that does (`.venv/bin/python benchmarks/memory_table.py kimi-k2.5` prints the table)."""
    cfg, s, plan = profile_plan("kimi-k2.5")
    assert plan["dtype_bytes"] == 2 and plan["shards"] == 1
    for mem in (96 * GIB, 95.6 * GIB):
        assert run_bytes(s, cfg.ttt_steps, cfg.packed_row_tokens, cfg.packed_row_tokens, **plan)["total"] <= mem * HEADROOM
        assert longest_that_fits(s, cfg.ttt_steps, mem, **plan) == cfg.packed_row_tokens


if __name__ == "__main__":  # fit memory_model.BF16 again: least squares over 60 drafter shapes (hidden 128-448, K 2-6)
    import random

    import numpy as np

    torch.set_num_threads(1)
    random.seed(5)
    A, y = [], []
    for _ in range(60):
        kv = random.choice([1, 2, 4])
        cfg = DrafterConfig(vocab_size=600, max_position_embeddings=512, num_key_value_heads=kv,
                            hidden_size=random.choice([128, 192, 320, 384, 448]),
                            intermediate_size=random.choice([96, 200, 384, 640, 1024]),
                            num_attention_heads=kv * random.choice([1, 2, 4]), head_dim=random.choice([16, 32, 48, 64]),
                            draft_vocab_size=random.choice([64, 200, 500]), ttt_steps=random.choice([2, 3, 4, 5, 6]))
        s, K = DrafterShape.of(cfg), cfg.ttt_steps
        A.append([K * s.hidden, K * s.intermediate, K * s.heads * s.qk_dim, K * s.kv_heads * s.qk_dim,
                  K * s.draft_vocab, s.hidden, s.draft_vocab])  # the fields of memory_model.Activations, in order
        y.append(kept_bytes_per_token(cfg, bf16=True))
    c = np.linalg.lstsq(np.array(A), np.array(y), rcond=None)[0].round(1)
    print(f"BF16 = Activations({', '.join(f'{v:g}' for v in c)}); worst error {max(abs(np.array(A) @ c / y - 1)):.1%}")
