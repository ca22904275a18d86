# .venv/bin/python -m pytest -q tests/test_tiny_long.py
"""The tiny-long verifier (builtin:tiny-long, eagle3lib/tiny/long.py): shipped like the other tiny verifiers; its
answers depend on a document thousands of tokens long (edit the fact and the answer follows); and the pipeline on it
(params/tiny-long.yaml through the runner, a ~9K-token sample among short ones): generate through vLLM at 16K context,
extraction and training on the long sample whole, evaluate's tau per context bucket in the library and vLLM."""

from __future__ import annotations

import json
import random

import pytest
import torch

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
        buckets = res[side]["greedy"]["context_buckets"]
        assert set(buckets) == {"<4K", ">=4K"}, buckets
        assert sum(b["rounds"] for b in buckets.values()) == res[side]["greedy"]["rounds"]
        assert e[f"tau_{side}_greedy_ctx_ge4K"] is not None
    assert res["vllm"]["greedy"]["context_buckets"][">=4K"]["prompts"] == 1
    assert e["greedy_same_output_frac_lib_vllm"] >= 0.75  # the library and vLLM decode the same text
