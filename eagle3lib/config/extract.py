"""The `extract` section: verifier hidden states (EAGLE-3 feature layers + final state) for drafter training."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from eagle3lib.config.launch import TorchrunConfig


class ExtractConfig(TorchrunConfig):
    # requests in flight (vllm backend); the bar; the processes
    OPERATIONAL = TorchrunConfig.OPERATIONAL | frozenset({"concurrency", "progress"})

    # nproc_per_node, nnodes, rdzv_endpoint, rdzv_id (eagle3lib/config/launch.py): > 1 process splits the samples by id
    # across torchrun ranks, each writing its own shards into the one store (hf: a GPU per rank; vllm: a server per
    # rank with verifier.tensor_parallel_size GPUs)
    # --- input
    source: str = "generate"  # "generate" = the generate stage's ok responses in this run; or a dataset path / builtin:... (prefill-only)
    max_samples: int | None = Field(None, ge=1)  # cap on conversations read (in source order); None = all
    truncated_answers: Literal["keep", "drop"] = "keep"  # answers cut at generate.max_tokens are still the verifier's
    # own tokens: keep them (as generated, no end-of-turn token after them) or drop them; both counted
    looping_answers: Literal["keep", "trim"] = "keep"  # an answer that loops (the same n-gram repeated to its end, as
    # small models do until max_tokens): keep it whole, or trim it after two periods of the loop (the repeats after
    # them teach a drafter nothing more and cost extraction and training time); counted either way
    on_bad_record: Literal["error", "skip"] = "error"  # a sample that does not load or tokenize stops the run (naming it) or is skipped and counted
    # --- tokenization
    max_sample_tokens: int = Field(2048, ge=8)  # tokens kept per sample (the per-sample cut; train.packed_row_tokens is the row length); the Kimi run used 2048 for extraction, 8192 for training
    too_long: Literal["truncate", "drop"] = "truncate"  # longer samples: cut to max_sample_tokens (keeps the early turns) or drop; both counted
    chat_template_kwargs: dict[str, Any] = {}  # passed to the verifier's chat template, e.g. {"enable_thinking": true}
    mask_method: Literal["auto", "generation", "prefix"] = "auto"  # auto: {% generation %} markers if the template has them, else prefix rendering
    answer_tokens: Literal["generated", "rendered"] = "generated"  # generated: a record's last answer is trained on as
    # the token ids the verifier generated (generate keeps them), after the rendered prompt; rendered: as the chat
    # template re-renders its reasoning and content (also every record without ids: datasets, older runs)
    end_of_turn: list[str] = []  # strings that end an assistant turn (prefix method); [] = the tokenizer's eos token
    # --- backend
    backend: Literal["hf", "vllm"] = "hf"  # hf: transformers + forward hooks (CPU/GPU, device_map); vllm: extract_hidden_states (tensor parallel)
    device: str = "auto"  # hf backend: "auto" (cuda if present, else cpu), "cpu", "cuda", "cuda:1"
    device_map: str | None = None  # hf backend: "auto" spreads a verifier larger than one GPU over all GPUs (overrides device)
    hf_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # hf backend compute precision; auto = verifier.dtype on GPU, float32 on CPU (bf16 matmuls are emulated, ~4x slower, without AVX512-BF16/AMX)
    batch_tokens: int = Field(16384, ge=1)  # hf backend: padded tokens per forward (batch x longest sample); samples are length-sorted to cut padding
    cpu_threads: int | None = Field(None, ge=1)  # hf backend on CPU: torch threads; None = torch's default
    concurrency: int = Field(32, ge=1)  # vllm backend: requests in flight (vLLM batches their prefills)
    request_timeout_s: float = Field(3600.0, gt=0)  # vllm backend: one prefill of a long sample on a loaded server may queue for minutes
    vllm_args: list[str] = ["--no-enable-prefix-caching"]  # vllm backend: extra api_server args for the extraction server (after verifier.extra_server_args)
    final_state_check: int = Field(2, ge=0)  # samples (first 512 tokens each) whose stored final state must reproduce
    # the verifier's own logits before the rest is extracted (a dropped or shifted last layer fails here); 0 = off
    # --- output
    dtype: Literal["bfloat16", "float32", "float8_e4m3fn"] = "bfloat16"  # stored precision (and the rounding of states
    # computed online); fp8 (e4m3, per-token scales) halves the disk; float32 doubles it (exact comparisons, tests)
    samples_per_shard: int = Field(256, ge=1)  # samples per safetensors shard; size shards at ~1 GB (samples x tokens x bytes/token)
    max_shard_bytes: int | None = Field(None, ge=1)  # also close a shard once it holds this many bytes (long samples); None = count only
    disk_margin_gib: float = Field(1.0, ge=0)  # refuse to start unless the output disk has the estimate plus this much free
    progress: bool = True  # tqdm bar with tokens/s
