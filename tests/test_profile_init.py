# .venv/bin/python -m pytest -q tests/test_profile_init.py
"""`eagle3lib init`: a profile from a model folder. For the tiny, tiny-kimi and Kimi-K2.5 configs it gives the
auxiliary layer ids, drafter layer and end-of-turn marker that the shipped profiles use, the written profile
validates, and a model vLLM cannot serve with EAGLE-3 is refused with the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
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


TINY = ASSETS_DIR / "tiny-verifier"
TINY_CONFIG = json.loads((TINY / "config.json").read_text())
WRAPPED = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25"}
# (config.json as written, the error after "error: {folder}/config.json: ")
BAD_CONFIGS = {
    "no num_hidden_layers": ({k: v for k, v in TINY_CONFIG.items() if k != "num_hidden_layers"},
                             "num_hidden_layers is missing (the number of decoder layers: init needs it)"),
    "no hidden_size": ({k: v for k, v in TINY_CONFIG.items() if k != "hidden_size"},
                       "hidden_size is missing (the width of the hidden states: init needs it)"),
    "no hidden_size in text_config": ({**WRAPPED, "text_config": {"num_hidden_layers": 61}},
                                      "text_config.hidden_size is missing (the width of the hidden states: init needs "
                                      "it)"),
    "layers not a number": ({**TINY_CONFIG, "num_hidden_layers": "eight"},
                            'num_hidden_layers is "eight", not a positive integer'),
    "a JSON list": ([TINY_CONFIG], "holds a JSON list, not an object of the model's settings (architectures, "
                                   "num_hidden_layers, hidden_size, ...)"),
    "text_config a list": ({**WRAPPED, "text_config": [TINY_CONFIG]},
                           "text_config holds a JSON list, not an object of the language model's settings"),
    "invalid JSON": ('{"architectures": ["Qwen3ForCausalLM"],',
                     "not valid JSON (Expecting property name enclosed in double quotes at line 1, column 40)"),
    "5 layers": ({**TINY_CONFIG, "num_hidden_layers": 5},
                 "num_hidden_layers is 5, too few for an EAGLE-3 drafter: vLLM's auxiliary layers {2, L//2, L-3} are "
                 "[2, 2, 2] for L = 5, not 3 distinct ascending layers; it needs at least 7 layers"),
    "6 layers": ({**TINY_CONFIG, "num_hidden_layers": 6},
                 "num_hidden_layers is 6, too few for an EAGLE-3 drafter: vLLM's auxiliary layers {2, L//2, L-3} are "
                 "[2, 3, 3] for L = 6, not 3 distinct ascending layers; it needs at least 7 layers"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_a_config_json_init_cannot_use_is_one_error_line_naming_the_file(case, tmp_path, capsys):
    """A key missing or not a number, not a JSON object, not JSON, too few layers for vLLM's auxiliary layers: one
    line naming config.json and the key (not a traceback, nor verifier.aux_layer_ids, which the user never set)."""
    config, why = BAD_CONFIGS[case]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    out = tmp_path / "p.yaml"
    capsys.readouterr()
    assert main(["init", "--model", str(model), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [f"error: {model / 'config.json'}: {why}"]
    assert "Traceback" not in err and "aux_layer_ids" not in err and not out.exists()


def _partial_tiny(model: Path, drop: tuple[str, ...]) -> None:
    """The tiny verifier's folder without the files named in drop."""
    model.mkdir()
    for f in TINY.iterdir():
        if f.name not in drop:
            shutil.copy(f, model / f.name)


def _no_tokenizer(model: Path) -> list[str]:
    _partial_tiny(model, ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"))
    return [f"could not read: the tokenizer and its chat template: no tokenizer files (tokenizer.json, "
            f"tokenizer_config.json, tokenizer.model, ...) in {model}", GUESSED_TEMPLATE]


def _truncated(model: Path) -> list[str]:
    _partial_tiny(model, ("model.safetensors",))
    (model / "model.safetensors").write_bytes((TINY / "model.safetensors").read_bytes()[:1_000_000])
    full = (TINY / "model.safetensors").stat().st_size
    return [f"could not read: {model / 'model.safetensors'} is TRUNCATED: its header declares {full:,} bytes, the file "
            "has 1,000,000 (an interrupted download?); vLLM cannot load it until it is complete; counted from its "
            "header"]


def _not_safetensors(model: Path) -> list[str]:
    _partial_tiny(model, ("model.safetensors",))
    (model / "model.safetensors").write_text("<html>Access denied</html>")
    return [f"could not read: {model / 'model.safetensors'}: its header is cut short, or it is not a safetensors file "
            "(26 bytes); vLLM cannot load it, and the weights' size is unknown", GUESSED_WEIGHTS]


def _pickled(model: Path, shards: int) -> list[str]:
    _partial_tiny(model, ("model.safetensors",))
    names = ["pytorch_model.bin"] if shards == 1 else [f"pytorch_model-0000{i}-of-0000{shards}.bin"
                                                        for i in range(1, shards + 1)]
    for name in names:  # not a pickle at all: init must only stat them
        (model / name).write_bytes(b"\0" * (3 * 2**20 // shards))
    return [f"could not read: the tensors in {shards} pytorch_model*.bin file(s) (pickles are not opened): the "
            "weights' size is their file size"]


def _no_weights(model: Path) -> list[str]:
    _partial_tiny(model, ("model.safetensors",))
    return [f"could not read: the weights: no *.safetensors or pytorch_model*.bin in {model}", GUESSED_WEIGHTS]


GUESSED_TEMPLATE = ("guessed: verifier.reasoning_parser and extract.end_of_turn, with no chat template to find "
                    "reasoning markers and the end-of-turn marker in; set them as the model is served (its model card)")
GUESSED_WEIGHTS = ("guessed: verifier.tensor_parallel_size, verifier.dtype, extract.backend and train.drafter_layer, "
                   "chosen as for a large model since the weights' size is unknown; check them against the weights")
# (builds the folder and returns the notes, the tensor_parallel_size comment's start)
UNREADABLE = {
    "no tokenizer files": (_no_tokenizer, "14.2 MiB of weights (from the headers of 1 safetensors file(s))"),
    "truncated safetensors": (_truncated, "14.2 MiB of weights (from the headers of 1 safetensors file(s))"),
    "not safetensors": (_not_safetensors, "GUESSED: the weights' size is unknown"),
    "pytorch_model.bin": (lambda m: _pickled(m, 1), "3.0 MiB of weights (file sizes of 1 pytorch_model*.bin file(s))"),
    ".bin shards": (lambda m: _pickled(m, 2), "3.0 MiB of weights (file sizes of 2 pytorch_model*.bin file(s))"),
    "no weights": (_no_weights, "GUESSED: the weights' size is unknown"),
}


@pytest.mark.parametrize("case", UNREADABLE)
def test_what_init_could_not_read_is_warned_and_heads_the_profile(case, tmp_path, capsys):
    """No tokenizer files, a safetensors file cut short or not one, pickled weights, none: the profile is written,
    and what could not be read and which choices are guesses are said on stderr and as its first comments."""
    build, why_tp = UNREADABLE[case]
    model, out = tmp_path / "model", tmp_path / "p.yaml"
    notes = build(model)
    capsys.readouterr()
    got = _init(model, out, capsys)
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("warning:")] == [f"warning: {n}" for n in notes]
    assert out.read_text().split("\n")[:len(notes) + 1] == [*(f"# {n}" for n in notes), ""]
    assert out.read_text().split("tensor_parallel_size: 1  # ")[1].startswith(why_tp)
    if GUESSED_TEMPLATE in notes:  # not the made-up eos of the empty tokenizer transformers builds without files
        assert got["verifier"]["reasoning_parser"] is None and got["extract"]["end_of_turn"] == []
        assert "reasoning_parser: null  # GUESSED: no chat template was read" in out.read_text()


def test_a_complete_model_folder_gets_no_warnings(tmp_path, capsys):
    capsys.readouterr()
    _init(TINY, tmp_path / "p.yaml", capsys)
    assert "warning:" not in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").read_text().startswith("#")


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
