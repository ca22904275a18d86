# .venv/bin/python -m pytest -q tests/test_extract_ranks.py
"""Extraction across processes and nodes through torchrun (no cluster code of ours): 2 processes on one node, and 2
"nodes" (two torchrun agents on 127.0.0.1 with c10d rendezvous), each give the same store contents per sample id as
1 process; every rank writes its own shards, the index is merged once, and a rank resumes on its own."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from eagle3lib.config.stages import open_stage
from eagle3lib.core.manifest import read_manifest
from eagle3lib.core.ranks import owner
from eagle3lib.core.torchrun import torchrun_command, torchrun_env
from eagle3lib.data.hidden_store import HiddenStateReader
from eagle3lib.stages import extract as stage
from eagle3lib.tiny import corpus
from eagle3lib.vllm.server import free_port

N = 20


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "convs.jsonl"
    corpus.write_conversations(path, N, 4, "c")
    return path


def _sets(dataset: Path, **kw) -> dict:
    # fp32: the stores compare exactly (batch composition differs between ranks; fp32 keeps that below 1e-5)
    return {"extract.source": str(dataset), "extract.progress": False, "extract.samples_per_shard": 3,
            "extract.dtype": "float32", "extract.disk_margin_gib": 0, **kw}


def _contents(extract_dir: Path) -> dict[str, tuple]:
    r = HiddenStateReader(extract_dir)
    assert len(set(r.ids)) == len(r.ids), "a sample stored twice"
    return {s.sample_id: (s.input_ids, s.loss_mask, s.aux_hidden, s.final_hidden) for s in (r[i] for i in range(len(r)))}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for sid in a:
        assert torch.equal(a[sid][0], b[sid][0]) and torch.equal(a[sid][1], b[sid][1]), sid
        for x, y in zip(a[sid][2:], b[sid][2:], strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def one_process(dataset, tiny_verifier, tmp_path_factory) -> Path:
    ctx = open_stage("extract", "tiny", tmp_path_factory.mktemp("one"), _sets(dataset))
    stage.run(ctx)
    return ctx.dir


@pytest.mark.slow
def test_two_processes_same_store_and_per_rank_resume(dataset, one_process, tmp_path):
    ctx = open_stage("extract", "tiny", tmp_path / "run", _sets(dataset, **{"extract.nproc_per_node": 2}))
    res = stage.run(ctx, echo=lambda _line: None)  # torchrun --standalone, 2 processes
    _same(_contents(one_process), _contents(ctx.dir))
    f = res["figures"]
    assert f["world_size"] == 2 and f["samples"] == N and f["samples_this_run"] == N
    assert [r["samples_this_run"] for r in f["ranks"]] == [sum(owner(f"c{i}", 2) == k for i in range(N)) for k in (0, 1)]
    assert f["tokens_this_run"] == sum(r["tokens_this_run"] for r in f["ranks"]) == f["tokens"]  # no double counting
    names = sorted(p.name for p in (ctx.dir / "shards").iterdir())
    assert any(n.startswith("shard-r00000-") for n in names) and any(n.startswith("shard-r00001-") for n in names)
    assert sorted(p.name for p in ctx.dir.glob("index*.jsonl")) == ["index.jsonl"]  # merged, rank indexes gone

    # rank 1 "killed" before its last shard: that shard is gone and, unmerged, its samples sit in no index
    index = [json.loads(x) for x in (ctx.dir / "index.jsonl").read_text().splitlines()]
    lost = [e for e in index if e["shard"].startswith("shard-r00001-")][-1]
    (ctx.dir / "shards" / lost["shard"]).unlink()
    kept = [e for e in index if e is not lost]
    (ctx.dir / "index.jsonl").write_text("".join(json.dumps(e) + "\n" for e in kept[:-2]))
    (ctx.dir / "index-r00001.jsonl").write_text("".join(json.dumps(e) + "\n" for e in kept[-2:]) + '{"shard": "torn')
    (ctx.dir / "shards" / f".{lost['shard']}.999.tmp").write_bytes(b"half a shard")
    f2 = stage.run(ctx, echo=lambda _line: None)["figures"]
    assert [r["samples_this_run"] for r in f2["ranks"]] == [0, len(lost["ids"])]  # only rank 1 had work left
    assert f2["resumed_samples"] == N - len(lost["ids"]) and f2["samples"] == N
    _same(_contents(one_process), _contents(ctx.dir))
    assert not list((ctx.dir / "shards").glob(".*.tmp"))
    # and one process continues a store two wrote: nothing left to do
    f3 = stage.run(open_stage("extract", "tiny", tmp_path / "run", _sets(dataset)))["figures"]
    assert f3["samples_this_run"] == 0 and f3["samples"] == N and f3["world_size"] == 1


@pytest.mark.slow
def test_two_nodes_same_store(dataset, one_process, tmp_path):
    ctx = open_stage("extract", "tiny", tmp_path / "run", _sets(dataset, **{
        "extract.nnodes": 2, "extract.rdzv_endpoint": f"127.0.0.1:{free_port()}"}))
    args = ["--profile", "tiny", "--run-dir", str(ctx.run_dir), "--overrides-json", json.dumps(ctx.profile.overrides)]
    cmd = torchrun_command(ctx.cfg, "eagle3lib.stages.extract", args)
    assert "--nnodes=2" in cmd and "--rdzv-backend=c10d" in cmd
    ctx.dir.mkdir(parents=True, exist_ok=True)
    agents = [subprocess.Popen(cmd, env=torchrun_env(1), cwd=ctx.dir, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]  # "node 0" and "node 1"
    outs = [a.communicate(timeout=600)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    m = read_manifest(ctx.dir)
    assert m["status"] == "complete" and m["figures"]["world_size"] == 2 and m["figures"]["samples"] == N
    _same(_contents(one_process), _contents(ctx.dir))
