"""The slice of the OpenAI chat-completions API this project speaks, and how reasoning is read back.

vLLM with a reasoning parser returns the thinking text in `reasoning` (message and streaming delta); older vLLM and
SGLang call it `reasoning_content`. Reading only one of them silently drops all reasoning (a bug hit in a real run), so
both are read, `reasoning` first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from eagle3lib.vllm.server import Endpoint


@dataclass
class ChatResult:
    reasoning: str | None  # text inside <think>, None when the server returned none
    content: str | None  # the answer
    finish_reason: str | None  # "stop", "length" (cut by max_tokens), ...
    prompt_tokens: int
    completion_tokens: int


def parse_chat_response(body: dict[str, Any]) -> ChatResult:
    choice = body["choices"][0]
    msg = choice.get("message") or {}
    reasoning = msg.get("reasoning")
    if reasoning is None:
        reasoning = msg.get("reasoning_content")
    usage = body.get("usage") or {}
    return ChatResult(reasoning, msg.get("content"), choice.get("finish_reason"),
                      int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))


def chat_payload(model: str, messages: list[dict], *, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                               "temperature": temperature, "top_p": top_p}
    if seed is not None:
        payload["seed"] = seed
    if chat_template_kwargs:
        payload["chat_template_kwargs"] = chat_template_kwargs
    return payload


def chat_once(endpoint: Endpoint, messages: list[dict], *, timeout_s: float = 600.0, **kw: Any) -> ChatResult:
    """One blocking request (reports and tests; the generate stage has its own concurrent client)."""
    r = httpx.post(f"{endpoint.base_url}/v1/chat/completions", json=chat_payload(endpoint.model, messages, **kw),
                   headers=endpoint.headers(), timeout=timeout_s)
    if r.status_code != 200:
        raise RuntimeError(f"{endpoint.base_url}: HTTP {r.status_code}: {r.text[:500]}")
    return parse_chat_response(r.json())
