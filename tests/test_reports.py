# .venv/bin/python -m pytest -q tests/test_reports.py
"""The report functions the stage notebooks call, on small inputs made here: what they show is what the data says."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

FIX = Path(__file__).parent / "fixtures" / "analysis"


def test_fmt_and_figures_table():
    from eagle3lib.reports.tables import figures_table, fmt

    assert fmt(87795136) == "87,795,136" and fmt(8.7795136e7) == "87,795,136" and fmt(3.14159) == "3.142"
    assert fmt(0.00012345) == "0.000123" and fmt(True) == "True" and fmt([2, 4, 5]) == "2, 4, 5" and fmt(None) == "–"
    assert fmt(float("nan")) == "nan" and fmt(6.161e7) == "61,610,000" and fmt(12345.6) == "12,346"
    assert (fmt(12.345, "hours"), fmt(0.01, "hours_lo"), fmt(0.0, "hours")) == ("12.3", "<0.1", "0")
    assert (fmt(1234.5, "usd"), fmt(0.2, "usd_hi"), fmt(0, "usd")) == ("$1,234", "<$1", "$0")
    t = figures_table({"samples": 1200, "tau": 3.1666, "nested": {"a": 1}, "skip_me": 1}, skip=["skip_me"])
    assert t.rows() == [("samples", "1,200"), ("tau", "3.167")]
    many = figures_table({f"f{i}": i for i in range(40)})._repr_html_()  # shown whole, no "…" row
    assert many.count("<tr>") == 41 and "f39" in many and "…" not in many



def test_paths_are_shown_relative_to_the_run(tmp_path):
    import polars as pl

    from eagle3lib.core.paths import REPO_ROOT
    from eagle3lib.reports.tables import Table, for_people, people_text

    for_people(tmp_path / "run")
    assert people_text(f"manifest {tmp_path}/run/train/manifest.json") == "manifest train/manifest.json"
    assert people_text(f"{REPO_ROOT}/params/hardware.yaml") == "params/hardware.yaml"
    html = Table(pl.DataFrame({"source": [f"{tmp_path}/run/train/metrics.jsonl"], "n": [None]}))._repr_html_()
    assert "<td>train/metrics.jsonl</td>" in html and "<td>–</td>" in html and str(tmp_path) not in html


def test_verifier_report():
    from eagle3lib.reports import verifier

    assert verifier.loss_curve({"model": "x"}) is None
    fig = verifier.loss_curve({"train_loss_curve": [3.0, 2.0, 1.0], "train_tokens": 3e6, "heldout_loss": 0.9})
    assert len(fig.axes[0].lines) == 2  # the curve and the held-out line
    md = verifier.answers_markdown([{"category": "math", "mode": "greedy", "prompt": "1+1?", "reasoning": None,
                                     "content": "2", "completion_tokens": 3, "finish_reason": "stop"}])
    assert "**[math, greedy] 1+1?**" in md and "*reasoning:* (none)" in md and "finish_reason=stop" in md


def _records(tmp_path: Path) -> Path:
    from eagle3lib.data.records import ShardWriter

    out = tmp_path / "generate"

    def rec(i, status, reasoning, content, tokens, error=None):
        msgs = [{"role": "user", "content": f"q{i}"}]
        if status != "failed":
            msgs.append({"role": "assistant", "reasoning_content": reasoning, "content": content})
        return {"id": f"p{i}", "category": "math" if i % 2 else "chat", "status": status, "messages": msgs,
                "finish_reason": None if status == "failed" else "length" if status == "truncated" else "stop",
                "prompt_tokens": 5, "completion_tokens": tokens, "error": error, "attempts": 1,
                "reasoning_tokens": None}

    with ShardWriter(out, 100) as w:
        w.write(rec(0, "ok", "think", "answer", 8))
        w.write(rec(1, "ok", "", "just an answer", 6))
        w.write(rec(2, "truncated", "long thinking", "", 12))
        w.write(rec(3, "failed", "", "", 0, "HTTP 400: prompt too long"))
    return out


def test_generate_report(tmp_path):
    from eagle3lib.reports import generate

    gen = _records(tmp_path)
    lengths = generate.length_table(gen)  # no tokenizer: split by characters
    assert lengths.height == 4 and set(lengths.columns) >= {"reasoning_tokens_est", "content_tokens_est"}
    row = lengths.filter(lengths["id"] == "p0").row(0, named=True)
    assert row["reasoning_tokens_est"] + row["content_tokens_est"] == 8
    lengths = lengths.rename({"reasoning_tokens_est": "reasoning_tokens", "content_tokens_est": "content_tokens"})
    summary = generate.length_summary(lengths)
    assert summary["status"].to_list() == ["failed", "ok", "truncated"]
    assert summary.filter(summary["status"] == "ok")["responses"].item() == 2
    assert generate.length_histograms(lengths).axes and generate.reasoning_vs_content(lengths).axes
    md = generate.answers_markdown(gen, 2)
    assert "**[chat, ok] q0**" in md and "*reasoning:* think" in md and "q2" not in md
    problems = generate.problems_table(gen)
    assert problems["id"].to_list() == ["p2", "p3"] and problems["error"].to_list()[1] == "HTTP 400: prompt too long"


def test_generate_report_lengths_with_the_tokenizer(tmp_path, tiny_verifier):
    from eagle3lib.config.verifier import VerifierConfig
    from eagle3lib.reports import generate

    lengths, how = generate.report_lengths(_records(tmp_path), VerifierConfig(model=str(tiny_verifier)))
    assert "verifier's tokenizer" in how and lengths["content_tokens"].to_list()[1] > 0
    lengths, how = generate.report_lengths(_records(tmp_path / "b"), VerifierConfig(model=str(tmp_path / "nothing")))
    assert how.startswith("estimated from characters") and "reasoning_tokens" in lengths.columns


def test_extract_report(tmp_path, tiny_verifier):
    from eagle3lib.data.hidden_store import HiddenSample, HiddenStateWriter
    from eagle3lib.model.verifier import load_tokenizer
    from eagle3lib.reports import extract

    disk = extract.disk_table(192, 2048)
    assert disk["dtype"].to_list() == ["bfloat16", "float8_e4m3fn"] and disk["bytes_per_token"].to_list() == [1541, 789]
    meta = {"verifier": "tiny", "hidden_size": 8, "vocab_size": 64, "num_layers": 8, "aux_layer_ids": [2, 4, 5]}
    with HiddenStateWriter(tmp_path / "store", meta) as w:
        aux = torch.ones(5, 3, 8)
        aux[:, 1] *= 2
        w.add(HiddenSample("s0", torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 0, 1, 1, 1]).bool(),
                           aux.bfloat16(), (3 * torch.ones(5, 8)).bfloat16()))
    tok = load_tokenizer(str(tiny_verifier))
    s = extract.sample_summary(tmp_path / "store", 0, tok)
    assert s["layer_names"] == ["aux_2", "aux_4", "aux_5", "final"] and s["loss_mask"] == [False, False, True, True, True]
    assert [round(x) for x in s["norms"][0]] == [round(math.sqrt(8)), round(2 * math.sqrt(8)), round(math.sqrt(8)),
                                                 round(3 * math.sqrt(8))]
    html = extract.tokens_html(s, tok)
    assert html.count("background:#cfe3ff") == 3 and "5 tokens, 3 in the loss mask" in html
    assert len(extract.norms_plot(s).axes[0].lines) == 4


def test_train_report():
    from eagle3lib.reports import train

    overview, grid = train.curves(FIX / "run_a" / "train" / "metrics.jsonl")
    assert overview.axes and grid is not None and grid.axes
    cmd = train.serve_command("/x/final", 3, "Qwen/Qwen3-8B")
    assert cmd.startswith("python -m vllm.entrypoints.openai.api_server --model Qwen/Qwen3-8B ")
    assert '"num_speculative_tokens": 3' in cmd and '"model": "/x/final"' in cmd


@pytest.fixture
def results():
    return {"ttt_steps": 2, "ttt_steps_trained": 3, "checkpoint": "final", "warnings": ["w1"],
            "prompts": {"used": 4, "source": "builtin:tiny-heldout", "per_category": {"chat": 2, "math": 2}},
            "estimate": {"train_est": None, "val_est": {"tau": 2.8, "accept_rate_pos": [0.9, 0.9]}},
            "lib": {"greedy": {"tau": 2.5, "accept_rate_pos": [0.8, 0.7], "categories": {"chat": {"tau": 2.6},
                                                                                        "math": {"tau": 2.4}}},
                    "baseline_mode": "greedy", "device": "cpu", "dtype": "float32", "plain": {"tokens_per_s": 100.0},
                    "spec_tokens_per_s": 150.0, "speedup": 1.5},
            "vllm": {"greedy": {"tau": 2.4, "accept_rate_pos": [0.8, 0.6], "tokens_per_s": 90.0,
                                "categories": {"chat": {"tau": 2.5}}},
                     "base": {"greedy": {"tokens_per_s": 100.0}}},
            "lib_per_prompt": [{"id": "a", "tau_greedy": 3.0}, {"id": "b", "tau_greedy": 2.0}]}


def test_evaluate_report(results):
    from eagle3lib.reports import evaluate

    table = evaluate.comparison_table(results)
    assert table["label"].to_list() == ["training estimate (val)", "library, greedy", "vLLM, greedy"]
    assert table["gap_vs_vllm_greedy"].to_list() == pytest.approx([0.4, 0.1, 0.0])
    cats = evaluate.category_table(results)
    assert cats["category"].to_list() == ["chat", "math"] and cats["tau_vllm_greedy"].to_list() == [2.5, None]
    speed = evaluate.speed_table(results)
    assert speed["speedup"].to_list() == pytest.approx([1.5, 0.9])
    assert evaluate.per_prompt_table(results)["id"].to_list() == ["b", "a"]  # least accepted first
    assert evaluate.per_prompt_table({**results, "lib_per_prompt": []}) == "library not measured"
    assert evaluate.warnings_markdown(results) == "- w1" and evaluate.warnings_markdown({"warnings": []}) == "none"
    head = evaluate.header_markdown(results, {"tau_vllm_greedy": 2.4, "tau_val_est": 2.8, "tau_lib_greedy": 2.5})
    assert head.startswith("K = 2 draft tokens per round (drafter trained for 3); 4 prompts")
    assert "validation estimate 2.80 is +0.40" in head
    assert len(evaluate.plot_comparison(results).axes) == 2
