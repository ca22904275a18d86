"""Later turns of multi-turn benchmark questions (MT-Bench, Spec-Bench's mt_bench category), as MT-Bench defines them:
turn n's prompt is the question's turns 1..n with the verifier's own greedy answers in between. So the answers come
from the verifier itself, served alone by vLLM (the evaluation's base server), through the chat API with its
reasoning parser, before anything is measured; they are kept in RUN_DIR/evaluate/later_turns.json, keyed by the
conversation so far, and reused by a rerun. Each later turn is then one more prompt, measured like the first turns by
both decoders (id `<question id>/turn-<n>`, the question's category)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3lib.config.evaluate import EvaluateConfig
from eagle3lib.core.atomic import write_json_atomic
from eagle3lib.data.datasets import Conversation
from eagle3lib.vllm.client import chat_payload, parse_chat_response
from eagle3lib.vllm.endpoint import Endpoint, ServerError, http_client
from eagle3lib.vllm.measure import FULL_SOFTMAX


def _key(messages: list[dict[str, Any]], max_tokens: int) -> str:
    return hashlib.sha1(json.dumps([messages, max_tokens], sort_keys=True).encode()).hexdigest()


def verifier_answer(endpoint: Endpoint, messages: list[dict[str, Any]], cfg: EvaluateConfig) -> dict[str, str]:
    """The verifier's greedy answer (reasoning and content) to `messages`, every sampling parameter explicit."""
    body = {**chat_payload(endpoint.model, messages, max_tokens=cfg.max_tokens, temperature=0.0,
                           chat_template_kwargs=cfg.chat_template_kwargs or None), **FULL_SOFTMAX}
    with http_client(endpoint, 1, cfg.request_timeout_s, cfg.connect_timeout_s) as http:
        r = http.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise ServerError(f"{endpoint.base_url}: the verifier's answer for a later turn: HTTP {r.status_code}: "
                          f"{r.text[:300]}")
    res = parse_chat_response(r.json())
    return {"reasoning": res.reasoning or "", "content": res.content or ""}


def later_turn_conversations(convs: list[Conversation], answer: Callable[[list[dict[str, Any]]], dict[str, str]],
                             cfg: EvaluateConfig, cache_path: Path) -> list[Conversation]:
    """One conversation per later turn of each question in `convs` (their `extra["later_turns"]`), the verifier's
    answers (`answer(messages)`, cached in `cache_path`) between the turns."""
    cache: dict[str, dict[str, str]] = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    out = []
    try:
        for c in convs:
            messages = list(c.prompt() or [])
            for n, turn in enumerate(c.extra.get("later_turns") or [], 2):
                key = _key(messages, cfg.max_tokens)
                if key not in cache:
                    cache[key] = answer(messages)
                a = cache[key]
                reply = {"role": "assistant", "content": a["content"]}
                if a["reasoning"]:
                    reply["reasoning_content"] = a["reasoning"]
                messages = [*messages, reply, {"role": "user", "content": turn}]
                out.append(Conversation(f"{c.id}/turn-{n}", messages, c.category, c.source))
    finally:  # answers already generated survive an interrupted or failed run
        write_json_atomic(cache_path, cache)
    return out
