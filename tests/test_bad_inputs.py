# .venv/bin/python -m pytest -q tests/test_bad_inputs.py
"""Bad input and damaged files, as a new user meets them: every case is a clear message naming the culprit (the key,
file, line or path), no traceback, the right exit code, and what was done before stays byte-identical."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
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
    from eagle3lib.stages.generate import load_prompts

    p = write(tmp_path, "".join(json.dumps({"id": "a", "messages": [{"role": "user", "content": c}]}) + "\n"
                                for c in ("x", "y")), "d.jsonl")
    with pytest.raises(DatasetError, match=rf"{p}:2: id 'a' already used at {p}:1"):
        load_prompts(GenerateConfig(dataset=str(p), shuffle=False))


def test_prompts_whose_user_turn_is_empty_are_skipped_and_counted(tmp_path):
    """Empty or null user content was sent, answered and kept as training data (ids x, x-2: the same empty prompt)."""
    from eagle3lib.config.generate import GenerateConfig
    from eagle3lib.stages.generate import load_prompts

    turns = [[{"role": "user", "content": None}], [{"role": "user", "content": "  "}],
             [{"role": "system", "content": "be brief"}, {"role": "user", "content": ""}],
             [{"role": "user", "content": ""}, {"role": "assistant", "content": "?"}, {"role": "user", "content": "hi"}]]
    p = write(tmp_path, "".join(json.dumps({"messages": t}) + "\n" for t in turns), "d.jsonl")
    got = load_prompts(GenerateConfig(dataset=str(p), shuffle=False))
    assert got.skipped_empty_user_turn == 3 and [c.messages[-1]["content"] for c in got.items] == ["hi"]


def test_empty_dataset_is_an_error_before_any_server(tmp_path):
    from eagle3lib.config.generate import GenerateConfig
    from eagle3lib.config.verifier import VerifierConfig
    from eagle3lib.data.datasets import DatasetError
    from eagle3lib.stages.generate import generate

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
    from eagle3lib.stages.generate import KEY_FILE, GenerateError, check_run_key, run_key

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
    from eagle3lib.core.manifest import StageTimer
    from eagle3lib.pipeline.runner import damaged_outputs

    root = _store(tmp_path / "extract")
    m = StageTimer(root, {}).finish({"samples": 6})
    assert damaged_outputs(root, m) is None
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
    assert re.search(rf"its store is damaged \(.*{want}", damaged_outputs(root, m))


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


# ------------------------------------------------------------------------------------------------------ checkpoints


def _checkpoint(path: Path) -> Path:
    from eagle3lib.model.checkpoint import save_drafter
    from eagle3lib.model.drafter import DrafterConfig, Eagle3Drafter

    cfg = DrafterConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=8, vocab_size=64, draft_vocab_size=32)
    d = Eagle3Drafter(cfg)
    d.set_vocab(torch.arange(32) * 2)
    return save_drafter(d.state_dict(), cfg, path, training_state={"step": 1})


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda c: c.pop("speculators_config"), "no speculators_config"),
    (lambda c: c.update(model_type="llama"), "a top-level model_type"),
    (lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"),
     "no speculators_config.proposal_methods[0].speculative_tokens"),
    (lambda c: c["transformer_layer_config"].pop("hidden_size"), "no transformer_layer_config.hidden_size"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3, 4]), "must list 3 layers"),
], ids=["no-speculators-config", "model-type", "no-k", "no-hidden", "four-aux"])
def test_checkpoint_vllm_cannot_load_is_named_before_any_server(tmp_path, damage, expected):
    from eagle3lib.model.checkpoint import CheckpointError, check_servable

    ck = _checkpoint(tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    damage(cfg)
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        check_servable(ck)
    assert str(ck / "config.json") in str(e.value) and expected in str(e.value)


@pytest.mark.parametrize("layout", ["speculators", "eagle"])
def test_unsorted_aux_layer_ids_are_refused_at_every_edge(tmp_path, layout):
    """One rule for the order of the auxiliary layers (ascending, the order vLLM concatenates them in): a drafter whose
    config lists them otherwise is refused by name wherever it enters: vLLM's decoder (check_servable, before a server),
    the library's decoder (load_drafter), training (train.init_from); extraction and training take their ids from the
    profile, refused above (PARAM_CASES) and in the function every stage calls."""
    from eagle3lib.model.checkpoint import CheckpointError, check_servable, load_drafter
    from eagle3lib.model.interop import convert_drafter, read_init_source
    from eagle3lib.model.verifier import aux_layer_ids

    with pytest.raises(ValueError, match=r"verifier.aux_layer_ids \[5, 2, 4\] must be in ascending order"):
        aux_layer_ids([5, 2, 4], 8)
    ck = _checkpoint(tmp_path / "ck")
    if layout == "eagle":
        ck = convert_drafter(ck, "eagle", tmp_path / "eagle")
    cfg = json.loads((ck / "config.json").read_text())
    if layout == "eagle":
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [5, 2, 4]
    else:
        cfg["eagle_aux_hidden_state_layer_ids"] = [5, 2, 4]
    (ck / "config.json").write_text(json.dumps(cfg))
    for enter in (check_servable, load_drafter, read_init_source):
        with pytest.raises(CheckpointError, match=r"eagle_aux_hidden_state_layer_ids \[5, 2, 4\] must be in ascending"):
            enter(ck)


def test_checkpoint_weights_checked_before_any_server(tmp_path):
    from safetensors.torch import load_file, save_file

    from eagle3lib.model.checkpoint import CheckpointError, check_servable

    ck = _checkpoint(tmp_path / "ck")
    assert check_servable(ck).draft_vocab_size == 32
    weights = ck / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: v for k, v in tensors.items() if k != "d2t"}, str(weights))
    with pytest.raises(CheckpointError, match=r"d2t missing, expected \[32\]"):
        check_servable(ck)
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=rf"{weights}: damaged weights"):
        check_servable(ck)


def test_pickled_training_state_is_refused(tmp_path):
    import pickle

    from eagle3lib.model.checkpoint import CheckpointError, load_training_state

    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    ck = _checkpoint(tmp_path / "ck")
    (ck / "training_state.pt").write_bytes(pickle.dumps({"step": 1, "x": Evil()}))
    with pytest.raises(CheckpointError, match=rf"{ck / 'training_state.pt'}: cannot read the training state"):
        load_training_state(ck)


# ----------------------------------------------------------------------------------------------- analysis sources


@pytest.mark.parametrize(("content", "expected"), [
    (None, "metrics file not found"),
    ("", "the metrics file is empty"),
    ("hello\nworld\n", "no metrics lines"),
], ids=["missing", "empty", "no-metrics"])
def test_learning_curve_source_errors_name_the_file(tmp_path, content, expected):
    from eagle3lib.analysis.curves import load_run
    from eagle3lib.analysis.log_sources import expand_sources

    p = tmp_path / "metrics.jsonl"
    if content is not None:
        p.write_text(content)
    with pytest.raises(ValueError, match=expected) as e:
        load_run(expand_sources([str(p)], p)[0])
    assert str(p) in str(e.value)


# ----------------------------------------------------------------------------------------------- nothing is lost


def _complete_stage(run: Path, name: str, files: dict[str, str]) -> None:
    from eagle3lib.core.manifest import StageTimer

    d = run / name
    d.mkdir(parents=True)
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    StageTimer(d, {"profile": "tiny"}).finish({"samples": 1})


@pytest.mark.slow
def test_forced_rerun_that_fails_restores_the_finished_outputs(tmp_path):
    """The two data-loss cases: a forced generate with a dataset that does not exist must not delete the finished
    responses, and the extract stage after it must not count that failed attempt as new input."""
    run = tmp_path / "run"
    _complete_stage(run, "generate", {"shard-00000.jsonl": '{"id": "a", "status": "ok"}\n'})
    _complete_stage(run, "extract", {})
    _store(run / "extract")  # a sound store (a damaged one is extracted again: the next test)
    before = {s: tree_digest(run / s) for s in ("generate", "extract")}
    r = subprocess.run([sys.executable, "-m", "eagle3lib", "run", "--run-dir", str(run), "--stages", "generate",
                        "--force", "--set", f"generate.dataset={tmp_path / 'missing.jsonl'}"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "dataset not found" in r.stderr and "were restored" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert tree_digest(run / "generate") == before["generate"]
    r = subprocess.run([sys.executable, "-m", "eagle3lib", "run", "--run-dir", str(run), "--stages", "extract"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "extract: complete, skipped" in r.stderr, r.stderr
    assert tree_digest(run / "extract") == before["extract"]
    assert not list(run.glob(".*previous*"))


def test_stale_downstream_stage_is_redone_only_after_a_completed_upstream(tmp_path):
    import time

    from eagle3lib.core.manifest import StageTimer, update_manifest
    from eagle3lib.pipeline.runner import stale_reason

    run = tmp_path / "run"
    _complete_stage(run, "generate", {"shard-00000.jsonl": "{}\n"})
    time.sleep(1.1)
    _complete_stage(run, "extract", {"store.json": "{}"})
    time.sleep(1.1)
    StageTimer(run / "generate", {})  # a later attempt of generate...
    update_manifest(run / "generate", status="failed", finished_at="2099-01-01T00:00:00+00:00")  # ...that failed
    assert stale_reason(run, "extract") is None
    StageTimer(run / "generate", {}).finish({})  # one that completed
    assert "generate was re-run after it" in stale_reason(run, "extract")


@pytest.mark.parametrize(("manifest", "expected"), [
    ("[]", r"extract/manifest.json: damaged \(a JSON list where a manifest object belongs\)"),
    ('{"status": "complete", "completed_at": 5}', r"extract/manifest.json: completed_at is 5, not an ISO time"),
])
def test_a_damaged_upstream_manifest_is_an_error_and_deletes_nothing(capsys, tmp_path, manifest, expected):
    """A manifest of the wrong shape was read as "no manifest": extract re-ran with 0 samples and the train stage, its
    input "re-made", deleted a finished training run. Now: one line naming the file, exit 2, nothing touched."""
    run = tmp_path / "run"
    _complete_stage(run, "train", {"final/model.safetensors": "weights", "metrics.jsonl": "{}\n"})
    (run / "extract").mkdir()
    (run / "extract" / "manifest.json").write_text(manifest)
    before = tree_digest(run)
    code = main(["run", "--run-dir", str(run), "--stages", "train"])
    err = capsys.readouterr().err
    assert code == 2 and re.search(expected, err) and "Traceback" not in err, err
    assert tree_digest(run) == before


def test_a_second_run_of_a_stage_on_the_same_run_dir_stops_naming_the_first(capsys, tmp_path):
    """Two `run --stages train` on one run dir both trained (the second resumed from the first's checkpoint: 172
    metrics records for 120 steps, final/ from whichever wrote last). Now the second stops at once, naming the first."""
    import os

    from eagle3lib.core.stage_lock import stage_lock

    run = tmp_path / "run"
    _complete_stage(run, "train", {"final/model.safetensors": "weights", "metrics.jsonl": "{}\n"})
    before = tree_digest(run / "train")
    with stage_lock(run, "train"):  # what the first run holds while it trains (an flock: a second open conflicts)
        code = main(["run", "--run-dir", str(run), "--stages", "train", "--force"])
    err = capsys.readouterr().err
    assert code == 2 and f"the train stage is being run by pid {os.getpid()}" in err, err
    assert tree_digest(run / "train") == before
    with stage_lock(run, "train"):  # released when the holder ends (or dies: the kernel drops an flock)
        pass


@pytest.mark.slow
def test_force_starts_over_a_stage_whose_manifest_is_damaged(capsys, tmp_path):
    """A truncated manifest blocked even --force ("not valid JSON"); --force now sets the folder aside and runs."""
    run = tmp_path / "run"
    (run / "verifier").mkdir(parents=True)
    (run / "verifier" / "manifest.json").write_text('{"status": "comp')
    assert main(["run", "--run-dir", str(run), "--stages", "verifier"]) == 2  # without --force: named, kept
    assert "verifier/manifest.json: not valid JSON" in capsys.readouterr().err
    code = main(["run", "--run-dir", str(run), "--stages", "verifier", "--force", "--set", "verifier_report.serve=false"])
    assert code == 0 and json.loads((run / "verifier" / "manifest.json").read_text())["status"] == "complete"


def test_serve_on_a_port_in_use_is_one_line(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "eagle3lib", "serve", "--port", str(port)], capture_output=True,
                           text=True, timeout=120)
    assert r.returncode == 2 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_server_url_that_is_not_vllm_is_named_without_its_html(tmp_path):
    """verifier.server_url at another HTTP server (a web page, a proxy's error page) printed the HTML; now the key, the
    status and the page's text in one line."""
    import threading
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    from eagle3lib.config.verifier import VerifierConfig
    from eagle3lib.vllm.endpoint import ServerError, verifier_endpoint

    (tmp_path / "index.html").write_text("<html><head><style>p{}</style></head><body><h1>Welcome</h1></body></html>")

    class Quiet(SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(tmp_path), **kw)

        def log_message(self, *a):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}"
    try:
        with pytest.raises(ServerError) as e:
            verifier_endpoint(VerifierConfig(model="builtin:tiny", server_url=url), 5.0)
    finally:
        httpd.shutdown()
    msg = str(e.value)
    assert msg.startswith(f"verifier.server_url: {url}/v1/models answered HTTP 404 (text/html: ") and "<" not in msg, msg
    assert msg.endswith("is it a vLLM (OpenAI API) server?") and len(msg) < 400


def test_the_cause_of_a_rank_failure_is_found_in_torchruns_output():
    """The line that says why, out of a rank's traceback and torchrun's own report (the shapes torch 2.13 prints)."""
    from eagle3lib.core.torchrun import failure_cause

    traceback = ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "loop.py", line 9, in train',
                 "[rank1]:     raise ValueError('bad')", "[rank1]: ValueError: the store has 3 samples",
                 "E1203 12:00:00.000 torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: 1)",
                 "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "  exitcode  : 1 (pid: 7)"]
    assert failure_cause(traceback) == "ValueError: the store has 3 samples"
    assert failure_cause(["[train] error: train.init_from: no such folder", *traceback]) == "train.init_from: no such folder"
    assert failure_cause(["Killed", "  exitcode  : -9 (pid: 7)"]) is None  # the caller says "exit code -9"


@pytest.mark.slow
def test_a_failing_rank_is_one_line_with_torchruns_report_in_the_log(tiny_verifier, tmp_path):
    """A rank that fails under torchrun: its one-line cause, and the ~30 lines of torchrun's ChildFailedError in
    train/train.log instead of in the error (a memory budget the step does not fit: known to a rank only). A
    validation split that leaves no training samples is known from the store's index: refused before torchrun."""
    from train_fixtures import cached_store, make_run_dir

    from eagle3lib.config.stages import open_stage
    from eagle3lib.training.launch import launch
    from eagle3lib.training.setup import TrainingError

    run = make_run_dir(tmp_path / "run", cached_store(tiny_verifier, 300))
    split = {"train.nproc_per_node": 2, "train.val_fraction": 0.999, "train.val_max_samples": 1000}
    with pytest.raises(TrainingError, match=r"train.val_fraction=0.999: the validation split takes all 300 samples"):
        launch(open_stage("train", "tiny", run, split), echo=lambda _l: None)
    assert not (run / "train" / "train.log").exists()  # no process was started
    with pytest.raises(TrainingError) as e:
        launch(open_stage("train", "tiny", run, {"train.nproc_per_node": 2, "train.memory_gb": 0.001}),
               echo=lambda _l: None)
    msg = str(e.value)
    assert re.fullmatch(r"training failed: \w+: .*train\.memory_gb.* \(every process's output: \S+/train/train.log\)",
                        msg, re.S) and "\n" not in msg, msg
    assert "ChildFailedError" in (run / "train" / "train.log").read_text()


# ------------------------------------------------------------------------------------------------------ disk full


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs, where this machine lets root mount one."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or r.returncode}): disk-full cases not run")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_during_a_shard_keeps_the_complete_shards(tiny_disk):
    from eagle3lib.data.hidden_store import HiddenSample, HiddenStateReader, HiddenStateWriter, StoreError

    root = tiny_disk / "store"
    meta = {"verifier": "x", "hidden_size": 64, "vocab_size": 64, "num_layers": 8, "aux_layer_ids": [2, 4, 5]}
    w = HiddenStateWriter(root, meta, samples_per_shard=1)
    w.add(HiddenSample("s0", torch.arange(100), torch.ones(100, dtype=torch.bool), torch.zeros(100, 3, 64).bfloat16(),
                       torch.zeros(100, 64).bfloat16()))
    before = tree_digest(root)
    with pytest.raises(StoreError, match=r"shard-00001.safetensors: cannot write the shard .*MiB free on that disk.*"
                                         r"keeps its 1 complete shards"):
        w.add(HiddenSample("s1", torch.arange(2000), torch.ones(2000, dtype=torch.bool),
                           torch.zeros(2000, 3, 64).bfloat16(), torch.zeros(2000, 64).bfloat16()))
    assert tree_digest(root) == before and not list((root / "shards").glob(".*.tmp"))
    assert HiddenStateReader(root).ids == ["s0"]


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tiny_disk, tmp_path):
    from eagle3lib.model.checkpoint import CheckpointError, list_checkpoints, save_drafter
    from eagle3lib.model.drafter import DrafterConfig, Eagle3Drafter

    small = DrafterConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=8, vocab_size=64, draft_vocab_size=32)
    d = Eagle3Drafter(small)
    d.set_vocab(torch.arange(32) * 2)
    root = tiny_disk / "checkpoints"
    save_drafter(d.state_dict(), small, root / "step_00000001", {"step": 1})
    before = tree_digest(root)
    big = DrafterConfig(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=128, vocab_size=64, draft_vocab_size=32)
    d = Eagle3Drafter(big)
    d.set_vocab(torch.arange(32) * 2)
    with pytest.raises(CheckpointError, match=r"step_00000002: cannot write the checkpoint .*earlier checkpoints"):
        save_drafter(d.state_dict(), big, root / "step_00000002", {"step": 2})
    assert tree_digest(root) == before and [s for s, _ in list_checkpoints(root)] == [1]


def test_disk_full_during_generate_names_the_shard(tiny_disk):
    from eagle3lib.data.records import ShardWriter, iter_records

    with ShardWriter(tiny_disk / "gen", 10_000) as w:
        w.write({"id": "a", "status": "ok"})
        with pytest.raises(OSError, match=r"shard-00000.jsonl: cannot append a record .*written so far are kept"):
            for i in range(100_000):
                w.write({"id": f"x{i}", "status": "ok", "pad": "y" * 1000})
    ids = [r["id"] for _, _, r in iter_records(tiny_disk / "gen")]
    assert ids[0] == "a" and len(ids) > 10


def test_resume_falls_back_past_a_damaged_checkpoint(tmp_path, one_thread, capsys):
    from test_golden_loss import _store, _verifier

    from eagle3lib.config.stages import open_stage
    from eagle3lib.training.loop import train

    run = tmp_path / "run"
    run.mkdir()
    _store(run / "extract")
    over = {"verifier.model": str(_verifier(tmp_path / "verifier")), "train.max_steps": 6, "train.ckpt_every": 2,
            "train.keep_checkpoints": 3, "train.log_every": 1, "train.nproc_per_node": 1, "train.threads": 1,
            "train.draft_vocab_size": 128, "train.packed_row_tokens": 128, "train.batch_rows": 2,
            "train.val_fraction": 0.0}
    train(open_stage("train", "tiny", run, over))
    newest = run / "train" / "checkpoints" / "step_00000006" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])  # e.g. the disk filled up while it was copied
    m = train(open_stage("train", "tiny", run, {**over, "train.max_steps": 8}))
    out = capsys.readouterr().out
    assert m["figures"]["resumed_from_step"] == 4 and m["figures"]["steps"] == 8
    assert f"skipped a damaged checkpoint: {newest}: damaged weights" in out
    # a hand-edited metrics record (a step that is not a number) was a TypeError traceback on the next resume
    from eagle3lib.stages.train import main as train_main

    metrics = run / "train" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[1] = json.dumps({**json.loads(lines[1]), "step": "two"})
    metrics.write_text("\n".join(lines) + "\n")
    argv = ["--profile", "tiny", "--run-dir", str(run), "--overrides-json", json.dumps({**over, "train.max_steps": 10})]
    assert train_main(argv) == 1
    assert f"[train] error: {metrics}:2: step is 'two', not a number; fix or delete that line" in capsys.readouterr().err
