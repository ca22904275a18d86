# Run: .venv/bin/python -m pytest tests/test_kernels_launch.py -q
"""The launch selectors never see the sequence length, and the backend dispatcher picks and logs the right backend.

No kernel runs here: the entry points are called on meta tensors with the autograd Functions replaced by recorders, so
what is checked is the config the real call path would launch with.
"""

from __future__ import annotations

import inspect
import logging
import random

import pytest
import torch
from eagle3lib.kernels import api, draft_loss, launch, rmsnorm
from eagle3lib.kernels.launch import SMEM_LIMITS, draft_loss_config, rmsnorm_config

from eagle3lib import kernels

SEQ_LENS = [1, 7, 33, 2048, 8192, 16384, 32768]


def test_selectors_do_not_take_sequence_length() -> None:
    assert list(inspect.signature(rmsnorm_config).parameters) == ["hidden", "dtype", "smem_budget"]
    assert list(inspect.signature(draft_loss_config).parameters) == ["hidden", "draft_vocab", "dtype", "smem_budget"]


@pytest.mark.parametrize("seed", range(5))
def test_entry_points_choose_the_same_config_for_every_row_count(monkeypatch, seed: int) -> None:
    rng = random.Random(seed)
    hidden, vocab = rng.randint(1, 16384), rng.randint(1, 64000)
    dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
    seen_rms, seen_loss = set(), set()

    def record_rms(x, weight, eps, config):
        seen_rms.add(config)
        return x

    def record_loss(h, weight, target, mask, kl, config):
        seen_loss.add(config)
        return torch.empty(h.shape[0], device=h.device), torch.empty(h.shape[0], dtype=torch.long, device=h.device)

    monkeypatch.setattr(rmsnorm.RMSNormFunction, "apply", record_rms)
    monkeypatch.setattr(draft_loss.DraftLossFunction, "apply", record_loss)
    weight = torch.empty(hidden, dtype=dtype, device="meta")
    lm_head = torch.empty(vocab, hidden, dtype=dtype, device="meta")
    for n in SEQ_LENS:
        rmsnorm.rms_norm(torch.empty(n, hidden, dtype=dtype, device="meta"), weight)
        rmsnorm.rms_norm(torch.empty(1, n, hidden, dtype=dtype, device="meta"), weight)
        h = torch.empty(n, hidden, dtype=dtype, device="meta")
        draft_loss.draft_kl_loss(h, lm_head, torch.empty(n, vocab, dtype=dtype, device="meta"))
    assert len(seen_rms) == 1 and len(seen_loss) == 1


def test_configs_are_small_frozen_and_within_every_budget() -> None:
    for budget in set(SMEM_LIMITS.values()):
        for hidden in (64, 96, 200, 2048, 4096, 5120, 7168, 8192, 16384):
            c = rmsnorm_config(hidden, torch.bfloat16, budget)
            assert c.block_hidden & (c.block_hidden - 1) == 0 and c.block_rows >= 1
            assert launch.smem_estimate(c.block_rows * c.block_hidden, 4, 2, c.num_stages) <= budget
            with pytest.raises(AttributeError):
                c.block_hidden = 1  # type: ignore[misc]
        d = draft_loss_config(4096, 32000, torch.bfloat16, budget)
        assert d.block_vocab == 4096 and d.chunk_rows * 32000 * 2 <= 256 << 20
    assert rmsnorm_config(7168, "bfloat16", 101_376).block_hidden == 1024  # 7 full chunks, no masked lanes


def test_a_tiny_budget_shrinks_the_tile_instead_of_failing() -> None:
    big = rmsnorm_config(4096, torch.float32, 232_448)
    fewer_stages = rmsnorm_config(4096, torch.float32, 20_000)  # pipelining goes first ...
    assert fewer_stages.num_stages == 1 and fewer_stages.block_hidden == big.block_hidden
    small = rmsnorm_config(4096, torch.float32, 10_000)  # ... then the tile halves
    assert small.block_rows * small.block_hidden < big.block_rows * big.block_hidden
    assert launch.smem_estimate(small.block_rows * small.block_hidden, 4, 2, small.num_stages) <= 10_000


def test_budget_without_gpu_is_the_smallest_supported() -> None:
    assert launch.smem_budget("cpu") == launch.smem_budget(None) == 101_376 == SMEM_LIMITS[(12, 0)]
    assert SMEM_LIMITS[(9, 0)] == SMEM_LIMITS[(10, 0)] == 232_448 and SMEM_LIMITS[(8, 0)] == 166_912


def test_select_backend_on_cpu_and_logging(monkeypatch, caplog) -> None:
    api._select.cache_clear()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with caplog.at_level(logging.INFO, logger="eagle3lib.kernels"):
        assert kernels.select_backend("cpu") == "torch"
    assert any("torch" in r.getMessage() and r.name == "eagle3lib.kernels" for r in caplog.records)
    assert kernels.select_backend(torch.device("cpu"), prefer="torch") == "torch"
    with pytest.raises(RuntimeError, match="unavailable"):
        kernels.select_backend("cpu", prefer="triton")
    with pytest.raises(ValueError):
        kernels.select_backend("cpu", prefer="fast")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    api._select.cache_clear()
    assert kernels.select_backend("cpu") == "torch"  # the interpreter is for tests, never chosen automatically
    assert kernels.select_backend("cpu", prefer="triton") == "triton"
    api._select.cache_clear()


def test_dispatchers_use_the_torch_reference_on_cpu() -> None:
    api._select.cache_clear()
    x = torch.randn(3, 5, 8)
    w = torch.rand(8)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), rmsnorm.rms_norm_reference(x, w, 1e-6))
    h, lm_head, target = torch.randn(6, 8), torch.randn(11, 8), torch.randn(6, 11)
    mask = torch.tensor([1, 1, 0, 1, 0, 1])
    out = kernels.draft_kl_loss(h, lm_head, target, mask, reduction="mean")
    ref = draft_loss.draft_kl_loss_reference(h, lm_head, target, mask, reduction="none")
    torch.testing.assert_close(out.loss, ref.loss.sum() / 4)
    assert out.argmax.tolist() == (h @ lm_head.t()).argmax(-1).tolist()
    ce = kernels.draft_kl_loss(h, lm_head, target, mask, kind="ce", reduction="none").loss
    entropy = -(torch.softmax(target, -1) * torch.log_softmax(target, -1)).sum(-1)
    torch.testing.assert_close(ce, ref.loss + entropy * mask)  # ce = kl + H(p) on live rows
