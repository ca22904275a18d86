# Run: .venv/bin/python -m pytest tests/test_params.py -q
from __future__ import annotations

from pathlib import Path

import pytest

from eagle3lib.config.profile import ParamsError, load_profile, parse_set
from eagle3lib.core.paths import PARAMS_DIR

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
