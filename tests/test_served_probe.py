# .venv/bin/python -m pytest -q tests/test_served_probe.py
"""Acceptance as served during training (eagle3lib/training/served_probe.py): probes at the steps asked for and at the
last, each the library's real speculative decoding of the drafter as it was at that step (the last probe equals an
independent decoding of train/final/ on the same prompts, token for token), train/best/ chosen by the served tau when
train.best_by asks, and the probes' cost in the manifest."""

from __future__ import annotations

import json

import pytest
import torch
from train_fixtures import cached_store, make_run_dir

from eagle3lib.config.profile import ParamsError
from eagle3lib.config.stages import open_stage
from eagle3lib.model.checkpoint import load_drafter
from eagle3lib.model.speculative import EagleDrafter, Verifier, speculative_decode, summarize_runs
from eagle3lib.model.verifier import eos_ids, load_hf_model, load_tokenizer
from eagle3lib.training.inputs import load_inputs
from eagle3lib.training.loop import train
from eagle3lib.training.metrics import read_metrics
from eagle3lib.training.served_probe import probe_prompts

PROBE = {"train.max_steps": 16, "train.log_every": 4, "train.ckpt_every": 100, "train.nproc_per_node": 1,
         "train.served_eval_every": 8, "train.served_eval_prompts": 3, "train.served_eval_max_tokens": 24,
         "train.served_eval_temperature": 0.7, "train.best_by": "served_greedy"}


def test_best_by_served_needs_probes(tmp_path):
    with pytest.raises(ParamsError, match=r"train.best_by: served_greedy needs served probes"):
        open_stage("train", "tiny", tmp_path, {"train.best_by": "served_greedy", "train.served_eval_every": 0})
    with pytest.raises(ParamsError, match=r"served_sampled needs train.served_eval_temperature > 0"):
        open_stage("train", "tiny", tmp_path, {"train.served_eval_every": 5, "train.best_by": "served_sampled",
                                               "train.served_eval_temperature": 0})


@pytest.mark.slow
def test_probes_measure_the_drafter_as_served_and_choose_best(tiny_verifier, tmp_path):
    store = cached_store(tiny_verifier, 300)
    run = make_run_dir(tmp_path / "run", store)
    ctx = open_stage("train", "tiny", run, PROBE)
    m = train(ctx)
    served = [r for r in read_metrics(ctx.dir / "metrics.jsonl") if r["kind"] == "served"]
    assert [r["step"] for r in served] == [8, 16]  # every 8 steps, the last included
    for r in served:
        assert r["prompts"] == 3 and 1.0 <= r["tau_greedy"] <= 4.0 and 1.0 <= r["tau_sampled"] <= 4.0
        assert len(r["accept_rate_pos_greedy"]) == 3 and r["probe_s"] > 0
    assert served[0]["load_s"] > 0 and served[1]["load_s"] == 0  # the verifier is loaded once

    # the last probe is what the library measures on train/final/ with the same prompts, greedy
    drafter, _ = load_drafter(ctx.dir / "final", verifier_path=str(tiny_verifier))
    verifier = Verifier(load_hf_model(str(tiny_verifier), "float32"))
    eos = eos_ids(load_tokenizer(str(tiny_verifier)), str(tiny_verifier))
    (tmp_path / "scratch").mkdir()
    inp = load_inputs(ctx.cfg, ctx.verifier, ctx.stage_dir("extract"), tmp_path / "scratch")
    prompts = probe_prompts(inp.reader, inp.split.val, 3)
    runs = [speculative_decode(verifier, EagleDrafter(drafter), p, 24, 3, eos=eos,
                               generator=torch.Generator().manual_seed(j)) for j, (_, p) in enumerate(prompts)]
    assert summarize_runs(runs, 3)["tau"] == pytest.approx(served[-1]["tau_greedy"], abs=1e-9)

    f = m["figures"]
    assert f["best_by"] == "served_greedy" and "best_val_tau_est" not in f
    best = max(served, key=lambda r: (r["tau_greedy"], -r["step"]))  # a tie keeps the earlier
    assert f["best_step"] == best["step"] and f["best_served_greedy_tau"] == pytest.approx(best["tau_greedy"])
    sel = json.loads((ctx.dir / "best" / "selection.json").read_text())
    assert sel["chosen_by"] == "served_greedy_tau" and sel["step"] == best["step"]
    assert f["served_probes"] == 2 and f["served_tau_greedy"] == served[-1]["tau_greedy"]
    assert 0 < f["served_probe_share"] < 1 and f["served_probe_s"] > 0


@pytest.mark.slow
def test_a_probe_through_vllm_serves_the_checkpoint_and_agrees_with_the_library(tiny_verifier, tmp_path):
    """train.served_eval_backend: vllm starts a server with the probe's checkpoint as its speculator (a large verifier
    on a spare GPU); its greedy tau is the library's on the same checkpoint and prompts, within evaluate.tolerance."""
    store = cached_store(tiny_verifier, 300)
    run = make_run_dir(tmp_path / "run", store)
    ctx = open_stage("train", "tiny", run, {**PROBE, "train.served_eval_every": 16, "train.served_eval_backend": "vllm",
                                            "train.served_eval_temperature": 0, "train.best_by": "estimate"})
    train(ctx)
    (probe,) = [r for r in read_metrics(ctx.dir / "metrics.jsonl") if r["kind"] == "served"]
    assert probe["backend"] == "vllm" and probe["step"] == 16 and "tau_sampled" not in probe
    assert "speculative-config" in (ctx.dir / "served_probe_vllm.log").read_text()
    drafter, _ = load_drafter(ctx.dir / "final", verifier_path=str(tiny_verifier))
    verifier = Verifier(load_hf_model(str(tiny_verifier), "float32"))
    eos = eos_ids(load_tokenizer(str(tiny_verifier)), str(tiny_verifier))
    (tmp_path / "scratch").mkdir()
    inp = load_inputs(ctx.cfg, ctx.verifier, ctx.stage_dir("extract"), tmp_path / "scratch")
    runs = [speculative_decode(verifier, EagleDrafter(drafter), p, 24, 3, eos=eos)
            for _, p in probe_prompts(inp.reader, inp.split.val, 3)]
    assert abs(summarize_runs(runs, 3)["tau"] - probe["tau_greedy"]) <= 0.15, (summarize_runs(runs, 3), probe)
