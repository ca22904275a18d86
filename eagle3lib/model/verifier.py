"""The verifier: resolve the profile's `verifier.model` to a loadable path, its EAGLE-3 layers, and HF loading."""

from __future__ import annotations

from typing import Any

BUILTIN_TINY = "builtin:tiny"


def resolve_model(model: str) -> str:
    """`builtin:tiny` -> the cached tiny verifier (built on first use); anything else is an HF id or a local dir."""
    if model == BUILTIN_TINY:
        from eagle3lib.tiny.build import tiny_verifier_path

        return str(tiny_verifier_path())
    if model.startswith("builtin:"):
        raise ValueError(f"verifier.model: unknown builtin '{model}' (known: {BUILTIN_TINY})")
    return model


def default_aux_layers(num_layers: int) -> list[int]:
    """{2, L//2, L-3}: the vLLM/speculators convention (Kimi-K2.5, L=61: [2, 30, 58]). Id k = input of decoder layer k."""
    return [2, num_layers // 2, num_layers - 3]


def aux_layer_ids(requested: list[int] | None, num_layers: int) -> list[int]:
    """Validated feature-layer ids. vLLM's llama drafter sizes fc for exactly three, so three it is."""
    ids = list(requested) if requested is not None else default_aux_layers(num_layers)
    if len(ids) != 3:
        raise ValueError(f"verifier.aux_layer_ids: EAGLE-3 drafters served by vLLM take exactly 3 layers, got {ids}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"verifier.aux_layer_ids: {bad} out of range for a verifier with {num_layers} layers (0..{num_layers - 1})")
    if len(set(ids)) != 3:
        raise ValueError(f"verifier.aux_layer_ids: {ids} are not distinct (a verifier with {num_layers} layers is too shallow?)")
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
    """HF causal LM in eval mode, weights read with safetensors (never unpickled)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        m = AutoModelForCausalLM.from_pretrained(
            model, dtype=getattr(torch, dtype), device_map=device_map, trust_remote_code=trust_remote_code,
            use_safetensors=True,
        )
    except Exception as e:
        raise ValueError(f"verifier.model: cannot load '{model}' with transformers: {e}") from e
    return m.eval()
