# .venv/bin/python -m pytest -q tests/test_memory_model.py
"""The memory model of a training step (eagle3lib/training/memory_model.py): its per-token activation bytes against
what the autograd graph really keeps, for drafter shapes it was not fitted on; the longest row that fits; a profile
whose rows cannot fit is refused by the train stage before training, naming the keys and the length that fits.
(Peak memory against measurement: benchmarks/long_context.py prints the ratio for every run.)"""

from __future__ import annotations

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
    per_step_bytes,
    run_bytes,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def kept_bytes_per_token(cfg: DrafterConfig, L: int = 192) -> float:
    """Bytes of the tensors autograd keeps for the backward of one TTT forward + loss (parameters and inputs aside)."""
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    d.reset_parameters(std=0.02)
    d.set_vocab(torch.arange(cfg.draft_vocab_size))
    m = TTTModel(d, torch.ones(cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size), 1e-6, cfg.ttt_steps,
                 0.8, "mask", "flash")
    pos = torch.arange(L)
    mb = MicroBatch(torch.randn(1, L, 3, cfg.hidden_size), torch.randn(1, L, cfg.hidden_size),
                    torch.randint(0, cfg.vocab_size, (1, L)), (pos >= L // 16)[None], pos[None],
                    torch.zeros(1, L, dtype=torch.long), L, 1)
    skip = {t.untyped_storage().data_ptr() for t in [*m.parameters(), *m.buffers(), mb.aux, mb.final]}
    kept: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
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
    model = K * per_step_bytes(s) - 8.8 * s.hidden - 0.6 * s.draft_vocab
    assert model == pytest.approx(kept_bytes_per_token(cfg), rel=0.03)


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
