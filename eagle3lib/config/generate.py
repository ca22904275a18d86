"""The `generate` section: regenerate responses to the training prompts with the verifier, through its vLLM server."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from eagle3lib.config.base import StageConfig


class GenerateConfig(StageConfig):
    OPERATIONAL = frozenset({"concurrency", "progress"})  # requests in flight; the bar

    # --- prompts
    dataset: str = "builtin:tiny-train"  # JSONL/Parquet in ShareGPT or OpenAI format, or a builtin name; prompt = up to the last user turn
    max_samples: int | None = Field(None, ge=1)  # cap after shuffling (the Kimi run used 10,000); None = every prompt
    shuffle: bool = True  # shuffle before the cap, so a capped run is a uniform sample of a sorted/grouped dataset
    seed: int = 0  # shuffling seed (and the per-request sampling seeds when request_seed is on)
    on_bad_record: Literal["error", "skip"] = "error"  # a record the server or a later stage would refuse (malformed JSON, content that is not text, a tool call without an id, a lone surrogate, a category that is not a string) stops the run before any request, naming file:line and key; skip: counted by reason in the manifest (bad_records_by_reason) and on the console
    turns: Literal["last", "first", "all"] = "last"  # last: answer the last user turn after the dataset's earlier answers; first: only the first user turn (the rest of the conversation dropped); all: every assistant turn in order, each after the verifier's own earlier answers (eagle3lib/data/multi_turn.py)
    allow_empty: bool = False  # a dataset with no usable prompt completes with 0 samples instead of failing (which is usually a mistake)
    # --- sampling (sent with every request)
    max_tokens: int | None = Field(1024, ge=1)  # response budget incl. reasoning; cut-off responses are kept as status "truncated"; None = up to the context limit
    temperature: float = Field(0.0, ge=0.0)  # 0 = greedy; reasoning models recommend sampling (Qwen3 0.6, Kimi-K2.5 1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)  # nucleus sampling, from the model card with temperature
    request_seed: bool = False  # per-request seed derived from `seed` and the prompt id: reproducible sampled runs (vLLM samples seeded requests more slowly)
    chat_template_kwargs: dict[str, Any] = {}  # passed to the chat template, e.g. {"enable_thinking": true}
    stop_loops: bool = False  # the server ends an answer once it loops (vLLM >= 0.17's repetition_detection,
    # eagle3lib/data/loops.py), recorded "truncated" (no end of turn): a loop's copies past its second period are
    # trimmed in extract anyway, and small models spend ~40% of their generated tokens on them (SmolLM2,
    # docs/howto/real-model.md). A loop that would have broken off later loses what followed
    extra_body: dict[str, Any] = {}  # other vLLM sampling fields sent verbatim (top_k, min_p, repetition_penalty, stop_token_ids)
    # --- client
    concurrency: int = Field(16, ge=1)  # requests in flight; tens on CPU, hundreds on a GPU server (the batch vLLM can form)
    request_timeout_s: float = Field(4 * 3600.0, gt=0)  # one response may take this long: reasoning models think for minutes (a 60 s default broke a real run)
    connect_timeout_s: float = Field(10.0, gt=0)  # establishing a connection is quick; an unreachable server fails within this
    max_attempts: int = Field(5, ge=1)  # tries per prompt for 5xx, 429, timeouts and dropped connections, before it is recorded failed
    backoff_base_s: float = Field(1.0, gt=0)  # first retry delay; doubles per try, with full jitter
    backoff_max_s: float = Field(30.0, gt=0)  # cap on one retry delay
    server_down_wait_s: float = Field(600.0, ge=0)  # keep retrying while connections are refused (server restarting) or the server answers nothing, not even /health (hung, stopped), this long, then stop the run naming the server (resumable) instead of recording every prompt failed
    stall_report_s: float = Field(120.0, gt=0)  # no answer for this long with requests in flight: say so on the console (the server may be hung), again every this many seconds
    server_restarts: int = Field(2, ge=0)  # a local server this stage started that dies mid-run is restarted this often
    retry_failed: bool = True  # a re-run retries prompts recorded as failed (mostly transient); ok/truncated/empty are final
    # --- output
    shard_records: int = Field(10_000, ge=1)  # records per output shard (generate/shard-NNNNN.jsonl) before rolling to the next
    fsync_interval_s: float = Field(1.0, ge=0)  # fsync the open shard at most this often (a kill -9 loses nothing; power loss at most this much)
    progress: bool = True  # tqdm bar with samples/s and tokens/s

    @field_validator("extra_body")
    @classmethod
    def _no_reserved_keys(cls, v: dict[str, Any]) -> dict[str, Any]:
        reserved = {"model", "messages", "stream", "n", "repetition_detection"} & set(v)
        if reserved:
            raise ValueError(f"keys {sorted(reserved)} are set by the stage itself (one non-streamed answer per prompt; "
                             "generate.stop_loops sets repetition_detection)")
        return v
