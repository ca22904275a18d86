"""A MODEL of one speculative decoding round's time on a GPU machine, for planning which K to serve at which batch
size. It counts bytes and FLOPs from the shapes; it is never a measurement and everything that shows it says so.

One round for B requests decoding at once (vLLM's batch), K drafted tokens each, S tokens of context per request:

  verifier step    checks K + 1 tokens per request: T = B (K + 1) tokens in one forward
     bytes  = the weights every token needs (attention, dense MLPs, shared experts, routers, lm_head)
            + MoE layers x E_touched(T) x bytes per expert    E_touched(T) = E (1 - (1 - k/E)^T): the experts T tokens
              reach under top-k routing (uniform routing assumed; real routing is skewed, so fewer are touched)
            + B x S x KV bytes per token                      each request's cache is read once, whatever K
     FLOPs  = 2 x active parameters x T + T x S x attention FLOPs per context token
  drafter          K forwards (vLLM's EAGLE proposer): the first over the tokens the last round accepted (B x tau, the
                   only one that runs fc, once per round), then K - 1 over B tokens; each reads its layer, its lm_head
                   (draft vocabulary) and its one-layer KV cache
  each forward     max(bytes / (GPUs x bandwidth x bandwidth_efficiency), FLOPs / (GPUs x peak x flops_efficiency))
                   + step_overhead (scheduling, sampling, launches): the larger of memory and compute time, as a
                   roofline; tensor parallelism splits both over the machine's GPUs
                   + layers x layer_overhead under tensor parallelism (GPUs > 1): a fixed cost per layer whatever the
                   batch (two all-reduces a layer and the many small per-GPU kernels between them), which the
                   roofline has no term for; fitted to one published measurement (published_decode.py)

  tokens per round = tau(K) per request; speedup(B, K) = tau(K) x verifier_step(B, K = 0) / round_time(B, K)

Why speculation stops paying: at small B the verifier step is memory-bound, so checking K + 1 tokens costs about what
one does; as B grows, T = B (K + 1) makes the step compute-bound (and, for an MoE, reach every expert), the K + 1
tokens cost K + 1 times as much, and a rejected draft is paid for. The drafter's K forwards cost about the same at any
B (small weights), so a step overhead that dominates them is what makes large K lose at every B.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3lib.model.drafter_shape import DrafterShape


@dataclass(frozen=True)
class Machine:
    """The figures a decode step depends on (a params/hardware.yaml row)."""

    gpus: int  # tensor parallel over the whole machine
    bandwidth: float  # bytes/s per GPU, peak
    flops: float  # dense BF16 FLOP/s per GPU, peak
    bandwidth_efficiency: float = 0.7  # share of peak a decode step reaches
    flops_efficiency: float = 0.3  # share of peak a verification step reaches
    overhead_s: float = 0.0005  # per forward
    layer_overhead_s: float = 0.0  # per layer per forward: the tensor-parallel fixed cost (0 on one GPU)

    def seconds(self, nbytes: float, nflops: float, layers: int = 0) -> float:
        mem = nbytes / (self.gpus * self.bandwidth * self.bandwidth_efficiency)
        comp = nflops / (self.gpus * self.flops * self.flops_efficiency)
        return max(mem, comp) + self.overhead_s + layers * self.layer_overhead_s


class VerifierCost:
    """Bytes and FLOPs of the verifier's forwards, from an eagle3lib.config.deployment.VerifierShape."""

    def __init__(self, v):
        h, L = v.hidden_size, v.num_hidden_layers
        self.layers = L
        heads = v.num_attention_heads
        if v.kv_lora_rank:  # MLA: low-rank q, a cached latent of kv_lora_rank + rope, expanded per head
            qk = (v.qk_nope_head_dim or 128) + (v.qk_rope_head_dim or 64)
            q = h * v.q_lora_rank + v.q_lora_rank * heads * qk if v.q_lora_rank else h * heads * qk
            vd = v.v_head_dim or 128
            attn = q + h * (v.kv_lora_rank + (v.qk_rope_head_dim or 64)) + v.kv_lora_rank * heads * (
                (v.qk_nope_head_dim or 128) + vd) + heads * vd * h
            kv_elems = v.kv_lora_rank + (v.qk_rope_head_dim or 64)
            kv_heads = 1  # vLLM caches the latent as one MQA head (get_num_kv_heads: 1 under MLA)
            # decode runs MLA absorbed: scores over the latent + rope, values out of the latent
            self.attn_flops_per_ctx = L * 2 * heads * (kv_elems + v.kv_lora_rank)
        else:
            hd = v.head_dim or h // heads
            kv = v.num_key_value_heads or heads
            attn = 2 * h * heads * hd + 2 * h * kv * hd
            kv_elems, kv_heads = 2 * kv * hd, kv
            self.attn_flops_per_ctx = L * 4 * heads * hd
        moe_layers = L - v.first_k_dense_replace if v.n_routed_experts else 0
        expert = 3 * h * v.moe_intermediate_size
        dense_mlp = 3 * h * v.intermediate_size
        self.moe_layers, self.experts, self.top_k = moe_layers, v.n_routed_experts, v.num_experts_per_tok
        router = h * v.n_routed_experts
        shared = (L * attn + (L - moe_layers) * dense_mlp + moe_layers * (v.n_shared_experts * expert + router)
                  + v.vocab_size * h)  # read every step; the embedding's rows are a lookup, left out
        self.shared_bytes = shared * v.weight_bytes
        self.expert_bytes = expert * (v.expert_weight_bytes or v.weight_bytes)
        self.active_params = shared + moe_layers * v.num_experts_per_tok * expert
        self.kv_bytes_per_token = L * kv_elems * v.kv_cache_bytes
        self.kv_heads = kv_heads  # what tensor parallelism splits the cache by (or copies it to every GPU)
        self.total_params = shared + moe_layers * v.n_routed_experts * expert
        # what the GPUs hold: every expert, and the embedding that a step only looks rows up in
        self.weight_bytes_held = (self.shared_bytes + moe_layers * v.n_routed_experts * self.expert_bytes
                                  + v.vocab_size * h * v.weight_bytes)

    def experts_touched(self, tokens: float) -> float:
        """Distinct experts per MoE layer that `tokens` tokens reach under uniform top-k routing."""
        if not self.experts:
            return 0.0
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** tokens)

    def step(self, batch: int, tokens_per_request: int, context: int) -> tuple[float, float]:
        """(bytes, FLOPs) of one forward checking `tokens_per_request` tokens for each of `batch` requests."""
        T = batch * tokens_per_request
        nbytes = (self.shared_bytes + self.moe_layers * self.experts_touched(T) * self.expert_bytes
                  + batch * context * self.kv_bytes_per_token)
        return nbytes, 2.0 * self.active_params * T + T * context * self.attn_flops_per_ctx


class DrafterCost:
    """Bytes and FLOPs of the drafter's forwards (one EAGLE-3 layer, bf16 weights and cache)."""

    def __init__(self, s: DrafterShape, weight_bytes: float = 2.0):
        self.fc = 3 * s.hidden * s.hidden
        self.layer = s.parameters() - self.fc  # the layers, final norm and the draft lm_head
        self.weight_bytes = weight_bytes
        self.layers = s.num_layers
        self.weight_bytes_held = s.parameters() * weight_bytes  # the embedding is the verifier's, shared by vLLM
        self.kv_bytes_per_token = s.kv_cache_elements() * weight_bytes
        self.kv_heads = 1 if s.is_mla else s.kv_heads  # vLLM caches an MLA latent as one MQA head
        if s.is_mla:  # decoded absorbed, as the verifier's MLA: scores over latent + rope, values out of the latent
            self.attn_flops_per_ctx = s.num_layers * 2 * s.heads * (2 * s.kv_lora_rank + s.rope_dim)
        else:
            self.attn_flops_per_ctx = s.num_layers * 2 * s.heads * (s.qk_dim + s.v_dim)

    def forward(self, batch: int, tokens: float, context: int, with_fc: bool) -> tuple[float, float]:
        params = self.layer + (self.fc if with_fc else 0)
        nbytes = params * self.weight_bytes + batch * context * self.kv_bytes_per_token
        return nbytes, 2.0 * params * tokens + tokens * context * self.attn_flops_per_ctx


def tau_of(rates: list[float], k: int) -> float:
    """Expected tokens per round with K drafts, from the acceptance per position: rates[i] = share of rounds that
    accept draft i + 1 (vLLM's per-position counters over rounds; for hand-entered conditional rates a_i pass their
    running products). Beyond the rates given, the last conditional rate is assumed to hold."""
    out, p = 1.0, 1.0
    for i in range(k):
        if i < len(rates):
            p = rates[i]
        else:
            last = rates[-1] / rates[-2] if len(rates) >= 2 and rates[-2] > 0 else (rates[-1] if rates else 0.0)
            p *= min(1.0, last)
        out += p
    return out


def chained(conditional: list[float]) -> list[float]:
    """Conditional acceptance a_i -> the share of rounds reaching position i (running products)."""
    out, p = [], 1.0
    for a in conditional:
        p *= a
        out.append(p)
    return out


@dataclass(frozen=True)
class RoundTime:
    batch: int
    ttt_steps: int
    tau: float
    verifier_s: float
    drafter_s: float

    @property
    def seconds(self) -> float:
        return self.verifier_s + self.drafter_s


def round_time(v: VerifierCost, d: DrafterCost, m: Machine, batch: int, k: int, tau: float, context: int,
               verify_tokens: int | None = None, draft_width: int = 1) -> RoundTime:
    """One round: the verifier checking K + 1 tokens per request, and (K > 0) the drafter's K forwards. A tree
    (SGLang's EAGLE defaults, for the published figures): `verify_tokens` per request checked, `draft_width`
    candidates expanded per drafter forward."""
    verifier = m.seconds(*v.step(batch, (verify_tokens or k + 1) if k else 1, context), v.layers)
    drafter = 0.0
    if k > 0:
        drafter = m.seconds(*d.forward(batch, batch * tau, context, with_fc=True), d.layers)
        drafter += (k - 1) * m.seconds(*d.forward(batch, batch * draft_width, context, with_fc=False), d.layers)
    return RoundTime(batch, k, tau if k else 1.0, verifier, drafter)


def speedup(v: VerifierCost, d: DrafterCost, m: Machine, batch: int, k: int, tau: float, context: int,
            verify_tokens: int | None = None, draft_width: int = 1) -> dict:
    """Modelled tokens/s, time per output token and speedup over the verifier alone at one (batch, K)."""
    base = round_time(v, d, m, batch, 0, 1.0, context)
    r = round_time(v, d, m, batch, k, tau, context, verify_tokens, draft_width)
    return {"concurrency": batch, "ttt_steps": k, "tau": r.tau, "round_ms": 1e3 * r.seconds,
            "verifier_ms": 1e3 * r.verifier_s, "drafter_ms": 1e3 * r.drafter_s,
            "tokens_per_s": batch * r.tau / r.seconds, "tpot_ms": 1e3 * r.seconds / r.tau,
            "speedup": r.tau * base.seconds / r.seconds}
