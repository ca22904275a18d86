"""DFlash: a block drafter that proposes all K tokens in one forward, as vLLM 0.32 serves it (`method: dflash`).

The geometry is vLLM's (model: vllm/model_executor/models/qwen3_dflash.py; inputs: DFlashProposer in
vllm/v1/spec_decode/dflash.py and copy_and_expand_dflash_inputs_kernel in vllm/v1/spec_decode/utils.py):

  context  c_i = fc([a_i^1; a_i^2; a_i^3]) for every verified position i < p, a_i^k the verifier's auxiliary states.
           Each layer's context keys/values are ITS k_proj / v_proj of hidden_norm(c_i), k_norm, RoPE at i: the
           context never runs through the layers, every layer reads the same normed context states.
  block    [x_p, M, ..., M] at positions p .. p+K: x_p the token the verifier just emitted (not yet through it),
           M = mask_token_id. The block runs through the layers, each query attending to all the context and to the
           whole block (non-causal inside the block: a mask slot sees the slots after it).
  drafts   slot j = 1..K: lm_head(norm(h_j)) is the draft for position p+j (a slot fills its own position, unlike
           EAGLE's next-token shift).

Training (`dflash_loss`): a slot's target is the verifier's next-token distribution at position p+j-1 (its final
state through the verifier head), many anchors p per sequence in one forward: block b's queries see context < p_b and
block b only, exactly what each would see served. The embedding and lm_head are the verifier's, frozen; the mask
slot's embedding is learned and written into the checkpoint's embedding row `mask_token_id`, which vLLM embeds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle3lib.model.draft_losses import Loss, row_losses
from eagle3lib.model.drafter import MLP, RMSNorm, apply_rope, rope_cos_sin
from eagle3lib.model.speculative import DraftInput, Proposal, _pick


@dataclass
class DFlashConfig:
    hidden_size: int  # the drafter's width; the verifier's, so embed_tokens / lm_head are the verifier's own
    intermediate_size: int  # MLP width (the verifier's by default)
    num_heads: int  # query heads of the drafter's attention
    num_kv_heads: int  # key/value heads (GQA), as vLLM's Qwen3 attention builds them
    head_dim: int  # per-head width; q_norm / k_norm act on it (Qwen3 layout, which vLLM's DFlash model is)
    num_layers: int  # drafter layers; published DFlash drafters use a handful, 1-2 suffice for a tiny verifier
    rms_norm_eps: float  # every RMSNorm's epsilon (vLLM reads one for all)
    rope_theta: float  # RoPE base of the drafter's positions (the verifier's, so positions mean the same)
    vocab_size: int  # the verifier's vocabulary: DFlash drafts over it (no draft vocabulary here)
    target_hidden_size: int  # width of one verifier auxiliary state; fc takes n_aux of them
    aux_layer_ids: list[int]  # the verifier layers whose input states form the context (vLLM's eagle3 rule)
    block: int  # K, the drafts per round trained for (num_speculative_tokens when served)
    mask_token_id: int  # the id vLLM puts in the K mask slots (its embedding row is the learned mask embedding)
    max_position_embeddings: int = 2048  # written to the checkpoint's layer config (vLLM sizes RoPE from it)
    hidden_act: str = "silu"  # the MLP's activation; vLLM's DFlash layer is Qwen3's, SiLU-gated

    @property
    def n_aux(self) -> int:
        return len(self.aux_layer_ids)


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [kv_heads, S, D] of states x [S, H] at the positions of cos/sin."""
        S, c = x.shape[0], self.c
        k = self.k_norm(self.k_proj(x).view(S, c.num_kv_heads, c.head_dim)).transpose(0, 1)
        v = self.v_proj(x).view(S, c.num_kv_heads, c.head_dim).transpose(0, 1)
        return apply_rope(k[None], cos[None], sin[None])[0], v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_kv: tuple[torch.Tensor, torch.Tensor],
                allowed: torch.Tensor) -> torch.Tensor:
        """x [Q, H] block states; ctx_kv this layer's context keys/values; allowed [Q, T + Q] which keys a query sees."""
        Q, c = x.shape[0], self.c
        q = self.q_norm(self.q_proj(x).view(Q, c.num_heads, c.head_dim)).transpose(0, 1)
        q = apply_rope(q[None], cos[None], sin[None])[0]
        kb, vb = self.kv(x, cos, sin)
        k, v = torch.cat([ctx_kv[0], kb], 1), torch.cat([ctx_kv[1], vb], 1)
        rep = c.num_heads // c.num_kv_heads
        out = F.scaled_dot_product_attention(q[None], k.repeat_interleave(rep, 0)[None],
                                             v.repeat_interleave(rep, 0)[None], attn_mask=allowed[None, None])
        return self.o_proj(out[0].transpose(0, 1).reshape(Q, -1))


class DFlashLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer (vLLM's DFlashQwen3DecoderLayer); tensor names are the checkpoint's."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)  # gate/up/down with SiLU: the same tensors as the EAGLE drafter's layer


class DFlashDrafter(nn.Module):
    def __init__(self, c: DFlashConfig, embed_tokens: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(c.n_aux * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("embed_tokens", embed_tokens.detach().float().clone())  # frozen: the verifier's
        self.register_buffer("lm_head", lm_head.detach().float().clone())  # frozen: the verifier's
        # learned: what a mask slot carries (starts as the mask token's own embedding)
        self.mask_embedding = nn.Parameter(self.embed_tokens[c.mask_token_id].clone())
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def blocks(self, aux: torch.Tensor, first_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Final-normed block states [n, K+1, H] for anchors [n] (positions p) given the context's aux states
        [T, n_aux, H_t] (positions 0..T-1; block b sees those < p_b) and each block's first token first_ids [n]."""
        c, dev = self.config, aux.device
        T, n, S = aux.shape[0], anchors.shape[0], c.block + 1
        ctx = self.hidden_norm(self.fc(aux.reshape(T, -1).to(self.fc.weight.dtype)))
        qpos = (anchors[:, None] + torch.arange(S, device=dev)).reshape(-1)
        ids = torch.full((n, S), c.mask_token_id, device=dev)
        ids[:, 0] = first_ids
        h = self.embed_tokens[ids.reshape(-1)]
        h = torch.where((torch.arange(n * S, device=dev) % S != 0)[:, None], self.mask_embedding.expand_as(h), h)
        blk = torch.arange(n * S, device=dev) // S  # which block each query is in
        allowed = torch.cat([torch.arange(T, device=dev)[None] < anchors[blk][:, None],  # context before its anchor
                             blk[:, None] == blk[None]], 1)  # its own block, both directions
        cos_c, sin_c = rope_cos_sin(torch.arange(T, device=dev), c.head_dim, c.rope_theta)
        cos_q, sin_q = rope_cos_sin(qpos, c.head_dim, c.rope_theta)
        for layer in self.layers:
            a = layer.self_attn
            h = h + a(layer.input_layernorm(h), cos_q, sin_q, a.kv(ctx, cos_c, sin_c), allowed)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h).view(n, S, -1)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return states.float() @ self.lm_head.t()


def dflash_loss(model: DFlashDrafter, aux: torch.Tensor, input_ids: torch.Tensor, target_logits: torch.Tensor,
                loss_mask: torch.Tensor, anchors: torch.Tensor, loss: Loss = "kl") -> tuple[torch.Tensor, int]:
    """Mean loss over the scored slots of one sequence and their number. Slot j of the block at p is scored when
    position p+j exists and is an answer token; its target is the verifier's logits at p+j-1 (target_logits [T, V])."""
    K, T = model.config.block, input_ids.shape[0]
    states = model.blocks(aux, input_ids[anchors], anchors)[:, 1:]  # [n, K, H]
    pos = anchors[:, None] + torch.arange(1, K + 1, device=anchors.device)  # the positions the slots draft
    ok = pos < T
    ok &= loss_mask[pos.clamp(max=T - 1)]
    if not ok.any():
        return states.sum() * 0.0, 0
    rows = row_losses(model.logits(states[ok]), target_logits[pos[ok] - 1], loss)
    return rows.mean(), int(ok.sum())


def pick_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """Up to n block starts p >= 1 whose first draft (position p+1) is an answer token, drawn without repeats."""
    cand = torch.nonzero(loss_mask[2:]).flatten() + 1  # p with loss_mask[p+1]
    if cand.numel() > n:
        cand = cand[torch.randperm(cand.numel(), generator=generator)[:n]].sort().values
    return cand


class DFlashProposer:
    """The library's drafting with a DFlash drafter (the `Drafter` protocol of eagle3lib.model.speculative): each round
    ONE forward over the whole context and the block [last token, K masks] at the last position, like vLLM's. The
    context keys are recomputed every round (vLLM caches them): simple and exact, fine at evaluation lengths."""

    def __init__(self, model: DFlashDrafter, sample: bool = False):
        self.model = model.eval()
        self.aux_layer_ids = list(model.config.aux_layer_ids)
        self.sample = sample
        self.reset()

    def reset(self) -> None:
        self.aux: list[torch.Tensor] = []
        self.n_ctx = 0

    @torch.inference_mode()
    def propose(self, inp: DraftInput, k: int, temperature: float, generator: torch.Generator) -> Proposal:
        c = self.model.config
        if k != c.block:
            raise ValueError(f"DFlashProposer: this drafter drafts blocks of {c.block}, asked for {k}")
        if inp.aux is None or inp.aux_start != self.n_ctx:
            raise RuntimeError(f"DFlashProposer: expected hidden states from position {self.n_ctx}, got {inp.aux_start}")
        self.aux.append(inp.aux)
        self.n_ctx += inp.aux.shape[0]
        p = inp.tokens.shape[0] - 1  # the last committed token's position: the block starts there
        aux = torch.cat(self.aux)
        states = self.model.blocks(aux, inp.tokens[p:].long(), torch.tensor([p]))[0, 1:]
        toks, probs = [], []
        for row in self.model.logits(states):
            t, q = _pick(row, temperature if self.sample else 0.0, generator)
            toks.append(t.view(()))
            if q is not None:
                probs.append(q)
        return Proposal(torch.stack(toks).cpu(), torch.stack(probs).cpu() if probs else None)


def save_dflash(model: DFlashDrafter, out: Path, verifier: str) -> None:
    """The checkpoint vLLM 0.32 loads as `method: dflash` (speculators layout, DFlashSpeculator): config.json and
    model.safetensors with vLLM's tensor names; the learned mask embedding is the embedding row mask_token_id."""
    from safetensors.torch import save_file

    c = model.config
    out.mkdir(parents=True, exist_ok=True)
    layer = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": c.hidden_size,
             "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
             "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": c.num_layers,
             "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size, "hidden_act": "silu",
             "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False,
             "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}}
    cfg = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "speculators_version": "0.9.0",
           "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block}],
                                  "verifier": {"name_or_path": verifier, "architectures": []}},
           "transformer_layer_config": layer, "draft_vocab_size": c.vocab_size, "target_hidden_size": c.target_hidden_size,
           "mask_token_id": c.mask_token_id, "aux_hidden_state_layer_ids": list(c.aux_layer_ids),
           "torch_dtype": "float32", "eagle3lib_dflash": asdict(c)}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()
          if k not in ("embed_tokens", "lm_head", "mask_embedding")}
    emb = model.embed_tokens.clone()
    emb[c.mask_token_id] = model.mask_embedding.detach()
    sd.update({"embed_tokens.weight": emb, "lm_head.weight": model.lm_head.clone()})
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def load_dflash(path: Path) -> DFlashDrafter:
    """A checkpoint written by save_dflash (its eagle3lib_dflash config block; safetensors only, nothing unpickled)."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(path) / "config.json").read_text())
    if "eagle3lib_dflash" not in cfg:
        raise ValueError(f"{path}/config.json: not a DFlash checkpoint written by eagle3lib (no eagle3lib_dflash key)")
    c = DFlashConfig(**cfg["eagle3lib_dflash"])
    sd = load_file(str(Path(path) / "model.safetensors"))
    emb, head = sd.pop("embed_tokens.weight"), sd.pop("lm_head.weight")
    model = DFlashDrafter(c, emb, head)
    model.load_state_dict({**sd, "embed_tokens": emb, "lm_head": head, "mask_embedding": emb[c.mask_token_id]})
    return model


def config_from_verifier(vc: Any, aux_layer_ids: list[int], block: int, num_layers: int = 1) -> DFlashConfig:
    """A DFlash drafter of the verifier's (text) config's shape."""
    rope = getattr(vc, "rope_parameters", None) or {}
    hd = getattr(vc, "head_dim", None) or vc.hidden_size // vc.num_attention_heads
    mask = vc.pad_token_id if getattr(vc, "pad_token_id", None) is not None else vc.eos_token_id
    return DFlashConfig(hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
                        num_heads=vc.num_attention_heads, num_kv_heads=vc.num_key_value_heads, head_dim=hd,
                        num_layers=num_layers, rms_norm_eps=vc.rms_norm_eps,
                        rope_theta=float(rope.get("rope_theta", getattr(vc, "rope_theta", 10000.0))),
                        vocab_size=vc.vocab_size, target_hidden_size=vc.hidden_size, aux_layer_ids=list(aux_layer_ids),
                        block=block, mask_token_id=int(mask if not isinstance(mask, list) else mask[0]),
                        max_position_embeddings=vc.max_position_embeddings)


def dflash_problems(ckpt: Path, vconf: Any) -> list[str]:
    """Why a DFlash checkpoint does not fit this verifier (text config `vconf`), or why vLLM cannot load it: checked
    before a server starts, since vLLM would load a mismatched one and accept nothing."""
    try:
        cfg = json.loads((Path(ckpt) / "config.json").read_text())
        c = DFlashConfig(**cfg["eagle3lib_dflash"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"not a DFlash checkpoint written by eagle3lib ({type(e).__name__}: {e})"]
    problems = []
    if c.target_hidden_size != int(vconf.hidden_size):
        problems.append(f"target_hidden_size {c.target_hidden_size} != the verifier's hidden_size {vconf.hidden_size}")
    if c.vocab_size != int(vconf.vocab_size):
        problems.append(f"vocab_size {c.vocab_size} != the verifier's vocab_size {vconf.vocab_size}")
    L = int(vconf.num_hidden_layers)
    if any(not 0 <= i < L for i in c.aux_layer_ids):
        problems.append(f"aux_hidden_state_layer_ids {list(c.aux_layer_ids)} do not fit a verifier with {L} layers")
    if not (Path(ckpt) / "model.safetensors").exists():
        problems.append("no model.safetensors")
    return problems
