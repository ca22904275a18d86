"""The `train` section: the EAGLE-3 drafter, its training-time test and the training loop (see eagle3lib/stages/train.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from eagle3lib.config.base import StageConfig


class TrainConfig(StageConfig):
    # --- drafter architecture (written to the checkpoint's config.json; a resume with other values is an error)
    num_layers: int = 1  # decoder layers in the drafter; EAGLE-3 uses 1 (vLLM loads more, layer 0 takes 2H inputs)
    intermediate_size: int | None = None  # drafter MLP width; None = the verifier's intermediate_size
    num_attention_heads: int | None = None  # None = the verifier's; head count of the drafter's attention
    num_key_value_heads: int | None = None  # None = the verifier's; GQA like the verifier keeps the KV cache small
    head_dim: int | None = None  # None = the verifier's head_dim (or hidden / heads)
    rope_theta: float | None = None  # None = the verifier's rope theta; vLLM applies it at position t+k for step k
    draft_vocab_size: int = 32000  # most frequent loss-masked target tokens; clipped to the verifier's vocab
    norm_before_residual: bool = False  # EAGLE-3 reference: residual is the un-normed fc output (vLLM flag, written)
    norm_output: bool = False  # feed back the normed hidden state instead of the pre-norm one (vLLM flag, written)
    norm_before_fc: bool = False  # RMSNorm over the 3H features before fc (vLLM flag, written)
    fc_norm: bool = False  # one RMSNorm per auxiliary layer before fc (vLLM flag, written)

    # --- training-time test and loss
    ttt_steps: int = 3  # K drafted tokens trained per position; vLLM's num_speculative_tokens for the checkpoint
    decay: float = 0.8  # loss weight decay**k of TTT step k (EAGLE/SpecForge 0.8; speculators 1.0)
    out_of_vocab: Literal["mask", "keep"] = "mask"  # positions whose verifier argmax is outside the draft vocab:
    # "mask" drops them from the loss (the drafter can never propose that token); "keep" trains on the renormalised rest

    # --- data and batching
    max_seq_len: int = 2048  # tokens per packed row (longer samples are truncated and counted)
    packing: bool = True  # pack several samples per row (block-diagonal attention); False = one sample per row
    batch_rows: int = 8  # rows per optimizer step over all processes (the global batch)
    micro_batch_rows: int = 1  # rows per forward pass on one process; grad accumulation fills batch_rows
    val_fraction: float = 0.05  # held-out share of samples, evaluated at the end of every epoch
    val_max_samples: int = 200  # cap on the held-out split, so validation stays a small fraction of an epoch
    max_samples: int | None = None  # use only the first N samples of the store (None = all)

    # --- optimisation
    epochs: float = 2.0  # passes over the training split (fractional: stop part-way through the last)
    max_steps: int | None = None  # optional cap on optimizer steps (overrides epochs when smaller)
    lr: float = 1e-4  # peak AdamW learning rate (EAGLE-3 reference 5e-5..1e-4 at batch ~16k tokens)
    min_lr_ratio: float = 0.1  # cosine decay floor, as a fraction of lr
    warmup_steps: int = 50  # linear warmup
    weight_decay: float = 0.0  # AdamW weight decay (EAGLE-3 reference: none)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas
    grad_clip: float = 0.5  # global grad-norm clip (EAGLE-3 reference 0.5)
    seed: int = 0  # init, data order and validation split

    # --- hardware
    nproc_per_node: int = 1  # processes (GPUs) per node; > 1 launches torchrun
    nnodes: int = 1  # nodes for multi-node torchrun (launch the same command on each node)
    distributed: Literal["ddp", "fsdp"] = "ddp"  # FSDP2 (fully_shard) shards params/optimizer for large drafters
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto = cuda when available
    precision: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    kernels: Literal["auto", "torch", "triton"] = "auto"  # RMSNorm + draft-vocab loss kernels; auto = triton on CUDA
    attention: Literal["auto", "doc", "doc-sdpa", "dense", "sdpa"] = "auto"  # TTT attention (eagle3lib/model/ttt.py): "doc"
    # lays each packed sample out on its own (cost ~ sample length^2, not row length^2); "sdpa" = one SDPA over the
    # packed row with the boolean [block-causal | diagonals] mask; auto = doc (fastest in benchmarks/train_throughput.py)
    threads: int | None = None  # torch CPU threads per process; None = cores / processes per node

    # --- logging and checkpoints
    log_every: int = 10  # optimizer steps per metrics record (and console line)
    ckpt_every: int = 200  # optimizer steps between checkpoints (a final one is always written)
    keep_checkpoints: int = 2  # keep the newest N step checkpoints
    resume: bool = True  # continue from the newest checkpoint in RUN_DIR/train/checkpoints when there is one

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.ttt_steps < 1:
            raise ValueError("ttt_steps must be >= 1")
        if not 0 < self.decay <= 1:
            raise ValueError("decay must be in (0, 1]")
        if self.batch_rows % self.micro_batch_rows:
            raise ValueError(f"batch_rows ({self.batch_rows}) must be a multiple of micro_batch_rows ({self.micro_batch_rows})")
        if self.max_seq_len < 4 + self.ttt_steps:
            raise ValueError("max_seq_len is too short for the TTT steps")
        if self.draft_vocab_size < 2:
            raise ValueError("draft_vocab_size must be >= 2")
        if not 0 <= self.val_fraction < 1:
            raise ValueError("val_fraction must be in [0, 1)")
        return self
