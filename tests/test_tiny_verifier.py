# Run: .venv/bin/python -m pytest tests/test_tiny_verifier.py -q
"""The embedded verifier is a real, structured chat model: loads in HF, served by vLLM with a reasoning parser,
answers held-out prompts with reasoning and content, stops, and does not loop."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from eagle3lib.data.datasets import load_conversations
from eagle3lib.tiny import corpus
from eagle3lib.tiny.build import SHIPPED, shipped_key
from eagle3lib.tiny.recipe import FIRST_LOSSES, TinyRecipe, build_tiny_verifier, recipe_key
from eagle3lib.vllm.client import chat_once


def max_ngram_repeats(ids: list[int], n: int = 6) -> int:
    grams = Counter(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))
    return max(grams.values(), default=0)


def test_corpus_is_deterministic_and_varied():
    assert corpus.sample(1, 5) == corpus.sample(1, 5)
    texts = {json.dumps(corpus.sample(1, i)["messages"]) for i in range(200)}
    assert len(texts) > 190
    assert {corpus.sample(1, i)["category"] for i in range(50)} == {"math", "code", "chat"}


def test_recipe_key_is_stable_and_sensitive():
    assert recipe_key(TinyRecipe()) == recipe_key(TinyRecipe())
    assert recipe_key(TinyRecipe()) != recipe_key(TinyRecipe(steps=1))


def test_recipe_key_ignores_comments_and_docstrings(tmp_path):
    from eagle3lib.tiny.recipe import _code_fingerprint

    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text('def f(x):\n    """Doc."""\n    return x + 1\n')
    b.write_text("def f(x):  # a comment\n    return x + 1\n")
    c.write_text("def f(x):\n    return x + 2\n")
    assert _code_fingerprint(a) == _code_fingerprint(b) != _code_fingerprint(c)


@pytest.mark.slow
def test_shipped_verifier_is_this_recipe(tmp_path):
    """The package ships the built weights so a first run does not train for minutes; a rebuild from the recipe must
    give the same tokenizer byte for byte and the same first training losses (the weights follow deterministically)."""
    key = recipe_key(TinyRecipe())
    assert shipped_key() == key, ("the recipe changed since the shipped verifier was built; rebuild and ship it: "
                                  "python -m eagle3lib build-verifier --ship")
    rebuilt = build_tiny_verifier(TinyRecipe(), tmp_path, progress=False, max_steps=FIRST_LOSSES)
    shipped = json.loads((SHIPPED / "build_report.json").read_text())
    # rel 1e-4: another CPU's fp32 kernels may sum in another order; a recipe change moves these by far more
    assert rebuilt["first_losses"] == pytest.approx(shipped["first_losses"], rel=1e-4, abs=1e-6)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (SHIPPED / name).read_bytes(), name


def test_architecture_and_build_report(tiny_verifier):
    cfg = AutoConfig.from_pretrained(tiny_verifier)
    assert cfg.model_type == "qwen3" and cfg.num_hidden_layers >= 7
    report = json.loads((tiny_verifier / "build_report.json").read_text())
    assert 1e6 < report["parameters"] < 2e7
    # Held-out loss on assistant tokens: the answers are learned (a random model sits at ln(vocab) ~ 7.3).
    assert report["heldout_loss"] < 1.0, report["heldout_loss"]


def test_chat_template_masks_assistant_tokens_and_supports_enable_thinking(tiny_verifier):
    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    msgs = [{"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "2 + 3 = 5.", "reasoning_content": "I add."}]
    enc = tok.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True)
    masked = tok.decode([t for t, m in zip(enc["input_ids"], enc["assistant_masks"], strict=True) if m])
    assert masked == "<think>\nI add.\n</think>\n\n2 + 3 = 5.<|im_end|>"
    off = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert len(tok.encode("<think>")) == 1 and len(tok.encode("</think>")) == 1  # the reasoning parser needs single tokens


def test_greedy_answers_are_structured_not_looping(tiny_verifier):
    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier, dtype=torch.float32).eval()
    outs = []
    for conv in load_conversations("builtin:tiny-heldout", max_samples=8):
        ids = tok.apply_chat_template(conv.prompt(), add_generation_prompt=True, return_tensors="pt", return_dict=True)
        gen = model.generate(**ids, max_new_tokens=200, do_sample=False)[0, ids["input_ids"].shape[1] :].tolist()
        assert gen[-1] in (tok.eos_token_id, tok.pad_token_id), f"did not stop: {tok.decode(gen)!r}"
        assert max_ngram_repeats(gen) <= 2, f"loops: {tok.decode(gen)!r}"
        text = tok.decode(gen)
        assert text.startswith("<think>\n") and "</think>" in text, text
        outs.append(text)
    assert len(set(outs)) >= len(outs) - 2  # answers depend on the prompt (greetings share one fixed answer)


@pytest.mark.slow
def test_served_by_vllm_with_reasoning_parser(vllm_server):
    ep = vllm_server.endpoint()
    conv = load_conversations("builtin:tiny-heldout", max_samples=3)
    for c in conv:
        r = chat_once(ep, c.prompt(), max_tokens=200)
        assert r.finish_reason == "stop" and r.reasoning and r.content, r
        assert "<think>" not in r.content and "</think>" not in (r.reasoning or "")
    off = chat_once(ep, conv[0].prompt(), max_tokens=200, chat_template_kwargs={"enable_thinking": False})
    assert off.content and not (off.reasoning or "").strip(), off
