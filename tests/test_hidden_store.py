# .venv/bin/python -m pytest -q tests/test_hidden_store.py
"""The hidden-state store: round trips (bf16 exact, fp8 within bounds), crash safety under kill -9, resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from eagle3lib.data.hidden_store import (
    HiddenSample,
    HiddenStateReader,
    HiddenStateWriter,
    StoreError,
    bytes_per_token,
    dequantize_fp8,
    quantize_fp8,
)

H = 32
META = {"verifier": "synthetic", "hidden_size": H, "vocab_size": 500, "num_layers": 8, "aux_layer_ids": [2, 4, 5]}

# Deterministic synthetic samples, shared with the killed subprocesses (sample i is a pure function of i).
SAMPLE_SRC = textwrap.dedent(
    """
    import torch
    from eagle3lib.data.hidden_store import HiddenSample

    def make_sample(i, H):
        g = torch.Generator().manual_seed(i)
        T = 3 + (i * 7) % 29
        return HiddenSample(f"s{i:04d}", torch.randint(0, 500, (T,), generator=g), torch.rand(T, generator=g) > 0.4,
                            (torch.randn(T, 3, H, generator=g) * (1 + i % 5)).bfloat16(),
                            (torch.randn(T, H, generator=g) * 20).bfloat16())
    """
)
_ns: dict = {}
exec(SAMPLE_SRC, _ns)
make_sample = _ns["make_sample"]


def _same(a: HiddenSample, b: HiddenSample) -> bool:
    return (a.sample_id == b.sample_id and torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
            and torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.final_hidden, b.final_hidden))


def test_bf16_round_trip_and_reader_api(tmp_path):
    samples = [make_sample(i, H) for i in range(11)]
    with HiddenStateWriter(tmp_path, META, samples_per_shard=4) as w:
        for s in samples:
            w.add(s)
    r = HiddenStateReader(tmp_path)
    assert len(r) == 11 and r.ids == [s.sample_id for s in samples] and r.lengths == [len(s) for s in samples]
    assert r.meta["dtype"] == "bfloat16" and r.meta["aux_layer_ids"] == [2, 4, 5] and r.meta["hidden_size"] == H
    assert len(r.shards) == 3  # 4 + 4 + 3
    for i in (10, 0, 5, -1):
        got = r[i]
        assert got.input_ids.dtype == torch.long and got.loss_mask.dtype == torch.bool
        assert got.aux_hidden.shape == (len(samples[i]), 3, H) and got.aux_hidden.dtype == torch.bfloat16
        assert _same(got, samples[i])
    with pytest.raises(IndexError):
        r[11]
    import pickle

    assert _same(pickle.loads(pickle.dumps(r))[3], samples[3])  # DataLoader workers get a copy without open handles
    # bytes on disk are what bytes_per_token promises, plus headers
    data = sum(len(s) for s in samples) * bytes_per_token(H)
    assert data <= sum(e["bytes"] for e in r.entries) <= data + 3 * 4096


def test_fp8_round_trip_error_and_size(tmp_path):
    samples = [make_sample(i, H) for i in range(6)]
    for dtype in ("bfloat16", "float8_e4m3fn"):
        with HiddenStateWriter(tmp_path / dtype, META, samples_per_shard=3, dtype=dtype) as w:
            for s in samples:
                w.add(s)
    r8 = HiddenStateReader(tmp_path / "float8_e4m3fn")
    assert r8.meta["dtype"] == "float8_e4m3fn"
    for i, s in enumerate(samples):
        got = r8[i]
        assert got.aux_hidden.dtype == torch.bfloat16 and torch.equal(got.input_ids, s.input_ids)
        for a, b in ((got.aux_hidden, s.aux_hidden), (got.final_hidden, s.final_hidden)):
            a, b = a.float(), b.float()
            amax = b.abs().amax(dim=-1, keepdim=True)
            # e4m3: 3 mantissa bits -> rounding error <= 2^-4 relative; plus the bf16 output rounding (2^-8)
            assert ((a - b).abs() <= amax * (2**-4 + 2**-8) + 1e-6).all()
            rel = (a - b).norm() / b.norm()
            assert rel < 0.04, rel
    size = {d: sum(e["bytes"] for e in HiddenStateReader(tmp_path / d).entries) for d in ("bfloat16", "float8_e4m3fn")}
    assert size["float8_e4m3fn"] < 0.65 * size["bfloat16"]  # H=32: scales and headers weigh more than at scale
    assert bytes_per_token(7168, "float8_e4m3fn") / bytes_per_token(7168) < 0.501  # Kimi-K2.5: half


def test_fp8_quantiser_edge_cases():
    x = torch.zeros(4, 16)
    x[1] = 1e-3
    x[2, 3] = -500.0
    q, s = quantize_fp8(x)
    y = dequantize_fp8(q, s, torch.float32)
    assert torch.equal(y[0], x[0])  # an all-zero token stays zero (no division by zero)
    assert torch.allclose(y, x, rtol=2**-4, atol=0)


def test_writer_refuses_duplicates_bad_shapes_and_other_meta(tmp_path):
    w = HiddenStateWriter(tmp_path, META, samples_per_shard=2)
    w.add(make_sample(0, H))
    with pytest.raises(StoreError, match="already in the store"):
        w.add(make_sample(0, H))
    bad = make_sample(1, H)
    bad.final_hidden = bad.final_hidden[:, :-1]
    with pytest.raises(StoreError, match="final_hidden has shape"):
        w.add(bad)
    w.close()
    with pytest.raises(StoreError, match="aux_layer_ids"):
        HiddenStateWriter(tmp_path, {**META, "aux_layer_ids": [1, 4, 5]})
    with pytest.raises(StoreError, match="dtype"):
        HiddenStateWriter(tmp_path, META, dtype="float8_e4m3fn")
    with pytest.raises(StoreError, match="no hidden-state store"):
        HiddenStateReader(tmp_path / "nothing")


def _writer_script(store: Path, n: int, spp: int, sabotage: str) -> str:
    """A subprocess that writes samples 0..n-1 (skipping stored ones) and, depending on `sabotage`, dies mid-way."""
    return SAMPLE_SRC + textwrap.dedent(
        f"""
        import os, signal, sys, time
        import eagle3lib.data.hidden_store as hs
        sabotage = {sabotage!r}
        real_replace = hs.os.replace
        calls = []
        def replace(src, dst):
            if str(dst).endswith(".safetensors"):
                calls.append(dst)
            if sabotage == "before_rename" and len(calls) == 3:
                os.kill(os.getpid(), signal.SIGKILL)  # tmp shard fully written, never renamed
            real_replace(src, dst)
            if sabotage == "before_index" and len(calls) == 3:
                os.kill(os.getpid(), signal.SIGKILL)  # shard renamed, not yet in index.jsonl
        hs.os.replace = replace
        w = hs.HiddenStateWriter({str(store)!r}, {META!r}, samples_per_shard={spp})
        print("resumed", len(w.done_ids), flush=True)
        for i in range({n}):
            s = make_sample(i, {H})
            if s.sample_id in w.done_ids:
                continue
            w.add(s)
            if sabotage == "slow":
                time.sleep(0.002)
        w.close()
        print("finished", flush=True)
        """
    )


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def _check_complete(store: Path, n: int) -> None:
    r = HiddenStateReader(store)
    assert sorted(r.ids) == [f"s{i:04d}" for i in range(n)]  # every sample exactly once
    by_id = {sid: i for i, sid in enumerate(r.ids)}
    for i in range(n):
        assert _same(r[by_id[f"s{i:04d}"]], make_sample(i, H))
    assert not [p for p in (store / "shards").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("sabotage", ["before_rename", "before_index"])
def test_killed_writer_leaves_only_complete_shards_and_resumes(tmp_path, sabotage):
    n, spp = 20, 3
    first = _run(_writer_script(tmp_path, n, spp, sabotage))
    assert first.returncode == -signal.SIGKILL, first.stderr
    r = HiddenStateReader(tmp_path)  # what a trainer would see right after the crash
    expect_shards = 2 if sabotage == "before_rename" else 3
    assert len(r.shards) == expect_shards and len(r) == expect_shards * spp
    for i in range(len(r)):
        assert _same(r[i], make_sample(i, H))
    if sabotage == "before_rename":
        assert [p for p in (tmp_path / "shards").iterdir() if p.name.endswith(".tmp")]  # the torn write is there, unread
    second = _run(_writer_script(tmp_path, n, spp, "none"))
    assert second.returncode == 0, second.stderr
    assert f"resumed {expect_shards * spp}" in second.stdout
    _check_complete(tmp_path, n)


def test_kill_at_a_random_moment_then_resume(tmp_path):
    """A real kill -9 while the writer is busy (mid-shard most likely), then a resume: nothing lost, nothing twice."""
    n = 250
    proc = subprocess.Popen([sys.executable, "-c", _writer_script(tmp_path, n, 7, "slow")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    index = tmp_path / "index.jsonl"
    while time.time() < deadline:
        if index.exists() and index.read_text().count("\n") >= 5:
            break
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = len(HiddenStateReader(tmp_path))
    assert 0 < killed < n
    second = _run(_writer_script(tmp_path, n, 7, "none"))
    assert second.returncode == 0, second.stderr
    _check_complete(tmp_path, n)


def test_rank_writers_share_one_store_and_the_merge_lists_each_shard_once(tmp_path):
    """Two ranks writing at the same time (interleaved here) never share a file; a reader sees the union at any
    moment; repair_store merges the rank indexes into index.jsonl; a later writer skips every rank's samples."""
    from eagle3lib.data.store_index import repair_store

    samples = [make_sample(i, H) for i in range(14)]
    HiddenStateWriter(tmp_path, META, samples_per_shard=3).close()  # rank 0's lone writer creates the store
    w0 = HiddenStateWriter(tmp_path, META, samples_per_shard=3, rank=0)
    w1 = HiddenStateWriter(tmp_path, META, samples_per_shard=3, rank=1)
    for i, s in enumerate(samples):
        (w0 if i % 2 == 0 else w1).add(s)
    w0.close()
    w1.close()
    names = sorted(p.name for p in (tmp_path / "shards").iterdir())
    assert names == [f"shard-r0000{r}-0000{k}.safetensors" for r in (0, 1) for k in (0, 1, 2)]
    assert sorted(p.name for p in tmp_path.glob("index*.jsonl")) == ["index-r00000.jsonl", "index-r00001.jsonl"]
    before = HiddenStateReader(tmp_path)  # unmerged: the union of the rank indexes
    assert sorted(before.ids) == sorted(s.sample_id for s in samples)
    (tmp_path / "index-r00001.jsonl").open("a").write('{"shard": "shard-r0000')  # a torn line of a killed rank
    assert repair_store(tmp_path) == []
    assert sorted(p.name for p in tmp_path.glob("index*.jsonl")) == ["index.jsonl"]
    assert len((tmp_path / "index.jsonl").read_text().splitlines()) == 6
    r = HiddenStateReader(tmp_path)
    assert r.ids == before.ids and all(_same(r[r.ids.index(s.sample_id)], s) for s in samples)
    with pytest.raises(StoreError, match="rank 0 creates"):
        HiddenStateWriter(tmp_path / "new", META, rank=1)
    w = HiddenStateWriter(tmp_path, META, samples_per_shard=3, rank=3)  # another world size: sees every sample done
    assert w.done_ids == {s.sample_id for s in samples}
