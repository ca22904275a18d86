"""The deployment section: which K to serve at which concurrency on which machine, from a labelled model of a decode
round's time (eagle3lib/analysis/decode_time.py) and, where the run has it, the evaluate stage's measured grid.

It runs no model: it reads the evaluate stage's results and the profile's shapes, so it also plans a verifier this
machine cannot load (the kimi-k2.5 profile states its verifier's shape here, from the model's config.json).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from eagle3lib.config.base import StageConfig


class VerifierShape(BaseModel):
    """What one decode step of the verifier reads and computes (HF config names, so a config.json's values paste in)."""

    model_config = ConfigDict(extra="forbid")

    num_hidden_layers: int = Field(ge=1)  # every layer's weights and KV cache are read per step
    hidden_size: int = Field(ge=1)  # width of every projection
    vocab_size: int = Field(ge=1)  # lm_head rows: read per step, and the logits' FLOPs
    intermediate_size: int = Field(ge=1)  # the dense MLP's width (an MoE's first_k_dense_replace layers)
    num_attention_heads: int = Field(ge=1)  # query heads: attention FLOPs over the context
    num_key_value_heads: int | None = None  # GQA: KV bytes per token; None = num_attention_heads
    head_dim: int | None = None  # per head; None = hidden_size / num_attention_heads
    q_lora_rank: int | None = None  # MLA (DeepSeek-V3, Kimi): the query down-projection; None = a full q_proj
    kv_lora_rank: int | None = None  # MLA: the latent the KV cache stores (with the rope part); None = not MLA
    qk_nope_head_dim: int | None = None  # MLA: the non-rotary query/key width per head
    qk_rope_head_dim: int | None = None  # MLA: the rotary width, cached beside the latent
    v_head_dim: int | None = None  # MLA: value width per head
    n_routed_experts: int = Field(0, ge=0)  # MoE: experts per layer (0 = dense): a batch touches more of them
    num_experts_per_tok: int = Field(0, ge=0)  # MoE: top-k routing
    n_shared_experts: int = Field(0, ge=0)  # MoE: experts every token runs (read every step)
    moe_intermediate_size: int = Field(0, ge=0)  # MoE: each expert's MLP width
    first_k_dense_replace: int = Field(0, ge=0)  # MoE: the first layers keep a dense MLP
    weight_bytes: float = Field(2.0, gt=0)  # per parameter (bf16 = 2)
    expert_weight_bytes: float | None = Field(None, gt=0)  # routed experts' bytes per parameter when quantized apart
    # (Kimi-K2.5 ships int4 experts: 0.5 + a bf16 scale per 32 = 0.5625); None = weight_bytes
    kv_cache_bytes: float = Field(2.0, gt=0)  # per cached element (bf16 = 2, fp8 = 1)


class DeploymentConfig(StageConfig):
    hardware: list[str] = []  # rows of the hardware table to plan for; [] = cost_projection.hardware, else every row
    hardware_file: str = "params/hardware.yaml"  # the hardware table (default: the repo's; a path you set is relative to where the run starts)
    results_run_dir: str | None = None  # run whose evaluate results (acceptance, the concurrency grid) and trained
    # drafter are read; None = this run
    concurrencies: list[int] = [1, 2, 4, 8, 16, 32, 64, 128, 256]  # requests decoding at once (vLLM's batch): the
    # modelled curves' x axis; 256 = vLLM's default max_num_seqs
    ttt_steps: list[int] = [1, 2, 3, 4, 5]  # K values modelled (K = 0, the verifier alone, is always the baseline)
    context_tokens: int = Field(2048, ge=1)  # mean tokens in each request's KV cache while it decodes: the cache read
    # per step grows with it (prompt + half the answer is a fair mean); also what each request holds when the plan
    # checks that the machine has memory for every request's cache (eagle3lib/analysis/capacity.py, with
    # verifier.gpu_memory_utilization)
    acceptance_per_position: list[float] | None = None  # conditional acceptance a_i of draft position i (tau(K) =
    # 1 + sum_k prod_{i<=k} a_i); None = this run's measured rates (evaluate's grid, else its K sweep)
    acceptance_note: str = ""  # where hand-entered acceptance rates come from; shown next to the curves
    verifier_shape: VerifierShape | None = None  # the verifier's shape; None = its config.json (verifier.model)
    bandwidth_efficiency: float = Field(0.7, gt=0, le=1)  # share of peak memory bandwidth a decode step achieves
    # (decode kernels reach ~60-80% of HBM peak)
    flops_efficiency: float = Field(0.3, gt=0, le=1)  # share of peak BF16 FLOP/s a verification step achieves: set
    # against two published EAGLE-3 batch sweeps (docs/howto/choose-k.md): 0.5 overestimates their speedup
    # at batch 2-64 by 14-65%, 0.3 lands within -13%..+25% (small per-request blocks run far below peak)
    step_overhead_ms: float = Field(0.5, ge=0)  # fixed time per forward (scheduling, sampling, launches between CUDA
    # graphs): paid by each drafter forward too, so it is what makes many cheap drafter steps add up
    tp_layer_overhead_us: float = Field(130.0, ge=0)  # fixed time per layer per forward when tensor parallelism spans
    # the machine's GPUs (two all-reduces a layer, small per-GPU kernels): fitted to InferenceX's Kimi-K2.5 on 8x H200
    # at 4 requests (129 us), checked on 15 published points it was not fitted to
    # (eagle3lib/analysis/published_decode.py, docs/howto/choose-k.md); 0 on one GPU

    @field_validator("concurrencies", "ttt_steps")
    @classmethod
    def _increasing(cls, v: list[int], info) -> list[int]:
        if not v or v != sorted(set(v)) or v[0] < 1:
            raise ValueError(f"deployment.{info.field_name}: increasing values >= 1, got {v}")
        return v

    @field_validator("acceptance_per_position")
    @classmethod
    def _rates(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (not v or any(not 0 <= a <= 1 for a in v)):
            raise ValueError(f"deployment.acceptance_per_position: rates in [0, 1], one per draft position, got {v}")
        return v
