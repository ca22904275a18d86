# .venv/bin/python -m pytest -q tests/test_tiny_long.py
"""The tiny-long verifier (builtin:tiny-long, eagle3lib/tiny/long.py): shipped like the other tiny verifiers; its
answers depend on a document thousands of tokens long (edit the fact and the answer follows); and the pipeline on it
(params/tiny-long.yaml through the runner, a ~9K-token sample among short ones): generate through vLLM at 16K context,
extraction and training on the long sample whole, evaluate's tau per context bucket in the library and vLLM."""

from __future__ import annotations

import copy
import json
import random
from dataclasses import asdict

import pytest
import torch

from eagle3lib.data.context_buckets import bucket_key, library_buckets
from eagle3lib.tiny.build import shipped_dir, shipped_key, tiny_verifier_path
from eagle3lib.tiny.long import TinyLongRecipe, build_long_verifier, long_sample
from eagle3lib.tiny.recipe import recipe_key

pytestmark = pytest.mark.usefixtures("one_thread")
SEED = 4  # a ~9K-token document whose country (a quarter of the way in, ~6.5K tokens before the question) the shipped
# verifier names, and names the swapped one too (it does on ~40-60% of documents this long: build_report.json)
OTHER = {**{f"{a}s": f"{b}s" for a, b in zip(["cat", "dog", "horse", "owl", "whale", "bee", "frog", "camel"],
                                             ["owl", "whale", "frog", "camel", "cat", "dog", "horse", "bee"], strict=True)},
         "France": "Kenya", "Japan": "Peru", "Kenya": "France", "Brazil": "Spain", "Canada": "Norway", "Egypt": "Italy",
         "India": "Mexico", "Italy": "Egypt", "Mexico": "India", "Norway": "Canada", "Peru": "Japan", "Spain": "Brazil"}


@pytest.fixture(scope="module")
def long_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_verifier_path(TinyLongRecipe(), progress=False)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.slow
def test_shipped_tiny_long_is_this_recipe(tmp_path):
    """The shipped weights are this recipe's (its key), and a rebuild's first continued-training steps reproduce the
    shipped build's losses (from the shipped tiny verifier, which its own test checks the same way)."""
    r = TinyLongRecipe()
    assert shipped_key(r) == recipe_key(r), ("the recipe changed since tiny-long was shipped; rebuild and ship it: "
                                             "python -m eagle3lib build-verifier --ship --name tiny-long")
    rebuilt = build_long_verifier(r, tmp_path, progress=False, max_steps=3)
    shipped = json.loads((shipped_dir(r) / "build_report.json").read_text())
    assert rebuilt["first_losses"] == pytest.approx(shipped["first_losses"][:3], rel=1e-4, abs=1e-6)


def test_build_report_measured_retrieval():
    """The continued training taught retrieval: at every measured document length (1K to 14K tokens) the verifier
    names the document's animal or country far more often than before it (chance: 1 in 8 or 12)."""
    rep = json.loads((shipped_dir(TinyLongRecipe()) / "build_report.json").read_text())
    before, after = rep["retrieval_accuracy_before"], rep["retrieval_accuracy"]
    assert set(after) == {str(n) for n in TinyLongRecipe().eval_lengths}
    for n in after:
        assert after[n]["retrieved"] >= before[n]["retrieved"] + 0.25, (n, before[n], after[n])
    assert max(int(v["doc_tokens"]) for v in after.values()) > 12_000
    assert rep["recipe"]["max_position_embeddings"] == 16384


def _greedy_answer(model, tok, messages, max_new_tokens=24) -> str:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, len(ids):])


def test_the_answer_follows_the_document(long_model):
    """A ~9K-token document that mentions one animal, once, thousands of tokens before the question: the verifier's
    greedy answer names it; the same document with that animal swapped for another names the other."""
    model, tok = long_model
    s = long_sample(random.Random(SEED), 9000)
    user, said = s["messages"][0]["content"], s["answers"][0]
    assert len(tok(user)["input_ids"]) > 8_000 and user.count(said) == 1 and user.index(said) < len(user) * 3 // 4
    swapped = OTHER[said]
    assert said in _greedy_answer(model, tok, s["messages"][:1])
    assert swapped in _greedy_answer(model, tok, [{"role": "user", "content": user.replace(said, swapped)}])


def test_tiny_long_pipeline(long_run):
    """params/tiny-long.yaml through the runner on 4 samples, one a ~9K-token document (tests/pipeline_runs.py)."""
    run = long_run.check()

    def figures(stage):
        return json.loads((run / stage / "manifest.json").read_text())["figures"]

    x, t, e = figures("extract"), figures("train"), figures("evaluate")
    assert x["samples"] == 4 and x["longest_sample_tokens"] >= 8192, x
    assert t["steps"] == 8
    res = json.loads((run / "evaluate" / "results.json").read_text())
    for side in ("lib", "vllm"):
        assert e[f"tau_{side}_greedy_ctx_ge4K"] is not None  # vLLM's counters were this run's alone
    check_context_buckets(res, e, {"<4K": 3, ">=4K": 1})  # three short prompts and the ~9K-token document
    assert e["greedy_same_output_frac_lib_vllm"] >= 0.75  # the library and vLLM decode the same text


def check_context_buckets(res: dict, figures: dict, prompts_per_bucket: dict[str, int], edge: int = 4096) -> None:
    """evaluate's greedy tau per context bucket (one edge), as values: every round in exactly one bucket (rounds
    and accepted drafts add up to the pass's), each bucket's tau pooled by rounds (1 + accepted / rounds, so the
    pass's tau follows from the buckets' sums), its acceptance per position shares of its rounds (summed: tau - 1),
    the manifest's figures the buckets' own; vLLM's requests grouped by prompt length (the groups' prompts add up to
    the prompts sent), and the library's one prompt longer than the edge holding every round above it (its context
    is past the edge from the first round; the short prompts end far below it)."""
    above = f">={edge // 1024}K"
    for side in ("lib", "vllm"):
        whole = res[side]["greedy"]
        buckets = whole["context_buckets"]
        assert list(buckets) == list(prompts_per_bucket), (side, buckets)  # in order of context length
        rounds, accepted = sum(b["rounds"] for b in buckets.values()), sum(b["accepted"] for b in buckets.values())
        assert (rounds, accepted) == (whole["rounds"], whole["accepted"]), (side, rounds, accepted, whole)
        assert whole["tau"] == pytest.approx(1 + accepted / rounds), side
        for label, b in buckets.items():
            assert b["rounds"] > 0 and b["tau"] == pytest.approx(1 + b["accepted"] / b["rounds"]), (side, label, b)
            assert sum(b["accept_rate_pos"]) == pytest.approx(b["tau"] - 1), (side, label, b)
            assert figures[f"tau_{side}_greedy_{bucket_key(label)}"] == b["tau"], (side, label)
            assert figures[f"rounds_{side}_greedy_{bucket_key(label)}"] == b["rounds"], (side, label)
    vllm = res["vllm"]["greedy"]["context_buckets"]
    assert {label: b["prompts"] for label, b in vllm.items()} == prompts_per_bucket
    assert sum(prompts_per_bucket.values()) == res["prompts"]["used"]
    lib = res["lib_per_prompt"]
    long = [r for r in lib if r["prompt_tokens"] >= edge]
    assert len(long) == prompts_per_bucket[above] == 1 and long[0]["prompt_tokens"] > 8_000, long
    assert all(r["prompt_tokens"] < edge // 2 for r in lib if r not in long), lib
    assert res["lib"]["greedy"]["context_buckets"][above]["tau"] == pytest.approx(long[0]["tau_greedy"])


K = 3


def _lib_record(pid: str, prompt_tokens: int, per_round: list[int]) -> dict:
    """One prompt's library record, as eagle3lib/evaluation/library.py stores it, from its rounds' accepted drafts."""
    from eagle3lib.model.speculative import DecodeResult

    tokens = [7] * (len(per_round) + sum(per_round))
    spec = DecodeResult(tokens, 0.01 * len(per_round), len(per_round), sum(per_round),
                        [sum(a > i for a in per_round) for i in range(K)], list(per_round), len(per_round) + 1)
    return {"id": pid, "category": "doc" if prompt_tokens >= 4096 else "chat", "prompt_tokens": prompt_tokens,
            "plain": asdict(DecodeResult(tokens, 0.02 * len(tokens), forwards=len(tokens))), "greedy": asdict(spec),
            "greedy_equals_plain": True}


# three short prompts (their rounds far below 4K) and a ~9.3K-token document, accepting unevenly
LIB_RECORDS = [_lib_record("a", 40, [3, 3, 0, 3]), _lib_record("b", 120, [0, 1]), _lib_record("c", 900, [2] * 6),
               _lib_record("doc", 9300, [1, 0, 0, 2, 0])]


def _results(records: list[dict] = LIB_RECORDS) -> tuple[dict, dict]:
    """The results and figures the evaluate stage writes, made by its own functions (the library's from records, the
    figures from the results) and vLLM's spec-decode counter deltas per prompt group, hand-made."""
    from eagle3lib.evaluation.library import per_prompt_rows, summarize_library
    from eagle3lib.evaluation.results import build_figures
    from eagle3lib.vllm.spec_metrics import SpecCounters

    raw = {"records": records, "baseline_mode": "greedy", "device": "cpu", "dtype": "float32"}
    short = SpecCounters(30, 90, 40, [20, 12, 8], requests=3, prompt_tokens=1060)
    doc = SpecCounters(20, 60, 18, [10, 6, 2], requests=1, prompt_tokens=9300)
    res = {"ttt_steps": K, "ttt_steps_trained": K, "estimate": {}, "tolerance": 0.15, "warnings": [],
           "prompts": {"used": 4, "used_lib": len(records), "per_category": {"chat": 3, "doc": 1}},
           "lib": summarize_library(raw, ["greedy"], K, [4096]), "lib_per_prompt": per_prompt_rows(raw, ["greedy"]),
           "vllm": {"greedy": {**(short + doc).summary(), "context_buckets": {
               "<4K": {"prompts": 3, **short.summary()}, ">=4K": {"prompts": 1, **doc.summary()}}}}}
    return res, build_figures(res)


def test_bucket_checks_hold_on_a_consistent_result():
    """The checks the pipeline test makes, on results the stage's own functions make from known rounds: the
    library's buckets are the hand counts (short prompts 12 rounds, 22 accepted; the document 5 rounds, 3 accepted)."""
    res, figures = _results()
    check_context_buckets(res, figures, {"<4K": 3, ">=4K": 1})
    lib = res["lib"]["greedy"]["context_buckets"]
    assert (lib["<4K"]["rounds"], lib["<4K"]["accepted"], lib[">=4K"]["rounds"], lib[">=4K"]["accepted"]) == (12, 22, 5, 3)
    assert lib[">=4K"]["accept_rate_pos"] == pytest.approx([2 / 5, 1 / 5, 0])
    assert res["lib"]["greedy"]["tau"] == pytest.approx(1 + 25 / 17)


def _tau_averaged_over_prompts(res, figures):
    rows = [r for r in res["lib_per_prompt"] if r["prompt_tokens"] < 4096]
    res["lib"]["greedy"]["context_buckets"]["<4K"]["tau"] = sum(r["tau_greedy"] for r in rows) / len(rows)


def _a_round_in_two_buckets(res, figures):
    for key in ("rounds", "accepted"):
        res["lib"]["greedy"]["context_buckets"][">=4K"][key] += 1


def _figure_of_the_whole_pass(res, figures):
    figures["tau_vllm_greedy_ctx_ge4K"] = res["vllm"]["greedy"]["tau"]


def _document_bucketed_by_its_answer(res, figures):  # the library placing rounds by tokens generated, not context
    bad = [{**r, "prompt_tokens": 0} for r in LIB_RECORDS]
    from eagle3lib.evaluation.library import summarize_library

    res["lib"] = summarize_library({"records": bad, "baseline_mode": "greedy", "device": "cpu", "dtype": "float32"},
                                   ["greedy"], K, [4096])


def _document_request_counted_short(res, figures):  # vLLM's groups made by another length than the prompt's
    v = res["vllm"]["greedy"]["context_buckets"]
    v["<4K"]["prompts"], v[">=4K"]["prompts"] = 4, 0


def _rates_over_prompts(res, figures):  # acceptance per position as shares of prompts, not of rounds
    b = res["lib"]["greedy"]["context_buckets"]["<4K"]
    b["accept_rate_pos"] = [x * b["rounds"] / 3 for x in b["accept_rate_pos"]]


@pytest.mark.parametrize("wrong", [_tau_averaged_over_prompts, _a_round_in_two_buckets, _figure_of_the_whole_pass,
                                   _document_bucketed_by_its_answer, _document_request_counted_short,
                                   _rates_over_prompts],
                         ids=lambda f: f.__name__.strip("_"))
def test_bucket_checks_catch_a_wrong_result(wrong):
    """Each check fails on the result a plausible wrong implementation writes."""
    res, figures = copy.deepcopy(_results())
    wrong(res, figures)
    with pytest.raises(AssertionError):
        check_context_buckets(res, figures, {"<4K": 3, ">=4K": 1})


def test_a_9k_prompt_lands_in_the_8k_bucket_by_its_length():
    """With the profile's edges [4096, 8192]: the ~9.3K-token document's rounds are all >=8K from the first; a prompt
    of 8,188 tokens starts in 4K-8K and crosses the edge as its answer grows (contexts 8189, 8193, 8194)."""
    b = library_buckets([LIB_RECORDS[3]], "greedy", [4096, 8192], K)
    assert {label: x["rounds"] for label, x in b.items()} == {">=8K": 5}
    b = library_buckets([_lib_record("x", 8188, [3, 0, 2])], "greedy", [4096, 8192], K)
    assert {label: (x["rounds"], x["accepted"]) for label, x in b.items()} == {"4K-8K": (1, 3), ">=8K": (2, 2)}
