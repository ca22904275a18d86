"""The verifier: resolve the profile's `verifier.model` to a loadable path, its EAGLE-3 layers, HF loading, hooks on
its decoder layers, and the weights the drafter borrows from it (embedding, final norm, lm_head).

Index convention: feature id k = the hidden state *entering* decoder layer k (a forward pre-hook on layers[k]) = HF
`output_hidden_states[k]` for k < L. The final hidden state is the *output* of the last decoder layer, before the final
norm (whose norm + lm_head give the training targets).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3lib.config.verifier import aux_order_problem

BUILTIN_TINY = "builtin:tiny"
BUILTINS = {  # verifier.model -> what it is (the names the stage reports show)
    BUILTIN_TINY: "eagle3lib tiny (built)",
    "builtin:tiny-long": "eagle3lib tiny-long (built; the dense one trained further on 16K-token documents)",
    "builtin:tiny-kimi": "eagle3lib tiny-kimi (built; DeepSeek-V3 MLA + MoE)",
    "builtin:tiny-kimi-k25": "eagle3lib tiny-kimi in the Kimi-K2.5 wrapper (built)",
}


def resolve_model(model: str) -> str:
    """`builtin:tiny`, `builtin:tiny-long`, `builtin:tiny-kimi` (its Kimi-K2.5 wrapper form: `builtin:tiny-kimi-k25`) -> the cached tiny
    verifier (built on first use); `builtin:smollm2-135m-instruct` -> the real model from its wheel (model/packaged.py,
    built on first use); anything else is an HF id or a local dir."""
    from eagle3lib.model.packaged import PACKAGED, packaged_verifier_path

    if model in PACKAGED:
        return str(packaged_verifier_path(model))
    if model in BUILTINS:
        from eagle3lib.tiny.build import tiny_kimi_k25_path, tiny_verifier_path
        from eagle3lib.tiny.kimi import TinyKimiRecipe
        from eagle3lib.tiny.long import TinyLongRecipe

        if model == BUILTIN_TINY:
            return str(tiny_verifier_path())
        if model == "builtin:tiny-long":
            return str(tiny_verifier_path(TinyLongRecipe()))
        return str(tiny_verifier_path(TinyKimiRecipe()) if model == "builtin:tiny-kimi" else tiny_kimi_k25_path())
    if model.startswith("builtin:"):
        raise ValueError(f"verifier.model: unknown builtin '{model}' (known: {', '.join([*BUILTINS, *PACKAGED])})")
    return model


def missing_local_folder(model: str) -> bool:
    """verifier.model names a path (absolute, ./, ~, or deeper than a hub id's "org/name") that is not a folder: say
    so, instead of the hub's answer for a bad id."""
    return (model.startswith(("/", "./", "../", "~")) or model.count("/") > 1) and not Path(model).expanduser().is_dir()


def weights_fingerprint(model_path: str | Path) -> str | None:
    """A short id of the verifier's weights: each weight file's name, size, and first and last MiB. Two models of one
    architecture (a fine-tune of the same base, tiny and tiny-long) share every shape a store records; their weights
    differ in the first bytes of every tensor. Reads a few MiB, never the whole file. None without local weights."""
    import hashlib

    folder = Path(model_path)
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin")) if folder.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def eos_ids(tokenizer: Any, model_path: str) -> list[int]:
    """The tokenizer's EOS plus the generation config's eos_token_id (vLLM stops on both)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig

        e = GenerationConfig.from_pretrained(model_path).eos_token_id
    except Exception:  # no generation_config.json: the tokenizer's EOS only
        e = None
    ids.update([int(x) for x in e] if isinstance(e, list) else [int(e)] if e is not None else [])
    return sorted(ids)


def describe_model(model: str) -> str:
    """verifier.model as a report shows it."""
    from eagle3lib.model.packaged import PACKAGED

    return PACKAGED[model].describe() if model in PACKAGED else BUILTINS.get(model, model)


def default_aux_layers(num_layers: int) -> list[int]:
    """{2, L//2, L-3}: the vLLM/speculators convention (Kimi-K2.5, L=61: [2, 30, 58]). Id k = input of decoder layer k."""
    return [2, num_layers // 2, num_layers - 3]


def aux_layer_ids(requested: list[int] | None, num_layers: int) -> list[int]:
    """Validated feature-layer ids. vLLM's llama drafter sizes fc for exactly three, so three it is."""
    ids = list(requested) if requested is not None else default_aux_layers(num_layers)
    fix = (f"; id k is the hidden state entering decoder layer k (HF hidden_states[k]), the final state (id {num_layers}) "
           "is stored anyway and is no feature. Set verifier.aux_layer_ids to 3 distinct ids in "
           f"0..{num_layers - 1}, or leave it unset for the default {default_aux_layers(num_layers)}")
    if len(ids) != 3:
        raise ValueError(f"verifier.aux_layer_ids: EAGLE-3 drafters served by vLLM take exactly 3 layers, got {ids}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"verifier.aux_layer_ids: {bad} out of range for a verifier with {num_layers} layers "
                         f"(0..{num_layers - 1}){fix}")
    if len(set(ids)) != 3:
        raise ValueError(f"verifier.aux_layer_ids: {ids} are not distinct (a verifier with {num_layers} layers is too "
                         f"shallow?){fix}")
    if problem := aux_order_problem(ids):
        raise ValueError(problem)
    return ids


def load_config(model: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ValueError(f"verifier.model: cannot load a config from '{model}': {e}") from e
    return getattr(cfg, "text_config", None) or cfg  # multimodal wrappers (Kimi-K2.5) keep the LM config inside


def load_tokenizer(model: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ValueError(f"verifier.model: cannot load a tokenizer from '{model}': {e}") from e


def load_hf_model(model: str, dtype: str = "float32", device_map: Any = None, trust_remote_code: bool = False) -> Any:
    """HF causal LM in eval mode, weights read with safetensors (never unpickled). A multimodal wrapper around a causal
    LM (Kimi-K2.5: Kimi_K25ForConditionalGeneration, which AutoModelForCausalLM does not map) loads as an image-text
    model; its language model is what the hooks and the logits use."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        wrapper = getattr(cfg, "text_config", None) is not None and not getattr(cfg, "auto_map", None)
        auto = AutoModelForImageTextToText if wrapper else AutoModelForCausalLM
        m = auto.from_pretrained(model, dtype=getattr(torch, dtype), device_map=device_map,
                                 trust_remote_code=trust_remote_code, use_safetensors=True)
    except Exception as e:
        raise ValueError(f"verifier.model: cannot load '{model}' with transformers: {e}") from e
    return m.eval()


def verifier_facts(model_path: str, trust_remote_code: bool = False,
                   requested_aux_ids: list[int] | None = None) -> dict[str, Any]:
    """What the stages need to know of the verifier: layers, hidden size, vocabulary and the validated aux layer ids."""
    c = load_config(model_path, trust_remote_code)
    L = int(c.num_hidden_layers)
    return {"num_layers": L, "hidden_size": int(c.hidden_size), "vocab_size": int(c.vocab_size),
            "aux_layer_ids": aux_layer_ids(requested_aux_ids, L),
            "max_position_embeddings": getattr(c, "max_position_embeddings", None)}


# ------------------------------------------------------------------------------------------ hooks on its layers


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder layer list of a causal LM (model.model.layers for Llama/Qwen/DeepSeek-style models)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None and hasattr(base, "language_model"):  # multimodal wrappers
        layers = getattr(base.language_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (expected .model.layers)")
    return layers


def base_model(model: Any) -> torch.nn.Module:
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


class LayerCapture:
    """Forward hooks that record the input of layers[k] for k in `aux_ids` and (with `final`) the output of the last
    layer: what the extract stage stores, and what the library's speculative decoding feeds its drafter."""

    def __init__(self, layers: torch.nn.ModuleList, aux_ids: list[int], final: bool = True):
        L = len(layers)
        bad = [k for k in aux_ids if not 0 <= k < L]
        if bad:
            raise ValueError(f"aux layer ids {bad} out of range for a verifier with {L} decoder layers (0..{L - 1})")
        self.aux_ids = list(aux_ids)
        self.captured: dict[Any, torch.Tensor] = {}
        self._handles = []
        for k in sorted(set(aux_ids)):
            self._handles.append(layers[k].register_forward_pre_hook(self._pre(k), with_kwargs=True))
        if final:
            self._handles.append(layers[L - 1].register_forward_hook(self._post("final")))

    def _pre(self, key):
        def hook(_module, args, kwargs):
            self.captured[key] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _post(self, key):
        def hook(_module, _args, output):
            self.captured[key] = output[0] if isinstance(output, tuple | list) else output

        return hook

    def aux(self) -> torch.Tensor:
        """aux [B, T, n_aux, H] of the last forward, in `aux_ids` order, on the device of the first aux layer."""
        aux = [self.captured[k] for k in self.aux_ids]
        dev = aux[0].device
        return torch.stack([a.to(dev) for a in aux], dim=2)

    def pop(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [B, T, n_aux, H], final [B, T, H]) of the last forward, on the device of the first aux layer."""
        aux = self.aux()
        out = aux, self.captured["final"].to(aux.device)
        self.captured = {}
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


# ------------------------------------------------------------------------------------------- the verifier's weights


@dataclass
class VerifierHead:
    """What the drafter needs from the verifier: the embedding, and the final norm + lm_head that define the target."""

    embed_tokens: torch.Tensor  # [V, H]
    norm_weight: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    rms_norm_eps: float
    config: Any  # the verifier's (text) config

    def target_logits(self, final_hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """lm_head(norm(final_hidden)) in fp32, restricted to `rows` of the lm_head (the draft vocabulary) if given."""
        x = final_hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.rms_norm_eps) * self.norm_weight.float()
        w = self.lm_head if rows is None else self.lm_head[rows]
        return x @ w.float().t()


def _safetensors_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json or the *.safetensors files of the folder."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        wm = json.loads(index.read_text())["weight_map"]
        return {k: model_dir / v for k, v in wm.items()}
    out = {}
    for p in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                out[k] = p
    if not out:
        raise FileNotFoundError(f"{model_dir}: no safetensors weights")
    return out


def _pick(names: dict[str, Path], suffixes: tuple[str, ...]) -> str | None:
    """The shortest tensor name equal to or ending in one of `suffixes` (tried in order): "model.norm.weight" matches
    Kimi's "language_model.model.norm.weight" but never "model.layers.3.input_layernorm.weight"."""
    for suf in suffixes:
        cands = sorted((n for n in names if n == suf or n.endswith("." + suf)), key=len)
        if cands:
            return cands[0]
    return None


# Model types whose RMSNorm scales by (1 + weight), the weight stored as an offset from 1 (transformers 5.19:
# `output * (1.0 + self.weight.float())` in models/{gemma,gemma2,gemma3,qwen3_next,qwen3_5,qwen3_5_moe}/modeling_*.py).
# Read as a plain scale, the final norm would zero a freshly initialised Qwen3-Next's states and skew a trained one's:
# the final-state check caught it on the support matrix's tiny Qwen3-Next (tests/test_families.py).
OFFSET_NORM_TYPES = {"gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                     "qwen3_5_moe_text"}


def load_verifier_head(model_path: str | Path, trust_remote_code: bool = False) -> VerifierHead:
    """Read embed_tokens, the final norm and lm_head from the verifier's safetensors (only those tensors)."""
    from safetensors import safe_open

    cfg = load_config(str(model_path), trust_remote_code=trust_remote_code)
    model_dir = Path(model_path)
    if not model_dir.is_dir():
        from huggingface_hub import snapshot_download

        model_dir = Path(snapshot_download(str(model_path), allow_patterns=["*.json", "*.safetensors"]))
    names = _safetensors_files(model_dir)
    emb = _pick(names, ("model.embed_tokens.weight", "embed_tokens.weight"))
    norm = _pick(names, ("model.norm.weight",))
    head = _pick(names, ("lm_head.weight",))
    if emb is None or norm is None:
        raise ValueError(f"{model_dir}: cannot find the verifier's embed_tokens / final norm weights")
    if head is None:
        if not getattr(cfg, "tie_word_embeddings", False):
            raise ValueError(f"{model_dir}: no lm_head.weight and tie_word_embeddings is false")
        head = emb

    def get(name: str) -> torch.Tensor:
        with safe_open(str(names[name]), framework="pt") as f:
            return f.get_tensor(name)

    e, w = get(emb), get(norm)
    if getattr(cfg, "model_type", None) in OFFSET_NORM_TYPES:
        w = w.float() + 1.0  # stored as an offset from 1: x * (1 + w). Folded here, so every user applies x * w
    return VerifierHead(e, w, e if head == emb else get(head), float(getattr(cfg, "rms_norm_eps", 1e-6)), cfg)
