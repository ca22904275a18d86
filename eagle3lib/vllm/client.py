"""The slice of the OpenAI chat-completions API this project speaks, and a retrying client fit for an overnight run.

Reasoning: vLLM with a reasoning parser returns the thinking text in `reasoning` (message and streaming delta); older
vLLM and SGLang call it `reasoning_content`. Reading only one of them silently drops all reasoning (a bug hit in a real
run), so both are read, `reasoning` first.

Why httpx.AsyncClient (not the openai library): it is already a dependency, its timeouts are explicit per phase (a short
connect timeout, a read timeout of hours: reasoning models think for minutes, and a client library's 60 s or 600 s
default broke a real run), retries are ours alone (the openai client adds its own retries and timeouts on top), and the
raw JSON body is read as is, so both `reasoning` and `reasoning_content` are seen (`parse_chat_response`).
Requests are not streamed: one JSON body per response costs the client almost nothing per token, and usage comes back
in the body. Clients come from `endpoint.http_client`.

Error policy, per request:
- HTTP 200: parsed (a body that cannot be parsed is a failure of that prompt).
- HTTP 4xx other than 408/429 (e.g. prompt longer than max_model_len): failed at once, with the server's message.
- HTTP 5xx/408/429, read/write timeouts, connections dropped mid-request: retried with exponential backoff and full
  jitter, up to `max_attempts` tries, then failed with the last error.
- Connection refused / connect timeout (server down or restarting): retried with backoff for up to `server_down_wait_s`
  without using up attempts, then `ServerUnreachable` stops the whole run (resumable) instead of marking every
  remaining prompt failed. With several servers it raises ServerDown at once instead: the prompt moves to another
  server (eagle3lib/vllm/dispatch.py).
- A read timeout from a server that does not answer /health either (hung: SIGSTOP, a deadlock) is the server's fault,
  not the prompt's: it is waited for like a refused connection (ServerUnreachable / ServerDown), instead of using up
  the prompt's attempts and recording every prompt failed. A server whose /health answers is alive: the timeout is the
  prompt's (an answer longer than request_timeout_s) and counts as an attempt.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from eagle3lib.vllm.endpoint import Endpoint, ServerError, http_client

RETRY_STATUS = {408, 429}  # plus every 5xx
ERROR_CHARS = 2000  # server messages kept in a record


class ServerUnreachable(ServerError):
    """The server refused connections for longer than server_down_wait_s: the run stops (and resumes later)."""


class ServerDown(ServerError):
    """With several servers (`failover`): this one refused the connection; its prompt goes to another server."""


@dataclass
class ChatResult:
    reasoning: str | None  # text inside <think>, None when the server returned none
    content: str | None  # the answer
    finish_reason: str | None  # "stop", "length" (cut by max_tokens), ...
    prompt_tokens: int
    completion_tokens: int
    tool_calls: list[dict[str, Any]] | None = None  # parsed calls, from a server started with a tool-call parser
    token_ids: list[int] | None = None  # the generated token ids (vLLM's `return_token_ids`), end-of-turn token
    # included: the answer exactly as the verifier produced it, before any parser split it into reasoning and content
    prompt_token_ids: list[int] | None = None  # the prompt as the server rendered and tokenized it (vLLM's
    # top-level `prompt_token_ids` with return_token_ids): its chat template, kwargs and tool normalisation included


def parse_chat_response(body: dict[str, Any]) -> ChatResult:
    choice = body["choices"][0]
    msg = choice.get("message") or {}
    reasoning = msg.get("reasoning")
    if reasoning is None:
        reasoning = msg.get("reasoning_content")
    usage = body.get("usage") or {}
    ids, prompt_ids = choice.get("token_ids"), body.get("prompt_token_ids")
    return ChatResult(reasoning, msg.get("content"), choice.get("finish_reason"),
                      int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                      msg.get("tool_calls") or None, [int(t) for t in ids] if isinstance(ids, list) else None,
                      [int(t) for t in prompt_ids] if isinstance(prompt_ids, list) else None)


def chat_payload(model: str, messages: list[dict], *, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    # return_token_ids: the answer's token ids come back beside its text (vLLM >= 0.10.2; other servers ignore it), so
    # the extract stage can train on the tokens the verifier generated, not on the chat template's re-rendering
    payload: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                               "temperature": temperature, "top_p": top_p, "return_token_ids": True}
    if seed is not None:
        payload["seed"] = seed
    if chat_template_kwargs:
        payload["chat_template_kwargs"] = chat_template_kwargs
    return payload


def chat_once(endpoint: Endpoint, messages: list[dict], *, timeout_s: float = 600.0, **kw: Any) -> ChatResult:
    """One blocking request (reports and tests; the generate stage sends many through `chat_with_retries`)."""
    with http_client(endpoint, 1, timeout_s) as http:
        r = http.post("/v1/chat/completions", json=chat_payload(endpoint.model, messages, **kw))
    if r.status_code != 200:
        raise ServerError(f"{endpoint.base_url}: {server_message(r)}")
    return parse_chat_response(r.json())


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 5
    backoff_base_s: float = 1.0
    backoff_max_s: float = 30.0
    server_down_wait_s: float = 600.0
    health_timeout_s: float = 10.0  # a live server answers /health at once, even with a full batch

    def delay(self, retry: int) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2^retry)] (spreads a herd of retries after a server restart)."""
        return random.uniform(0.0, min(self.backoff_max_s, self.backoff_base_s * 2**retry))


@dataclass
class Reply:
    result: ChatResult | None  # None when no response came back
    error: str | None  # why, when result is None
    attempts: int  # HTTP requests sent for this prompt
    reasoning_tokens: int | None = None  # usage.completion_tokens_details.reasoning_tokens, when the server counts them


def _reasoning_tokens(body: dict[str, Any]) -> int | None:
    details = (body.get("usage") or {}).get("completion_tokens_details") or {}
    n = details.get("reasoning_tokens") if isinstance(details, dict) else None
    return int(n) if isinstance(n, int | float) else None


def server_message(r: httpx.Response) -> str:
    """vLLM's error text: {"error": {"message": ...}} (OpenAI style) or {"message": ...} (older)."""
    try:
        body = r.json()
        err = body.get("error") if isinstance(body, dict) else None
        msg = (err.get("message") if isinstance(err, dict) else err) or body.get("message") or r.text
    except (ValueError, AttributeError):
        msg = r.text
    return f"HTTP {r.status_code}: {str(msg).strip()}"[:ERROR_CHARS]


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}".strip().rstrip(":")[:ERROR_CHARS]


async def answers_health(http: httpx.AsyncClient, timeout_s: float) -> bool:
    """Whether the server answers GET /health with 200 within `timeout_s` (vLLM's asks the engine too)."""
    try:
        r = await http.get("/health", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


async def _wait_for_server(http: httpx.AsyncClient, policy: RetryPolicy, down_since: float, retry: int, reason: str,
                           on_retry: Callable[[str], None] | None, cause: Exception, what: str, detail: str,
                           also: str = "") -> None:
    """A server that is down (refused connections) or hung (no answer, not even /health): ServerUnreachable once it
    has been so for policy.server_down_wait_s, else the retry's back-off (the prompt's attempts are not used up)."""
    waited = time.monotonic() - down_since
    if waited >= policy.server_down_wait_s:
        raise ServerUnreachable(f"verifier server {http.base_url} {what} for {waited:.0f} s{also} (the wait allowed: "
                                f"{policy.server_down_wait_s:g} s): {detail}") from cause
    if on_retry:
        on_retry(reason)
    await asyncio.sleep(policy.delay(retry))


async def chat_with_retries(http: httpx.AsyncClient, payload: dict[str, Any], policy: RetryPolicy,
                            on_retry: Callable[[str], None] | None = None, failover: bool = False,
                            on_response: Callable[[], None] | None = None) -> Reply:
    """POST one chat completion, retrying per the module's policy. `on_retry(reason)` is called before each retry,
    `on_response()` whenever an HTTP response came back (any status: the server is alive). `failover` (several
    servers, eagle3lib/vllm/dispatch.py): a refused connection, or a server found hung, raises ServerDown at once
    instead of waiting for this server to come back."""
    attempts = 0  # every request sent
    counted = 0  # the ones that use up max_attempts (not the refused connections of a server that is down)
    retry = 0
    down_since: float | None = None
    while True:
        attempts += 1
        error: str
        sent_at = time.monotonic()
        try:
            r = await http.post("/v1/chat/completions", json=payload)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            if failover:
                raise ServerDown(f"{http.base_url}: {_describe(e)}") from e
            down_since = down_since if down_since is not None else time.monotonic()
            await _wait_for_server(http, policy, down_since, retry, "connect", on_retry, e, "unreachable",
                                   _describe(e))
            retry += 1
            continue
        except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as e:
            error = _describe(e)  # read timeout, or the connection dropped mid-request (server died, restarted)
            if isinstance(e, httpx.TimeoutException) and not await answers_health(http, policy.health_timeout_s):
                if failover:
                    raise ServerDown(f"{http.base_url}: no answer, not even to /health: {error}") from e
                down_since = down_since if down_since is not None else sent_at
                await _wait_for_server(http, policy, down_since, retry, "hung", on_retry, e, "answered nothing",
                                       f"it accepts connections but is hung (stopped? deadlocked?): {error}",
                                       ", not even /health")
                retry += 1
                continue
        else:
            down_since = None
            if on_response:
                on_response()
            if r.status_code == 200:
                try:
                    body = r.json()
                    return Reply(parse_chat_response(body), None, attempts, _reasoning_tokens(body))
                except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
                    return Reply(None, f"unreadable response body ({_describe(e)}): {r.text[:500]}", attempts)
            error = server_message(r)
            if r.status_code < 500 and r.status_code not in RETRY_STATUS:
                return Reply(None, error, attempts)  # the request itself is wrong: retrying gives the same answer
        down_since = None
        counted += 1
        if counted >= policy.max_attempts:
            return Reply(None, f"{error} (after {attempts} attempts)", attempts)
        if on_retry:
            on_retry("error")
        await asyncio.sleep(policy.delay(retry))
        retry += 1
