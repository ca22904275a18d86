# .venv/bin/python -m pytest -q tests/test_multi_turn.py
"""`generate.turns: all` (eagle3lib/data/multi_turn.py): every assistant turn regenerated in order, each after the
verifier's own earlier answers. The turn splitting and resume rules on small conversations; then the stage on the
session's vLLM server: the dataset's assistant answers never reach the verifier or the records, a run cut after its
first round (its shard cut there, as a kill leaves it) asks only the second turns, once each, and the loss mask of
the extracted samples covers both regenerated turns."""

from __future__ import annotations

import json

import pytest

from eagle3lib.config.generate import GenerateConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.data.datasets import Conversation
from eagle3lib.data.multi_turn import first_turn, next_turn, resume_turn, segments
from eagle3lib.data.records import iter_generated, latest_records, list_shards

SYS, U1, A1, U2, A2, U3 = ({"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                           {"role": "assistant", "content": "DATASET-1"}, {"role": "user", "content": "u2"},
                           {"role": "assistant", "content": "DATASET-2"}, {"role": "user", "content": "u3"})


def test_turns_are_the_user_runs_and_each_prompt_follows_the_verifiers_answers():
    conv = Conversation("c", [SYS, U1, A1, U2, A2, U3])
    assert segments(conv.messages) == [[SYS, U1], [U2], [U3]]
    t1 = first_turn(conv)
    assert t1.messages == [SYS, U1] and t1.extra == {"turn": 1, "turns": 3, "answered": 0}
    mine = {"role": "assistant", "content": "VERIFIER-1"}
    t2 = next_turn(conv, [SYS, U1, mine], 1, (10, 5))
    assert t2.messages == [SYS, U1, mine, U2] and t2.extra["turn"] == 2 and t2.extra["carried_tokens"] == (10, 5)
    # resume: after a partial record the next turn; after a failed turn 2 the same turn 2, from its own prompt
    assert resume_turn(conv, {"status": "partial", "turn": 1, "messages": [SYS, U1, mine]}).messages == t2.messages
    again = resume_turn(conv, {"status": "failed", "turn": 2, "messages": t2.messages, "prompt_tokens": 10})
    assert again.messages == t2.messages and again.extra["turn"] == 2 and again.extra["answered"] == 3
    assert resume_turn(conv, {"status": "ok", "turn": 3, "messages": []}) is None
    # one turn, or tools (a tool result answers the dataset's own call): the usual last-turn prompt
    assert first_turn(Conversation("one", [U1, A1])) is None
    assert first_turn(Conversation("t", [U1, {"role": "assistant", "content": "", "tool_calls": [{}]},
                                         {"role": "tool", "content": "r"}, U2])) is None


@pytest.mark.slow
def test_every_turn_from_the_verifiers_own_answers_and_a_cut_run_asks_only_the_rest(vllm_server, tmp_path):
    from eagle3lib.generation.engine import generate

    data = tmp_path / "two-turns.jsonl"
    questions = [("What is 3 + 4?", "Is 12 even or odd?"), ("Tell me the capital city of France.", "What color is banana?"),
                 ("What is 5 times 6?", "Which is larger, 7 or 9?")]
    data.write_text("".join(json.dumps({"id": f"m{i}", "messages": [
        {"role": "user", "content": q1}, {"role": "assistant", "content": f"DATASET-{i}"},
        {"role": "user", "content": q2}, {"role": "assistant", "content": "DATASET-LAST"}]}) + "\n"
        for i, (q1, q2) in enumerate(questions)))
    cfg = GenerateConfig(dataset=str(data), turns="all", shuffle=False, max_tokens=96, concurrency=3, progress=False)
    vcfg = VerifierConfig(model=str(vllm_server.model), server_url=vllm_server.base_url)
    out = tmp_path / "gen"
    f = generate(cfg, vcfg, out)["figures"]
    assert f["multi_turn_conversations"] == 3 and f["samples_partial"] == 0 and f["samples_generated"] == 6
    recs = {c.id: c for c in iter_generated(out, statuses=None)}
    for i, (q1, q2) in enumerate(questions):
        msgs = recs[f"m{i}"].messages
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
        assert msgs[0]["content"] == q1 and msgs[2]["content"] == q2
        assert "DATASET" not in json.dumps(msgs)  # the dataset's answers neither asked from nor kept
    lines = [json.loads(x) for x in list_shards(out)[0].read_text().splitlines()]
    assert [r["status"] for r in lines[:3]] == ["partial"] * 3 and [r["turn"] for r in lines[3:]] == [2, 2, 2]

    # a run cut after its first round: the shard as a kill would leave it, then the same command
    cut = tmp_path / "cut"
    cut.mkdir()
    for p in out.iterdir():
        if p.name.startswith("shard-"):
            (cut / p.name).write_text("".join(json.dumps(r) + "\n" for r in lines[:3]))
        elif p.is_file():
            (cut / p.name).write_bytes(p.read_bytes())
    f2 = generate(cfg, vcfg, cut)["figures"]
    assert f2["samples_generated"] == 3 and f2["samples_resumed"] == 0 and f2["samples_ok"] == 3
    again = latest_records(cut)
    first = {r["id"]: r for r in lines[:3]}
    for i in range(3):  # the first answers are the ones the cut run kept: each turn asked once
        assert again[f"m{i}"][0]["messages"][:2] == first[f"m{i}"]["messages"]
        assert again[f"m{i}"][0]["messages"] == recs[f"m{i}"].messages  # greedy: the same conversation

    # extracted: the loss mask holds both regenerated answers
    from transformers import AutoTokenizer

    from eagle3lib.config.extract import ExtractConfig
    from eagle3lib.data.hidden_store import HiddenStateReader
    from eagle3lib.extraction.engine import extract

    ecfg = ExtractConfig(source="generate", backend="hf", progress=False, disk_margin_gib=0.0)
    extract(ecfg, VerifierConfig(model=str(vllm_server.model), dtype="float32"), tmp_path / "ext", gen_dir=out)
    store, tok = HiddenStateReader(tmp_path / "ext"), AutoTokenizer.from_pretrained(vllm_server.model)
    for i, sid in enumerate(store.ids):
        s = store[i]
        masked = tok.decode(s.input_ids[s.loss_mask.bool()])
        answers = [m["content"].strip() for m in recs[sid].messages if m["role"] == "assistant"]
        assert len(answers) == 2 and all(a in masked for a in answers), (sid, masked)
