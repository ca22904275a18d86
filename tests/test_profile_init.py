# .venv/bin/python -m pytest -q tests/test_profile_init.py
"""`eagle3lib init`: a profile from a model folder. For the tiny, tiny-kimi and Kimi-K2.5 configs it gives the
auxiliary layer ids, drafter layer and end-of-turn marker that the shipped profiles use, the written profile
validates, and a model vLLM cannot serve with EAGLE-3 is refused with the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from eagle3lib.__main__ import main
from eagle3lib.config.profile import load_profile
from eagle3lib.core.paths import ASSETS_DIR, REPO_ROOT


def _init(model: Path, out: Path, capsys) -> dict:
    assert main(["init", "--model", str(model), "--out", str(out)]) == 0, capsys.readouterr().err
    prof = load_profile(str(out))  # validates: every key known, every value in range
    assert prof.section("verifier").model == str(model)
    return yaml.safe_load(out.read_text())


def _shipped(name: str) -> dict:
    return yaml.safe_load((REPO_ROOT / "params" / f"{name}.yaml").read_text())


def test_the_tiny_verifiers_get_what_their_shipped_profiles_use(tmp_path, capsys):
    tiny = _init(ASSETS_DIR / "tiny-verifier", tmp_path / "tiny.yaml", capsys)
    assert tiny["verifier"]["aux_layer_ids"] == [2, 4, 5]  # tiny.yaml: the default {2, L//2, L-3}, L = 8
    assert tiny["verifier"]["reasoning_parser"] == _shipped("tiny")["verifier"].get("reasoning_parser", "qwen3")
    assert tiny["train"]["drafter_layer"] == "llama" and tiny["extract"]["end_of_turn"] == ["<|im_end|>"]
    kimi = _init(ASSETS_DIR / "tiny-kimi-verifier", tmp_path / "kimi.yaml", capsys)
    shipped = _shipped("tiny-kimi")
    assert kimi["verifier"]["reasoning_parser"] == shipped["verifier"]["reasoning_parser"] == "kimi_k2"
    assert kimi["extract"]["end_of_turn"] == shipped["extract"]["end_of_turn"]
    assert kimi["train"]["drafter_layer"] == shipped["train"]["drafter_layer"] == "auto"
    text = (tmp_path / "kimi.yaml").read_text()
    assert "SupportsEagle3" in text and "# YOUR prompts" in text  # every decision says why; the undecidable is named


def test_kimi_k25s_config_gets_the_kimi_k25_profiles_choices(tmp_path, capsys):
    """Kimi-K2.5's own config shape (a multimodal wrapper around a 61-layer DeepSeek-V3 text model; Kimi's chat
    format, from the tiny twin's tokenizer), with no weights on disk."""
    model = tmp_path / "kimi-k25"
    model.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ASSETS_DIR / "tiny-kimi-verifier" / f, model / f)
    text = json.loads((ASSETS_DIR / "tiny-kimi-verifier" / "config.json").read_text())
    text.update(num_hidden_layers=61, hidden_size=7168, kv_lora_rank=512, q_lora_rank=1536, vocab_size=163840,
                max_position_embeddings=262144, architectures=["DeepseekV3ForCausalLM"])
    (model / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                   "model_type": "kimi_k25", "text_config": text}))
    got = _init(model, tmp_path / "k25.yaml", capsys)
    shipped = _shipped("kimi-k2.5")
    assert got["verifier"]["aux_layer_ids"] == shipped["verifier"]["aux_layer_ids"] == [2, 30, 58]
    assert got["train"]["drafter_layer"] == shipped["train"]["drafter_layer"] == "llama"
    assert got["extract"]["end_of_turn"] == shipped["extract"]["end_of_turn"] == ["<|im_end|>"]
    assert got["verifier"]["reasoning_parser"] == shipped["verifier"]["reasoning_parser"]
    assert got["verifier"]["max_model_len"] == 8192 and got["verifier"]["dtype"] == "bfloat16"


def test_a_model_vllm_cannot_draft_for_is_refused_with_the_reason(tmp_path, capsys):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                   "num_hidden_layers": 12, "hidden_size": 768}))
    assert main(["init", "--model", str(model), "--out", str(tmp_path / "g.yaml")]) == 2
    err = capsys.readouterr().err
    assert "GPT2LMHeadModel" in err and "SupportsEagle3" in err and not (tmp_path / "g.yaml").exists()
    assert main(["init", "--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "n.yaml")]) == 2
    assert "not a local folder, and its config.json could not be fetched" in capsys.readouterr().err


def test_a_verifier_too_shallow_for_three_feature_layers_is_refused(tmp_path, capsys):
    model = tmp_path / "shallow"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                                   "num_hidden_layers": 5, "hidden_size": 64}))
    assert main(["init", "--model", str(model), "--out", str(tmp_path / "s.yaml")]) == 2
    assert "[2, 2, 2] are not distinct" in capsys.readouterr().err and not (tmp_path / "s.yaml").exists()


def test_an_existing_profile_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "p.yaml"
    out.write_text("mine")
    assert main(["init", "--model", str(ASSETS_DIR / "tiny-verifier"), "--out", str(out)]) == 2
    assert out.read_text() == "mine" and "exists" in capsys.readouterr().err


def test_the_console_script_is_the_module_cli():
    """`eagle3lib ...` (pyproject's [project.scripts], installed by `make setup`) is `python -m eagle3lib ...`."""
    import subprocess
    import sys

    script = Path(sys.executable).parent / "eagle3lib"
    assert script.exists(), "run make setup (pip install -e .) to install the console script"
    a = subprocess.run([str(script), "stages"], capture_output=True, text=True)
    b = subprocess.run([sys.executable, "-m", "eagle3lib", "stages"], capture_output=True, text=True)
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout and "generate" in a.stdout
