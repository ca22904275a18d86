# .venv/bin/python -m pytest -q tests/test_online.py
"""Online and hybrid hidden states (train.hidden_states): the verifier computes each micro-batch's states as training
consumes them. Same per-step losses as offline training on the same batches (fp32 and bf16 stores), hybrid reads the
first epoch's cache within its budget, SIGKILL + rerun continues on the same curve, 2 torchrun processes (DDP, FSDP2)
equal 1, and the vLLM-fed mode through a bounded staging folder matches offline vLLM extraction."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from eagle3lib.config.extract import ExtractConfig
from eagle3lib.config.stages import open_stage
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.extraction.engine import extract
from eagle3lib.tiny import corpus
from eagle3lib.training.launch import launch, launch_command, launch_env
from eagle3lib.training.loop import train
from eagle3lib.training.metrics import read_metrics
from eagle3lib.training.setup import TrainingError

N = 40
# 2 epochs of 38 samples (~80 tokens each) in 256-token rows, 2 rows a step: ~12 steps; every step logged
# (no served probes: the curves compared are training's own; probes: tests/test_served_probe.py)
RUN = {"train.epochs": 2, "train.log_every": 1, "train.ckpt_every": 3, "train.packed_row_tokens": 256,
       "train.batch_rows": 2, "train.val_fraction": 0.05, "train.warmup_steps": 2, "train.lr": 1e-3,
       "train.nproc_per_node": 1, "train.served_eval_every": 0}
FIELDS = ["loss", "loss_0", "loss_1", "loss_2", "full_acc_0", "tau_est", "tokens_seen"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("online-data") / "convs.jsonl"
    corpus.write_conversations(path, N, 77, "o")
    return path


def _extract(run: Path, dataset: Path, dtype: str, hidden_states: str) -> Path:
    cfg = ExtractConfig(source=str(dataset), dtype=dtype, backend="hf", max_sample_tokens=512, progress=False,
                        final_state_check=0)
    extract(cfg, VerifierConfig(model="builtin:tiny"), run / "extract", hidden_states=hidden_states)
    return run


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory):
    """Run folders with an extract stage: fp32 and bf16 stores, and a tokens-only one (online/hybrid)."""
    root = tmp_path_factory.mktemp("online-runs")
    return {(dtype, mode): _extract(root / f"{dtype}-{mode}", dataset, dtype, mode)
            for dtype, mode in (("float32", "offline"), ("bfloat16", "offline"), ("float32", "online"))}


def _curve(train_dir: Path) -> dict[tuple[str, int], dict]:
    # the training curve: train and validation records
    return {(r["kind"], r["step"]): r for r in read_metrics(train_dir / "metrics.jsonl") if r["kind"] in ("train", "val")}


def _same_curve(a: dict, b: dict, atol: float) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        for f in FIELDS if key[0] == "train" else FIELDS[:-1]:
            d = abs(a[key][f] - b[key][f])
            worst = max(worst, d / max(1.0, abs(a[key][f])) if f == "tokens_seen" else d)
            assert d <= atol * (1 if f != "tokens_seen" else 0) + 1e-12, (key, f, a[key][f], b[key][f])
    return worst


def _train(run: Path, over: dict, out: str = "train"):
    ctx = open_stage("train", "tiny", run, {**RUN, **over})
    if out != "train":
        ctx.out_dir = run / out
    return ctx, train(ctx)


@pytest.fixture(scope="module")
def offline32(runs):
    return _train(runs[("float32", "offline")], {})


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_online_in_process_trains_the_offline_curve(runs, offline32, dtype):
    """online (HF verifier in this process) rounds its states as extract.dtype stores them, so it takes the same steps
    as offline on the same batches: per-step losses equal within 1e-5 for an fp32 store and for a bf16 one."""
    ref_ctx, ref = offline32 if dtype == "float32" else _train(runs[("bfloat16", "offline")], {"extract.dtype": dtype})
    ctx, m = _train(runs[("float32", "online")], {"train.hidden_states": "online", "extract.dtype": dtype},
                    out=f"train-online-{dtype}")
    _same_curve(_curve(ref_ctx.dir), _curve(ctx.dir), atol=1e-5)
    f = m["figures"]
    assert f["hidden_states"] == "online" and f["steps"] == ref["figures"]["steps"]
    # every sample trained on (both epochs) and validated on was computed; nothing stored
    last = max((r for r in read_metrics(ctx.dir / "metrics.jsonl") if r["kind"] == "train"), key=lambda r: r["step"])
    vals = [r for r in read_metrics(ctx.dir / "metrics.jsonl") if r["kind"] == "val"]
    assert f["states_computed_samples"] == last["samples_seen"] + sum(r["samples"] for r in vals)
    assert f["states_cached_samples"] == 0 and f["states_cache_bytes"] == 0
    assert not any(p.suffix == ".safetensors" and "checkpoints" not in p.parts and p.parent.name not in
                   ("final", "best") and p.name != "draft_vocab.safetensors" for p in ctx.dir.rglob("*"))


@pytest.mark.slow
def test_hybrid_caches_the_first_epoch_within_its_budget(runs, offline32):
    """hybrid: epoch 1 reads what epoch 0 kept in states-cache/ (never more than cache_budget_gb) and computes the
    rest; the curve is the offline one."""
    run = runs[("float32", "online")]
    budget_gb = 3e-3  # ~3 MB of fp32 states: about half of the ~40 samples (4 x 192 x 4 B = 3 KiB per token)
    ctx, m = _train(run, {"train.hidden_states": "hybrid", "extract.dtype": "float32", "train.cache_budget_gb": budget_gb},
                    out="train-hybrid")
    _same_curve(_curve(offline32[0].dir), _curve(ctx.dir), atol=1e-5)
    f = m["figures"]
    cache = ctx.dir / "states-cache"
    on_disk = sum(p.stat().st_size for p in cache.rglob("*.safetensors"))
    assert 0 < on_disk <= budget_gb * 1e9 and f["states_cache_bytes"] == on_disk
    assert f["states_cached_samples"] > 0 and f["states_computed_samples"] > 0  # the rest was computed again


@pytest.mark.slow
def test_sigkill_then_rerun_continues_the_same_curve(runs):
    """kill -9 mid-run (hybrid, so the cache is exercised too), then the same command: the run resumes from its last
    checkpoint and ends on the uninterrupted curve; nothing trained is skipped or doubled."""
    run = runs[("float32", "online")]
    over = {**RUN, "train.epochs": 4, "train.hidden_states": "hybrid", "extract.dtype": "float32",
            "train.cache_budget_gb": 1.0}
    ref, _ = _train(run, over, out="train-uninterrupted")
    ctx = open_stage("train", "tiny", run, over)
    ctx.out_dir = run / "train-killed"
    ctx.dir.mkdir(parents=True)
    proc = subprocess.Popen(launch_command(ctx), env=launch_env(ctx), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ctx.dir)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if any(r.get("step", 0) >= 4 for r in read_metrics(ctx.dir / "metrics.jsonl")):  # past the step-3 checkpoint
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.stdout.read()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (ctx.dir / "final").exists()
    m = launch(ctx, echo=lambda _l: None)
    assert m["figures"]["resumed_from_step"] >= 3
    _same_curve(_curve(ref.dir), _curve(ctx.dir), atol=1e-5)
    assert m["figures"]["states_cached_samples"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode,dist", [("online", "ddp"), ("hybrid", "fsdp")])
def test_two_processes_equal_one(runs, offline32, mode, dist):
    """torchrun, 2 processes on gloo: each computes the states of its own micro-batches; the curve is the 1-process
    offline one (the same global batch)."""
    run = runs[("float32", "online")]
    ctx = open_stage("train", "tiny", run, {**RUN, "train.hidden_states": mode, "extract.dtype": "float32",
                                            "train.cache_budget_gb": 1.0, "train.nproc_per_node": 2,
                                            "train.distributed": dist})
    ctx.out_dir = run / f"train-2proc-{mode}"
    m = launch(ctx, echo=lambda _l: None)
    assert m["figures"]["num_processes"] == 2 and m["figures"]["hidden_states"] == mode
    _same_curve(_curve(offline32[0].dir), _curve(ctx.dir), atol=2e-5)
    if mode == "hybrid":
        assert sorted(p.name for p in (ctx.dir / "states-cache").iterdir()) == ["rank-0", "rank-1"]


def test_tokens_only_store_refuses_offline_training(runs):
    with pytest.raises(TrainingError, match="tokens only"):
        _train(runs[("float32", "online")], {}, out="train-refused")


# --------------------------------------------------------------------------------------------------- vLLM-fed


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # exited meanwhile
        return ""


@pytest.mark.slow
def test_vllm_fed_online_matches_offline_within_its_staging_budget(runs, dataset, tmp_path):
    """extract.backend=vllm: the trainer starts its own extraction server; each request's states pass through the
    staging folder, whose bytes never exceed train.staging_budget_gb (sampled while it runs); the server is killed
    after step 3 and started again; the curve is the one the offline fp32 store trains (HF extraction: vLLM's and
    HF's fp32 states agree within 1e-4, tests/test_extract_backends.py). A budget below one micro-batch is an error
    before any server starts. The server computes in fp32: in bf16, vLLM's different prefill batching alone moves the
    states by bf16 noise (measured: 0.04 in the loss of step 2), which is not what this test is about."""
    off = runs[("float32", "offline")]
    on = _extract(tmp_path / "on", dataset, "float32", "online")
    over = {**RUN, "train.max_steps": 6, "extract.backend": "vllm", "extract.dtype": "float32",
            "verifier.dtype": "float32"}
    with pytest.raises(TrainingError, match="staging_budget_gb"):
        _train(on, {**over, "train.hidden_states": "online", "train.staging_budget_gb": 1e-5})
    assert not (on / "train" / "online-vllm-rank0").exists()  # refused before the server

    ref_ctx, _ = _train(off, over, out="train-vllm-ref")
    budget_gb = 0.004  # a few samples' files at a time (4 x 192 x 4 B = 3 KiB of fp32 states per token)
    staged, stop = [0], threading.Event()
    scratch = on / "train" / "online-vllm-rank0" / "vllm-hidden-scratch"

    def watch():
        while not stop.is_set():
            try:
                staged[0] = max(staged[0], sum(p.stat().st_size for p in scratch.iterdir() if p.is_file()))
            except OSError:
                pass
            time.sleep(0.005)

    def kill_server_after_step_3(rec):  # the generate stage's policy: a server that dies is started again
        if rec["kind"] == "train" and rec["step"] == 3:
            servers = [p for p in psutil.Process().children(recursive=True)  # this trainer's: its staging folder
                       if str(scratch) in _cmdline(p)]  # (other tests' vLLM servers may be running)
            leaders = [p for p in servers if p.ppid() not in {q.pid for q in servers}]  # not vLLM's engine process
            assert len(leaders) == 1, servers
            os.killpg(leaders[0].pid, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    ctx = open_stage("train", "tiny", on, {**over, "train.hidden_states": "online", "train.staging_budget_gb": budget_gb})
    try:
        m = train(ctx, on_record=kill_server_after_step_3)
    finally:
        stop.set()
    assert m["figures"]["states_server_restarts"] == 1
    assert 0 < staged[0] <= budget_gb * 1e9, staged[0]
    assert 0 < m["figures"]["states_peak_staged_bytes"] <= budget_gb * 1e9
    worst = _same_curve(_curve(ref_ctx.dir), _curve(ctx.dir), atol=1e-4)  # measured: 7.5e-7
    print(f"online vLLM-fed vs offline HF-extracted fp32: largest difference {worst:.2e}")


# ------------------------------------------------------------------------------------------------ budgets that hold


def test_online_computes_only_what_a_row_keeps(tiny_verifier, one_thread):
    """A stored sample longer than train.packed_row_tokens: rows keep its first packed_row_tokens tokens, so the
    verifier computes only those (it computed, staged and cached the whole sample, and the staging pre-check sized it
    cut: a run that passed it could die mid-training). The states are the offline store's first rows (causal)."""
    from train_fixtures import cached_store

    from eagle3lib.data.hidden_store import HiddenStateReader
    from eagle3lib.model.hf_extract import HFExtractor
    from eagle3lib.training.states import OnlineStates

    reader = HiddenStateReader(cached_store(tiny_verifier, 300))
    long = [i for i in range(len(reader)) if reader.lengths[i] > 60][:2]
    ex = HFExtractor(str(tiny_verifier), reader.meta["aux_layer_ids"], dtype="float32", device="cpu")
    states = OnlineStates(reader, ex, "bfloat16", max_tokens=48)
    got = states.fetch(long, epoch=0)
    assert [len(got[i]) for i in long] == [48, 48] and states.counts.computed_tokens == 96
    for i in long:
        stored = reader[i]
        assert torch.equal(got[i].input_ids, stored.input_ids[:48])
        torch.testing.assert_close(got[i].aux_hidden.float(), stored.aux_hidden[:48].float(), atol=0.05, rtol=0.02)


def test_the_staging_check_counts_validation_and_the_cut():
    """The largest micro-batch the staging folder must hold: validation's too (not counted before), each sample cut at
    packed_row_tokens as computed. Sizes in tokens (one byte per token) to read the answer off."""
    from types import SimpleNamespace

    from eagle3lib.data.packing import Plan, deal
    from eagle3lib.training.states import max_micro_batch_bytes

    lengths = [10, 20, 30, 40, 900]  # sample 4 (validation) is longer than a row
    cfg = SimpleNamespace(packed_row_tokens=256, micro_batch_rows=1)
    plan = Plan(steps=[[[[0], [1]], [[2], [3]]]], epochs=1.0, total_steps=2, epoch_steps=[2])
    assert max_micro_batch_bytes(plan, deal, lengths, cfg, 2, lambda n: n) == 40
    assert max_micro_batch_bytes(plan, deal, lengths, cfg, 2, lambda n: n, vrows=[[4]]) == 256


def test_the_hybrid_cache_holds_its_budget_after_a_resume_at_another_world_size(tmp_path):
    """cache_budget_gb bounds the cache folder: a run resumed with 2 processes after 4 finds four rank caches; each
    rank's share was budget / world on top of them (~1.5x the budget seen). Now the shares are of what is left."""
    from eagle3lib.data.hidden_store import HiddenSample, HiddenStateWriter
    from eagle3lib.data.store_index import read_index, store_totals
    from eagle3lib.training.states import StatesCache

    meta = {"verifier": "x", "hidden_size": 8, "vocab_size": 64, "num_layers": 8, "aux_layer_ids": [2, 4, 5]}

    def sample(name: str) -> HiddenSample:
        return HiddenSample(name, torch.arange(50), torch.ones(50, dtype=torch.bool), torch.zeros(50, 3, 8),
                            torch.zeros(50, 8))

    root = tmp_path / "states-cache"
    for r in range(4):  # the first run: 4 processes, 2 samples cached each
        with HiddenStateWriter(root / f"rank-{r}", meta, samples_per_shard=1, dtype="bfloat16") as w:
            for j in range(2):
                w.add(sample(f"r{r}-{j}"))

    def used() -> int:
        return sum(store_totals(read_index(d, strict=False))["bytes"] for d in root.glob("rank-*"))

    budget = used() * 1.5
    caches = [StatesCache(root, meta, "bfloat16", budget, rank, 2) for rank in range(2)]  # resumed with 2
    for k in range(20):
        for c in caches:
            c.offer(sample(f"new-{c.writer.root.name}-{k}"))
    for c in caches:
        c.seal()
    assert all(c.full for c in caches) and used() <= budget
