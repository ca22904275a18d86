# Run: .venv/bin/python -m pytest tests/test_params.py -q
from __future__ import annotations

import os
from pathlib import Path

import pytest

from eagle3lib.config.profile import ParamsError, load_profile, parse_set
from eagle3lib.core.paths import PARAMS_DIR, RUN_CWD_ENV

PROFILES = sorted(p.stem for p in PARAMS_DIR.glob("*.yaml") if p.stem != "hardware")


@pytest.mark.parametrize("name", PROFILES)
def test_shipped_profiles_validate(name):
    prof = load_profile(name)
    assert prof.verifier.model


def test_profiles_shipped():
    assert {"tiny", "qwen3-8b", "kimi-k2.5"} <= set(PROFILES)


def test_kimi_profile_documents_the_reference_setup():
    v = load_profile("kimi-k2.5").verifier
    assert v.aux_layer_ids == [2, 30, 58] and v.tensor_parallel_size == 8 and v.trust_remote_code


def test_trust_remote_code_off_by_default():
    assert load_profile("tiny").verifier.trust_remote_code is False


def test_misspelled_key_in_file_names_key_and_file(tmp_path: Path):
    p = tmp_path / "bad.yaml"
    p.write_text("verifier:\n  modle: x\n")
    with pytest.raises(ParamsError) as e:
        load_profile(p)
    msg = str(e.value)
    assert str(p) in msg and "verifier.modle" in msg and "did you mean 'model'" in msg


def test_wrong_type_names_key(tmp_path: Path):
    p = tmp_path / "bad.yaml"
    p.write_text("verifier:\n  tensor_parallel_size: eight\n")
    with pytest.raises(ParamsError, match=r"verifier\.tensor_parallel_size"):
        load_profile(p)


def test_unknown_section(tmp_path: Path):
    p = tmp_path / "bad.yaml"
    p.write_text("verifer:\n  model: x\n")
    with pytest.raises(ParamsError, match=r"unknown section 'verifer'.*did you mean 'verifier'"):
        load_profile(p)


def test_override_is_typed_and_blamed_on_set():
    prof = load_profile("tiny", parse_set(["verifier.aux_layer_ids=[1, 3, 5]", "verifier.kv_cache_gib=2"]))
    assert prof.verifier.aux_layer_ids == [1, 3, 5] and prof.verifier.kv_cache_gib == 2
    with pytest.raises(ParamsError, match=r"^--set: unknown key 'verifier.kv_cache_gb'"):
        load_profile("tiny", parse_set(["verifier.kv_cache_gb=2"]))


def test_parse_set_rejects_missing_equals():
    with pytest.raises(ParamsError, match="expected section.key=value"):
        parse_set(["verifier.model"])


def test_unknown_profile_lists_profiles():
    with pytest.raises(ParamsError, match="profiles: .*tiny"):
        load_profile("tiniest")


@pytest.mark.parametrize(("old", "new"), [("extract.max_seq_len", "extract.max_sample_tokens"),
                                          ("train.max_seq_len", "train.packed_row_tokens"),
                                          ("evaluate.k", "evaluate.ttt_steps")])
def test_renamed_keys_name_the_new_key(old, new):
    with pytest.raises(ParamsError, match=rf"^--set: '{old}' is now called '{new}'$"):
        load_profile("tiny", parse_set([f"{old}=3"]))


@pytest.mark.parametrize("text", ["", "# nothing set yet\n", "{}\n"], ids=["blank", "comments", "empty-mapping"])
def test_an_empty_profile_is_refused_naming_the_file(tmp_path: Path, text: str):
    """It ran every stage on the defaults without a word: almost always the wrong file, or one not saved yet."""
    p = tmp_path / "mine.yaml"
    p.write_text(text)
    with pytest.raises(ParamsError, match=rf"^{p}: the profile is empty \(no section is set\); write its sections"):
        load_profile(p)


# ------------------------------------------------------------------------------------------- relative paths


def _here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory that is not the repository, with a dataset and a model folder in it."""
    monkeypatch.delenv(RUN_CWD_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p8.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "models" / "x").mkdir(parents=True)
    return tmp_path


def test_relative_paths_are_from_the_directory_the_run_starts_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The pre-run check read them from the working directory and the stages (which start in the repository) from
    the repository: one file was found and another read. Now both read the absolute path the manifests record."""
    from eagle3lib.config.stages import get_stage, stage_params
    from eagle3lib.pipeline.preflight import missing_datasets

    here = _here(tmp_path, monkeypatch)
    prof = load_profile("tiny", {"generate.dataset": "data/p8.jsonl", "verifier.model": "models/x",
                                 "train.init_from": "./models/x", "evaluate.drafters": ["models/x"],
                                 "deployment.results_run_dir": "runs/a", "compare_runs.runs": ["runs/*"],
                                 "learning_curves.sources": ["ssh://host/m.jsonl", "runs/a/train/metrics.jsonl"]})
    assert prof.section("generate").dataset == str(here / "data" / "p8.jsonl")
    assert prof.verifier.model == str(here / "models" / "x")  # a folder here, not a hub id for vLLM
    assert prof.section("train").init_from == prof.section("evaluate").drafters[0] == str(here / "models" / "x")
    assert prof.section("deployment").results_run_dir == str(here / "runs" / "a")
    assert prof.section("compare_runs").runs == [str(here / "runs" / "*")]
    assert prof.section("learning_curves").sources == ["ssh://host/m.jsonl", str(here / "runs/a/train/metrics.jsonl")]
    assert missing_datasets(prof, ["generate"]) == []
    assert stage_params(prof, get_stage("generate"))["generate"]["dataset"] == str(here / "data" / "p8.jsonl")


def test_names_that_are_not_paths_stay_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A hub id, `builtin:`/`hf:` forms, the `generate` source, `best`, and the defaults (the repository's own table)."""
    _here(tmp_path, monkeypatch)
    prof = load_profile("tiny", {"verifier.model": "HuggingFaceTB/SmolLM2-135M-Instruct", "extract.source": "generate",
                                 "evaluate.prompts": "hf:openai/openai_humaneval", "evaluate.checkpoint": "best",
                                 "generate.dataset": "builtin:tiny-train"})
    assert prof.verifier.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert prof.section("extract").source == "generate" and prof.section("evaluate").checkpoint == "best"
    assert prof.section("evaluate").prompts == "hf:openai/openai_humaneval"
    assert prof.section("generate").dataset == "builtin:tiny-train"
    assert prof.section("deployment").hardware_file == "params/hardware.yaml"


def test_a_stage_process_resolves_against_where_the_run_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Stage notebooks start in the repository and torchrun's processes in their stage folder: `run` hands them the
    directory it started in, and they resolve as it did."""
    from eagle3lib.core.paths import REPO_ROOT, started_here
    from eagle3lib.core.torchrun import torchrun_env

    here = _here(tmp_path, monkeypatch)
    with started_here():
        monkeypatch.chdir(REPO_ROOT)  # the notebook's working directory
        assert load_profile("tiny", {"generate.dataset": "data/p8.jsonl"}).section("generate").dataset == \
            str(here / "data" / "p8.jsonl")
        assert torchrun_env(1)[RUN_CWD_ENV] == str(here)
    assert RUN_CWD_ENV not in os.environ


def test_every_path_key_is_a_key():
    from eagle3lib.config.profile_paths import PATH_KEYS
    from eagle3lib.config.registry import SECTIONS

    for dotted in PATH_KEYS:
        section, key = dotted.split(".")
        assert key in SECTIONS[section].model_fields, dotted


def test_a_missing_evaluate_prompts_file_fails_before_any_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]):
    """The pre-run check covers evaluate's prompts too, named with the file it looked for."""
    from eagle3lib.__main__ import main

    here = _here(tmp_path, monkeypatch)
    assert main(["run", "--run-dir", "run", "--stages", "evaluate", "--set", "evaluate.prompts=data/absent.jsonl"]) == 2
    err = capsys.readouterr().err
    assert f"tiny.yaml: evaluate.prompts: no such file: {here / 'data' / 'absent.jsonl'} (relative paths are from " \
           "the directory the run starts in)" in err and not (here / "run").exists(), err
