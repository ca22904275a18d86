"""The `evaluate` section: acceptance length and speedup measured by real speculative decoding (eagle3lib/stages/evaluate.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from eagle3lib.config.base import StageConfig


def check_schedule(schedule: list[tuple[int, int, int]], key: str) -> None:
    """vLLM's rules for num_speculative_tokens_per_batch_size (vllm/v1/spec_decode/dynamic/utils.py), checked before a
    server is started: non-empty, ranges sorted, positive, not overlapping, the first from batch size 1, K >= 0, one K
    above 0."""
    if not schedule:
        raise ValueError(f"{key}: at least one (first batch size, last batch size, K) range")
    prev = 0
    for i, (lo, hi, k) in enumerate(schedule):
        if i == 0 and lo != 1:
            raise ValueError(f"{key}[0]: the first range starts at batch size 1, got {lo}")
        if not prev < lo <= hi or k < 0:
            raise ValueError(f"{key}[{i}] = ({lo}, {hi}, {k}): ranges increase without overlap (after {prev}), "
                             "first <= last, K >= 0")
        prev = hi
    if all(k == 0 for *_, k in schedule):
        raise ValueError(f"{key}: every K is 0: nothing to draft")


class EvaluateConfig(StageConfig):
    OPERATIONAL = frozenset({"progress"})  # concurrency is not: the speedup is measured at it

    # --- what is evaluated
    checkpoint: str | None = None  # None or "best" = this run's train/best/ (best validation acceptance) when it is
    # not the last step, else train/final/; "final" = train/final/; or a drafter folder
    ttt_steps: int | None = Field(None, ge=1)  # draft tokens per verification round (vLLM's num_speculative_tokens); None = train.ttt_steps
    drafters: list[str] = []  # other drafter folders (either layout; the one served today, a published one) measured
    # beside this run's through vLLM: same prompts, K and server settings, one server each (eagle3lib/evaluation/drafters.py)
    # --- prompts
    prompts: str = "builtin:tiny-heldout"  # JSONL/Parquet (OpenAI or ShareGPT); prompt = up to the last user turn; per-category results use the record's `category`
    n_prompts: int | None = Field(48, ge=1)  # prompts sampled (stratified by category, seeded); None = all
    seed: int = 0  # prompt sample and the sampling seeds of both measurements
    chat_template_kwargs: dict[str, Any] = {}  # passed to the chat template, e.g. {"enable_thinking": true}
    # --- decoding (the same for the library and vLLM)
    max_tokens: int = Field(128, ge=1)  # new tokens per prompt, stopping earlier at EOS
    temperature: float = Field(0.8, gt=0.0)  # the sampled measurement's temperature (greedy runs at 0); use the model card's
    modes: list[Literal["greedy", "sampled"]] = ["greedy", "sampled"]  # which decodings are measured
    draft_sampling: Literal["greedy", "probabilistic"] = "greedy"  # library drafter: argmax proposals (vLLM's default; q one-hot) or samples from q
    # --- library speculative decoding (HF verifier + the drafter, one sequence at a time)
    library: bool = True  # measure tau and the speedup over plain decoding with transformers
    lib_max_prompts: int | None = Field(None, ge=1)  # cap on prompts for the library (a large verifier on HF is slow); None = all
    lib_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # HF precision; fp32 on CPU (no fast bf16 matmul here)
    device: str = "auto"  # library: "auto" (cuda if present), "cpu", "cuda", "cuda:1"
    device_map: str | None = None  # library: "auto" spreads a verifier larger than one GPU (overrides device)
    cpu_threads: int | None = Field(1, ge=1)  # torch threads on CPU; 1 is fastest for the tiny model (batch 1, tiny matmuls); None = default
    # --- vLLM measurement (verifier served with the drafter as its EAGLE-3 speculator, and without it)
    vllm: bool = True  # measure tau from vLLM's spec-decode counters and throughput with/without the drafter
    concurrency: int = Field(8, ge=1)  # requests in flight, the same for both servers
    per_prompt: bool = False  # every prompt measured alone (one request in flight, vLLM's counters read around it):
    # tau per prompt, hence tau's interval over prompts and tau apart for answers that loop; tokens/s and the speedup
    # are then single-stream (eagle3lib/evaluation/per_prompt.py)
    speed_repeats: int = Field(0, ge=0)  # also measure the speedup with the two servers interleaved: this many pairs of
    # greedy passes alternating between them (order alternating too), the median ratio and its range
    # (eagle3lib/evaluation/interleaved_speed.py); needs both servers up at once (CPU, or given URLs); 0 = off
    spec_server_url: str | None = None  # an already running server with this drafter as speculator; None = start one
    base_server_url: str | None = None  # an already running server of the verifier alone; None = start one
    server_args: list[str] = []  # extra api_server args for both local servers (after verifier.extra_server_args)
    overlap_startup: bool | None = None  # start local servers while the library measures (saves minutes; its timings are interleaved per prompt, so its ratio holds); None = on CPU only (on GPUs the servers and the HF verifier would compete for memory)
    warmup_requests: int = Field(2, ge=0)  # untimed requests per server before measuring (first-request overheads)
    request_timeout_s: float = Field(600.0, gt=0)  # one completion may take this long
    connect_timeout_s: float = Field(10.0, gt=0)  # an unreachable server fails within this
    ttt_steps_sweep: list[int] = []  # also measure greedy tau, acceptance per position and tokens/s at each of these K
    # through vLLM, one speculative server each (the main K reuses the main greedy pass: a server start fewer), and recommend
    # a K: measured here, and from a GPU cost model (eagle3lib/evaluation/k_sweep.py); [] = no sweep
    concurrency_sweep: list[int] = []  # also measure greedy tokens/s and time per output token at each of these
    # concurrencies, with the verifier alone and at each K of ttt_steps_sweep (or the main K), one server per K reused
    # across them; then the K per batch size that was fastest, served as vLLM's num_speculative_tokens_per_batch_size
    # and measured against every fixed K (eagle3lib/evaluation/concurrency_grid.py); [] = none
    grid_repeats: int = Field(3, ge=1)  # each grid point measured this many times, the fastest pass kept (timeit's
    # rule: interference only slows a pass): on 2 shared cores single passes of the same point varied up to 3x
    ttt_steps_schedule: list[tuple[int, int, int]] | None = None  # with concurrency_sweep: serve and measure this
    # schedule, vLLM's (first batch size, last batch size, K) ranges (e.g. the one deployed today), instead of the one
    # derived from the grid (still reported); None = the derived one
    draft_sample_methods: list[Literal["greedy", "probabilistic"]] = []  # also measure sampled tau through vLLM
    # with the drafter proposing its argmax ("greedy": vLLM's default, q one-hot in the ratio test) and sampling from
    # q ("probabilistic": its full q in the ratio test), each on its own server, every prompt alone at each of
    # sampling_temperatures: tau with its interval over prompts, the gain over "greedy" paired by prompt, and the
    # library's tau with the same drafting beside it (eagle3lib/evaluation/draft_sampling.py); [] = none
    sampling_temperatures: list[float] = []  # the temperatures of that comparison; [] = evaluate.temperature
    block_verification: bool = False  # with draft_sample_methods: each also served with vLLM's block verification
    # (rejection_sample_method: block); a vLLM that cannot serve it here is said so, with the command for a GPU
    context_buckets: list[int] = []  # context-length edges in tokens, e.g. [4096, 8192]: tau also per bucket ("<4K",
    # "4K-8K", ">=8K"): the library per round (prompt + tokens generated so far), vLLM per prompt-length group
    # (eagle3lib/data/context_buckets.py); [] = none
    # --- comparison
    tolerance: float = Field(0.15, ge=0)  # |tau_lib - tau_vllm| (greedy) flagged beyond this: bf16 serving vs fp32 library diverge on near-ties (measured gaps ~0.01)
    tolerance_sampled: float = Field(0.3, ge=0)  # the same for sampled decoding (independent samples: ~0.05 standard deviation at ~800 rounds)
    progress: bool = True  # tqdm bars


    def served_k(self, train_ttt_steps: int) -> int:
        """The K evaluation serves and measures: evaluate.ttt_steps, else the K the drafter trained for (the one rule:
        evaluate, the recipes study and the reports use it)."""
        return self.ttt_steps or train_ttt_steps

    @model_validator(mode="after")
    def _check(self) -> EvaluateConfig:
        if not self.modes:
            raise ValueError("evaluate.modes: at least one of greedy, sampled")
        if not (self.library or self.vllm):
            raise ValueError("evaluate.library and evaluate.vllm are both false: nothing to measure")
        if self.drafters and not (self.vllm and "greedy" in self.modes):
            raise ValueError("evaluate.drafters are measured by greedy decoding through vLLM: it needs evaluate.vllm "
                             "true and greedy in evaluate.modes")
        if self.ttt_steps_sweep and not (self.vllm and "greedy" in self.modes):
            raise ValueError("evaluate.ttt_steps_sweep measures greedy decoding through vLLM: it needs evaluate.vllm "
                             "true and greedy in evaluate.modes")
        if self.concurrency_sweep and not (self.vllm and "greedy" in self.modes):
            raise ValueError("evaluate.concurrency_sweep measures greedy decoding through vLLM: it needs evaluate.vllm "
                             "true and greedy in evaluate.modes")
        if self.concurrency_sweep != sorted(set(self.concurrency_sweep)) or any(c < 1 for c in self.concurrency_sweep):
            raise ValueError(f"evaluate.concurrency_sweep: increasing concurrencies >= 1, got {self.concurrency_sweep}")
        if self.ttt_steps_schedule is not None:
            if not self.concurrency_sweep:
                raise ValueError("evaluate.ttt_steps_schedule is measured over evaluate.concurrency_sweep: set both")
            check_schedule(self.ttt_steps_schedule, "evaluate.ttt_steps_schedule")
        if self.context_buckets != sorted(set(self.context_buckets)) or any(e < 1 for e in self.context_buckets):
            raise ValueError(f"evaluate.context_buckets: increasing token counts >= 1, got {self.context_buckets}")
        if self.block_verification and not self.draft_sample_methods:
            raise ValueError("evaluate.block_verification is measured beside evaluate.draft_sample_methods: set both")
        if any(t <= 0 for t in self.sampling_temperatures):
            raise ValueError(f"evaluate.sampling_temperatures: sampled decoding, every temperature > 0, got "
                             f"{self.sampling_temperatures}")
        if (self.draft_sample_methods or self.sampling_temperatures) and not self.vllm:
            raise ValueError("evaluate.draft_sample_methods are measured through vLLM: it needs evaluate.vllm true")
        if any(k < 1 for k in self.ttt_steps_sweep):
            raise ValueError(f"evaluate.ttt_steps_sweep: every K is at least 1, got {self.ttt_steps_sweep}")
        return self
