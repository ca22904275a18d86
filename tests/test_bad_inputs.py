# .venv/bin/python -m pytest -q tests/test_bad_inputs.py
"""Bad input and damaged files, as a new user meets them: every case is a clear message naming the culprit (the key,
file, line or path), no traceback, the right exit code, and what was done before stays byte-identical. Parameters,
datasets, generate records and hidden-state stores; checkpoints and analysis sources: tests/test_bad_checkpoints.py."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from eagle3lib.__main__ import main

FIX = Path(__file__).parent / "fixtures" / "analysis"


def cli(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------------------- params

PARAM_CASES = [  # (--set value, what the one-line message must contain)
    ("train.ttt_steps=0", "'train.ttt_steps': Input should be greater than or equal to 1"),
    ("train.decay=0", "'train.decay': Input should be greater than 0"),
    ("train.packed_row_tokens=-5", "'train.packed_row_tokens': Input should be greater than or equal to 8"),
    ("evaluate.modes=[]", "evaluate.modes: at least one of greedy, sampled"),
    ("train.micro_batch_rows=0", "'train.micro_batch_rows': Input should be greater than or equal to 1"),
    ("train.micro_batch_rows=3", "train.batch_rows (2) must be a multiple of train.micro_batch_rows (3)"),
    ("train.lr=-0.003", "'train.lr': Input should be greater than 0"),
    ("train.epochs=0", "'train.epochs': Input should be greater than 0"),
    ("train.log_every=0", "'train.log_every': Input should be greater than or equal to 1"),
    ("train.num_layers=0", "'train.num_layers': Input should be greater than or equal to 1"),
    ("train.keep_checkpoints=-1", "'train.keep_checkpoints': Input should be greater than or equal to 1"),
    ("train.nproc_per_node=0", "'train.nproc_per_node': Input should be greater than or equal to 1"),
    ("train.betas=[0.9, 1.5]", "'train.betas': AdamW betas must be in [0, 1)"),
    ("train.head_dim=7", "'train.head_dim': Input should be a multiple of 2"),
    ("verifier.aux_layer_ids=[1, 1, 2]", "'verifier.aux_layer_ids': EAGLE-3 takes 3 distinct layer ids"),
    ("verifier.aux_layer_ids=[1, 2]", "'verifier.aux_layer_ids': EAGLE-3 takes 3 distinct layer ids"),
    ("verifier.aux_layer_ids=[5, 2, 4]", "[5, 2, 4] must be in ascending order: vLLM concatenates the auxiliary hidden "
                                         "states in layer order ([2, 4, 5])"),
    ("verifier.gpu_memory_utilization=1.5", "'verifier.gpu_memory_utilization': Input should be less than or equal to 1"),
    ("generate.concurrency=0", "'generate.concurrency': Input should be greater than or equal to 1"),
    ("generate.temperature=-1", "'generate.temperature': Input should be greater than or equal to 0"),
    ("generate.extra_body={model: x}", "are set by the stage itself"),
    # across sections: every request would come back HTTP 400 (the stage used to say "complete" all the same)
    ("generate.max_tokens=4096", "generate.max_tokens (4096) must be below verifier.max_model_len (2048): the server "
                                 "refuses every request"),
    ("extract.max_sample_tokens=4", "'extract.max_sample_tokens': Input should be greater than or equal to 8"),
    ("extract.max_seq_len=100", "'extract.max_seq_len' is now called 'extract.max_sample_tokens'"),
    ("train.max_seq_len=100", "'train.max_seq_len' is now called 'train.packed_row_tokens'"),
    ("evaluate.k=3", "'evaluate.k' is now called 'evaluate.ttt_steps'"),
    ("evaluate.library=false", None),  # alone it is fine; with vllm=false below it is not
    ("train.epoch=3", "unknown key 'train.epoch' (did you mean 'epochs'?)"),
    ("train.learning_rate=1", "unknown key 'train.learning_rate'"),
    ("trian.lr=1", "unknown section 'trian' (did you mean 'train'?)"),
    ("cost_projection.speed_factors={x: 0}", "speed factors must be > 0"),
    ("verifier_report.max_tokens=0", "'verifier_report.max_tokens': Input should be greater than or equal to 1"),
    # a bool where a number goes: pydantic would read true as 1 (one TTT step, without a word)
    ("train.ttt_steps=true", "'train.ttt_steps': expects a number, got true"),
    ("train.lr=false", "'train.lr': expects a number, got false"),
    ("train.max_steps=true", "'train.max_steps': expects a number, got true"),
    ("train.packing=false", None),  # a bool key still takes a bool
    # each of these used to fail in every rank after torchrun had started (~30 lines of ChildFailedError)
    ("cost_projection.sensitivity_range=[0,4]", "'cost_projection.sensitivity_range': expects two "
                                                 "factors 0 < low < high, got [0.0, 4.0]"),
    ("train.lr=inf", "'train.lr': Input should be a finite number"),
    ("train.epochs=.inf", "'train.epochs': Input should be a finite number"),
]


@pytest.mark.parametrize(("setting", "expected"), PARAM_CASES, ids=[c[0] for c in PARAM_CASES])
def test_bad_parameter_is_one_line_naming_the_key(capsys, setting, expected):
    code, err = cli(capsys, "params", "--set", setting)
    if expected is None:
        assert code == 0
        return
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --set") and expected in lines[0], err


def test_several_problems_are_all_reported(capsys):
    code, err = cli(capsys, "params", "--set", "train.lr=0", "--set", "evaluate.library=false",
                    "--set", "evaluate.vllm=false")
    assert code == 2
    assert "'train.lr'" in err and "evaluate.library and evaluate.vllm are both false" in err


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize(("text", "expected"), [
    ("train:\n  lr: 1\n  epochs: 2\n  lr: 2\n", ":4: duplicate key 'train.lr' (also at line 2)"),
    ("train:\n  lr: 1\ntrain:\n  lr: 2\n", ":3: duplicate key 'train' (also at line 1)"),
    ("train:\n  epochs: 3\n  lr: -1\n", ":3: 'train.lr': Input should be greater than 0"),
    ("train:\n  lr: [1\n", "not valid YAML"),
    ("- a\n- b\n", "a profile is a mapping of sections"),
    ("train: 5\n", ":1: section 'train' must be a mapping"),
    ("extract:\n  max_seq_len: 9\n", ":2: 'extract.max_seq_len' is now called 'extract.max_sample_tokens'"),
], ids=["dup-key", "dup-section", "line-of-key", "syntax", "not-mapping", "section-not-mapping", "renamed"])
def test_profile_file_errors_name_file_and_line(capsys, tmp_path, text, expected):
    p = write(tmp_path, text)
    code, err = cli(capsys, "params", "--profile", str(p))
    assert code == 2 and str(p) in err and expected in err, err


@pytest.mark.parametrize(("argv", "expected"), [
    (["params", "--set", "train.lr"], "--set 'train.lr': expected section.key=value"),
    (["params", "--set", "train.lr=[1"], "value is not valid YAML"),
    (["params", "--profile", "/nonexistent/p.yaml"], "profile file not found: /nonexistent/p.yaml"),
    (["params", "--profile", "tiniest"], "unknown profile 'tiniest'"),
    (["run", "--stages", ","], "--stages: no stage given"),
    (["run", "--stages", "generat"], "unknown stage 'generat' (did you mean 'generate'?)"),
    (["run", "--stages", "compare_runs,learning_curves,compare_runs"], "--stages lists compare_runs more than once"),
    (["run", "--run-dir", "", "--stages", "verifier"], "--run-dir is empty"),  # Path("") = the current folder
])
def test_cli_errors(capsys, argv, expected):
    code, err = cli(capsys, *argv)
    assert code == 2 and expected in err, err


def test_stages_run_in_pipeline_order_whatever_order_is_given():
    from eagle3lib.pipeline.runner import select_stages

    assert [s.name for s in select_stages(["cost_projection", "train", "generate"])] == [
        "generate", "train", "cost_projection"]


def test_run_dir_that_is_a_file(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    code, err = cli(capsys, "run", "--run-dir", str(f), "--stages", "verifier")
    assert code == 2 and f"--run-dir {f}: exists and is not a directory" in err and f.read_text() == "x"


def test_bad_parameter_in_run_creates_nothing(capsys, tmp_path):
    run = tmp_path / "run"
    code, err = cli(capsys, "run", "--run-dir", str(run), "--set", "train.epochs=0")
    assert code == 2 and "'train.epochs'" in err and not run.exists()


@pytest.mark.parametrize(("setting", "expected"), [
    ("verifier.aux_layer_ids=[2,4,8]", r"verifier.aux_layer_ids: \[8\] out of range for a verifier with 8 layers .*"
                                       r"Set verifier.aux_layer_ids to 3 distinct ids in 0..7"),
    ("train.drafter_layer=llama", r"train.drafter_layer: llama with an MLA verifier .*No common block size.*"
                                  r"Set train.drafter_layer to mla"),
])
def test_verifier_specific_settings_fail_before_any_server(capsys, tmp_path, tiny_kimi, setting, expected):
    """Checked against the verifier's own config.json (tiny-kimi: 8 layers, MLA) before a server starts or a folder
    is made: the key, the profile and the fix are named."""
    run = tmp_path / "run"
    code, err = cli(capsys, "run", "--profile", "tiny-kimi", "--run-dir", str(run), "--set", setting)
    assert code == 2 and re.search(expected, err) and "params/tiny-kimi.yaml" in err, err
    assert not run.exists()


def test_a_missing_dataset_fails_before_the_verifier_server_starts(capsys, tmp_path):
    """The runner starts one verifier server for generate and evaluate before the stages: a dataset path that does
    not exist is named first (it was found 30 s into a run, after the server was up)."""
    run = tmp_path / "run"
    code, err = cli(capsys, "run", "--run-dir", str(run), "--stages", "generate,extract", "--set",
                    f"generate.dataset={tmp_path / 'none.jsonl'}", "--set", "extract.source=data/absent.jsonl")
    assert code == 2 and f"generate.dataset: no such file: {tmp_path / 'none.jsonl'}" in err, err
    assert f"extract.source: no such file: {Path.cwd() / 'data/absent.jsonl'}" in err and not run.exists()


def test_a_global_batch_the_processes_cannot_share_is_a_parameter_error(capsys):
    code, err = cli(capsys, "params", "--set", "train.nproc_per_node=3")
    assert code == 2 and "tiny.yaml:46: train.batch_rows (2) must be a multiple of processes x micro_batch_rows (3 x 1)" \
        in err, err


@pytest.mark.parametrize(("setting", "expected"), [
    ("train.init_from=/nonexistent/drafter", "train.init_from: no such folder: /nonexistent/drafter"),
    ("train.device=cuda", "train.device: cuda, but this machine has no CUDA device"),
    ("verifier.model=/nonexistent/verifier", "verifier.model: no such folder: /nonexistent/verifier"),  # not "bad hub id"
])
def test_train_settings_this_machine_cannot_run_fail_before_torchrun(capsys, tmp_path, setting, expected):
    """Checked by the runner before any stage (exit 2, nothing made), not in every rank after torchrun's start."""
    if "cuda" in setting and torch.cuda.is_available():
        pytest.skip("a CUDA machine runs train.device=cuda")
    run = tmp_path / "run"
    code, err = cli(capsys, "run", "--run-dir", str(run), "--stages", "train", "--set", setting)
    assert code == 2 and expected in err and "Traceback" not in err and not run.exists(), err


# --------------------------------------------------------------------------------------------------------- datasets


@pytest.mark.parametrize(("content", "expected"), [
    ('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [\n', ":2: not valid JSON"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "x"}\n', ":2: record has neither 'messages'"),
    ('{"messages": [{"role": "robot", "content": "x"}]}\n', ":1: messages[0].role 'robot' is not one of"),
    ('{"conversations": [{"from": "alien", "value": "x"}]}\n', ":1: conversations[0].from 'alien' is not one of"),
    ('[1, 2]\n', ":1: expected a JSON object, got list"),
], ids=["torn-json", "no-messages", "bad-role", "bad-sharegpt-role", "not-object"])
def test_malformed_dataset_record_names_file_and_line(tmp_path, content, expected):
    from eagle3lib.data.datasets import DatasetError, load_conversations

    p = write(tmp_path, content, "d.jsonl")
    with pytest.raises(DatasetError) as e:
        load_conversations(p)
    assert str(e.value).startswith(str(p)) and expected in str(e.value)


def test_damaged_parquet_and_binary_jsonl_name_the_file(tmp_path):
    from eagle3lib.data.datasets import DatasetError, load_conversations

    pq = tmp_path / "d.parquet"
    pq.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(DatasetError, match=rf"{pq}: not a readable Parquet file"):
        load_conversations(pq)
    binary = tmp_path / "b.jsonl"
    ok = b'{"messages": [{"role": "user", "content": "hi"}]}\n'
    binary.write_bytes(ok + b'\xff\xfe\n' + ok.replace(b"hi", b"ho"))
    with pytest.raises(DatasetError, match=rf"{binary}:2: not UTF-8 text \(byte 0 of the line\)"):  # a line, not a byte offset
        load_conversations(binary)
    assert len(load_conversations(binary, on_bad_record="skip")) == 2  # honoured like any other bad line


def test_a_byte_order_mark_is_read_and_a_json_array_is_named(tmp_path):
    """Windows editors start a file with a UTF-8 BOM: read it. A pretty-printed JSON array is not JSONL: say so (was:
    "line 1: not valid JSON")."""
    from eagle3lib.data.datasets import DatasetError, load_conversations

    rec = {"messages": [{"role": "user", "content": "hi"}]}
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(rec).encode() + b"\n")
    assert [c.messages for c in load_conversations(bom)] == [rec["messages"]]
    array = write(tmp_path, json.dumps([rec, rec], indent=2), "array.jsonl")
    with pytest.raises(DatasetError, match=rf"{array}: a JSON array .*JSONL, one JSON object per line"):
        load_conversations(array)


def test_parquet_messages_stored_as_a_json_string_are_read(tmp_path):
    """Parquet exports often keep `messages` as a JSON string: read it (was: "messages[0] has no 'role'")."""
    import polars as pl

    from eagle3lib.data.datasets import DatasetError, load_conversations

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    pq = tmp_path / "d.parquet"
    pl.DataFrame({"messages": [json.dumps(turns), "not json"]}).write_parquet(pq)
    with pytest.raises(DatasetError, match=rf"{pq}:2: 'messages' is a string that is not a JSON list"):
        load_conversations(pq)
    assert [c.messages for c in load_conversations(pq, on_bad_record="skip")] == [turns]


def test_duplicate_ids_name_both_lines(tmp_path):
    from eagle3lib.config.generate import GenerateConfig
    from eagle3lib.data.datasets import DatasetError
    from eagle3lib.data.prompt_set import load_prompts

    p = write(tmp_path, "".join(json.dumps({"id": "a", "messages": [{"role": "user", "content": c}]}) + "\n"
                                for c in ("x", "y")), "d.jsonl")
    with pytest.raises(DatasetError, match=rf"{p}:2: id 'a' already used at {p}:1"):
        load_prompts(GenerateConfig(dataset=str(p), shuffle=False))


def test_prompts_whose_user_turn_is_empty_are_skipped_and_counted(tmp_path):
    """Empty or null user content was sent, answered and kept as training data (ids x, x-2: the same empty prompt)."""
    from eagle3lib.config.generate import GenerateConfig
    from eagle3lib.data.prompt_set import load_prompts

    turns = [[{"role": "user", "content": None}], [{"role": "user", "content": "  "}],
             [{"role": "system", "content": "be brief"}, {"role": "user", "content": ""}],
             [{"role": "user", "content": ""}, {"role": "assistant", "content": "?"}, {"role": "user", "content": "hi"}]]
    p = write(tmp_path, "".join(json.dumps({"messages": t}) + "\n" for t in turns), "d.jsonl")
    got = load_prompts(GenerateConfig(dataset=str(p), shuffle=False))
    assert got.skipped_empty_user_turn == 3 and [c.messages[-1]["content"] for c in got.items] == ["hi"]


def test_agentic_records_keep_tool_calls_and_bad_calls_are_named(tmp_path):
    """Tool-call turns lost `tool_calls` / `tool_call_id` and the record's `tools` (the verifier saw an empty assistant
    turn, then a bare tool turn); the prompt to answer ended at the last user turn, dropping the tool's result."""
    from eagle3lib.config.generate import GenerateConfig
    from eagle3lib.data.datasets import DatasetError, load_conversations
    from eagle3lib.data.prompt_set import load_prompts

    src = Path(__file__).parent / "fixtures" / "tools" / "agentic.jsonl"
    got = load_prompts(GenerateConfig(dataset=str(src), shuffle=False))
    weather, add, story = got.items
    assert got.skipped_empty_user_turn == 1
    assert [m["role"] for m in weather.messages] == ["user", "assistant", "tool"]  # answers the tool's result
    call = weather.messages[1]["tool_calls"][0]
    assert call == {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert weather.messages[2] == {"role": "tool", "content": '{"temp_c": 18, "sky": "cloudy"}',
                                  "tool_call_id": "call_1", "name": "get_weather"}
    assert weather.tools[0]["function"]["name"] == "get_weather" and "tools" not in weather.extra
    assert add.messages[2]["tool_calls"][0]["function"]["arguments"] == '{"a": 12, "b": 30}'  # an object, as text
    assert story.tools is None and story.messages[-1]["role"] == "user"
    bad = [{"role": "user", "content": "hi"},
           {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}]
    p = write(tmp_path, json.dumps({"messages": [{"role": "user", "content": "ok"}]}) + "\n" +
              json.dumps({"messages": bad}) + "\n", "d.jsonl")
    with pytest.raises(DatasetError, match=rf"{p}:2: messages\[1\].tool_calls\[0\].function.arguments is not"):
        load_conversations(p)
    assert len(load_conversations(p, on_bad_record="skip")) == 1
    p2 = write(tmp_path, json.dumps({"tools": {"name": "f"}, "messages": [{"role": "user", "content": "x"}]}) + "\n",
               "t.jsonl")
    with pytest.raises(DatasetError, match=rf"{p2}:1: 'tools' must be a list"):
        load_conversations(p2)


def test_empty_dataset_is_an_error_before_any_server(tmp_path):
    from eagle3lib.config.generate import GenerateConfig
    from eagle3lib.config.verifier import VerifierConfig
    from eagle3lib.data.datasets import DatasetError
    from eagle3lib.generation.engine import generate

    p = write(tmp_path, "", "empty.jsonl")
    with pytest.raises(DatasetError, match=rf"generate.dataset {p}: no prompt to answer .*allow_empty"):
        generate(GenerateConfig(dataset=str(p)), VerifierConfig(model="unused"), tmp_path / "out")
    assert not (tmp_path / "out" / "shard-00000.jsonl").exists()


# ----------------------------------------------------------------------------------------------- generate records


def test_torn_line_in_the_middle_of_a_shard_is_counted_and_located(tmp_path):
    from eagle3lib.data.records import ReadStats, iter_generated

    shard = tmp_path / "shard-00000.jsonl"
    good = {"id": "a", "status": "ok", "messages": [{"role": "user", "content": "q"},
                                                   {"role": "assistant", "content": "x"}]}
    shard.write_text(json.dumps(good) + "\n" + '{"id": "b", "sta\n' + json.dumps({**good, "id": "c"}) + "\n")
    stats = ReadStats()
    assert [c.id for c in iter_generated(tmp_path, stats=stats)] == ["a", "c"]
    assert stats.torn_lines == 1 and stats.torn_at == ["shard-00000.jsonl:2"]


def test_a_deleted_settings_key_does_not_let_other_settings_extend_the_records(tmp_path):
    """generate_key.json deleted mid-run: the run continued with other settings and certified the mixture (498 records
    at temperature 0 with 22 at 0.7), although the manifest held the old settings. Now those are the reference."""
    from eagle3lib.config.generate import GenerateConfig
    from eagle3lib.config.verifier import VerifierConfig
    from eagle3lib.core.manifest import StageTimer
    from eagle3lib.generation.records import GenerateError
    from eagle3lib.generation.run_key import KEY_FILE, check_run_key, run_key

    gen, v = tmp_path / "generate", VerifierConfig(model="builtin:tiny")
    old = GenerateConfig(dataset="builtin:tiny-train", temperature=0.0, max_tokens=512)
    StageTimer(gen, {"generate": old.model_dump(mode="json")})  # what the first run recorded when it started
    (gen / "shard-00000.jsonl").write_text('{"id": "a", "status": "ok"}\n')
    new = old.model_copy(update={"temperature": 0.7})
    with pytest.raises(GenerateError, match=r"other settings \(temperature: 0.0 -> 0.7\)"):
        check_run_key(gen, run_key(new, v))
    assert not (gen / KEY_FILE).exists()
    check_run_key(gen, run_key(old, v))  # the same settings resume
    (gen / KEY_FILE).unlink()
    (gen / "manifest.json").unlink()
    with pytest.raises(GenerateError, match=r"holds records, but neither generate_key.json nor its manifest"):
        check_run_key(gen, run_key(old, v))


# ---------------------------------------------------------------------------------------------- hidden-state store


def _store(root: Path, n_shards: int = 3) -> Path:
    from eagle3lib.data.hidden_store import HiddenSample, HiddenStateWriter

    meta = {"verifier": "x", "hidden_size": 8, "vocab_size": 64, "num_layers": 8, "aux_layer_ids": [2, 4, 5]}
    with HiddenStateWriter(root, meta, samples_per_shard=2) as w:
        for i in range(2 * n_shards):
            w.add(HiddenSample(f"s{i}", torch.arange(5), torch.ones(5, dtype=torch.bool), torch.zeros(5, 3, 8).bfloat16(),
                               torch.zeros(5, 8).bfloat16()))
    return root


def test_truncated_shard_named_by_the_reader(tmp_path):
    from eagle3lib.data.hidden_store import HiddenStateReader, StoreError

    root = _store(tmp_path / "store")
    shard = root / "shards" / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    r = HiddenStateReader(root)
    assert r[0].sample_id == "s0"  # the other shards still read
    with pytest.raises(StoreError, match=rf"{shard}: cannot read this hidden-state shard .*run the extract stage again"):
        r[2]


def test_resume_sets_a_damaged_shard_aside_and_redoes_its_samples(tmp_path):
    from eagle3lib.data.hidden_store import HiddenStateWriter

    root = _store(tmp_path / "store")
    shard = root / "shards" / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    kept = {p.name: p.read_bytes() for p in (root / "shards").glob("shard-0000[02].safetensors")}
    w = HiddenStateWriter(root, json.loads((root / "store.json").read_text()), samples_per_shard=2)
    assert w.damaged == ["shard-00001.safetensors"] and w.done_ids == {"s0", "s1", "s4", "s5"}
    assert (root / "shards" / ".damaged-shard-00001.safetensors").exists()
    assert "shard-00001" not in (root / "index.jsonl").read_text()
    assert {p.name: p.read_bytes() for p in (root / "shards").glob("shard-0000[02].safetensors")} == kept


@pytest.mark.parametrize("damage", ["store.json removed", "shard cut short", "shard deleted"])
def test_a_damaged_store_is_not_skipped_as_complete(tmp_path, damage):
    """extract said "complete, skipped" over a damaged store and train said "run the extract stage again", which did
    nothing. The runner now sees the damage (names and sizes) and runs extract again, whose resume sets the damaged
    shards aside and extracts only their samples (the test above)."""
    from eagle3lib.config.stages import get_stage
    from eagle3lib.core.manifest import StageTimer
    from eagle3lib.pipeline.plan import damaged_outputs

    root = _store(tmp_path / "extract")
    m = StageTimer(root, {}).finish({"samples": 6})
    assert damaged_outputs(root, m, get_stage("extract")) is None
    shard = root / "shards" / "shard-00001.safetensors"
    if damage == "store.json removed":
        (root / "store.json").unlink()
        want = "store.json is missing"
    elif damage == "shard cut short":
        shard.write_bytes(shard.read_bytes()[:-10])
        want = r"1 shard\(s\) missing or damaged \(shard-00001.safetensors\); 2 of its 6 samples are not in a sound shard"
    else:
        shard.unlink()
        want = r"1 shard\(s\) missing or damaged \(shard-00001.safetensors\)"
    assert re.search(rf"its store is damaged \(.*{want}", damaged_outputs(root, m, get_stage("extract")))


def test_unindexed_garbage_shard_named(tmp_path):
    from eagle3lib.data.hidden_store import HiddenStateReader, StoreError

    root = _store(tmp_path / "store", 1)
    junk = root / "shards" / "shard-00007.safetensors"
    junk.write_bytes(b"\0" * 64)
    with pytest.raises(StoreError, match=rf"{junk}: damaged hidden-state shard"):
        HiddenStateReader(root)


def test_store_of_another_verifier_is_refused_and_left_alone(tmp_path):
    from eagle3lib.data.hidden_store import HiddenStateWriter, StoreError

    root = _store(tmp_path / "store", 1)
    before = tree_digest(root)
    meta = {"verifier": "x", "hidden_size": 16, "vocab_size": 64, "num_layers": 8, "aux_layer_ids": [2, 4, 5]}
    with pytest.raises(StoreError, match=r"hidden_size: stored 8, now 16"):
        HiddenStateWriter(root, meta)
    assert tree_digest(root) == before
