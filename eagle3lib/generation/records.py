"""One generate record per prompt and try: its status (ok, truncated, empty, failed, partial) from the server's
answer, and the record the shards hold (format: eagle3lib/data/records.py)."""

from __future__ import annotations

from typing import Any

from eagle3lib.data.datasets import Conversation
from eagle3lib.vllm.client import ChatResult


class GenerateError(RuntimeError):
    pass


def classify(result: ChatResult) -> str:
    if result.finish_reason in ("length", "repetition"):  # cut by max_tokens, or by vLLM once it looped (stop_loops)
        return "truncated"
    if not (result.reasoning or "").strip() and not (result.content or "").strip() and not result.tool_calls:
        return "empty"
    return "ok"


def make_record(conv: Conversation, result: ChatResult | None, error: str | None, attempts: int,
                reasoning_tokens: int | None = None) -> dict[str, Any]:
    messages = list(conv.messages)
    status = classify(result) if result is not None else "failed"
    if result is not None:
        answer = {"role": "assistant", "content": result.content or "", "reasoning_content": result.reasoning or ""}
        if result.tool_calls:  # a server with a tool-call parser returns the verifier's calls parsed out of its text
            answer["tool_calls"] = result.tool_calls
        messages.append(answer)
    turn = {}
    if "turn" in conv.extra:  # generate.turns all (eagle3lib/data/multi_turn.py)
        k, n = conv.extra["turn"], conv.extra["turns"]
        turn = {"turn": k, "turns": n}
        if status == "ok" and k < n:
            status = "partial"
        elif status in ("truncated", "empty") and k > 1:  # turns 1..k-1 are whole verifier answers: keep them
            messages, status, turn["stopped_at_turn"] = messages[: conv.extra["answered"]], "ok", k
    # the last assistant turn's tokens as generated (not when it was cut off above: the record then ends earlier)
    answer_ids = result.token_ids if result is not None and "stopped_at_turn" not in turn else None
    prompt_ids = result.prompt_token_ids if answer_ids is not None else None
    carried = conv.extra.get("carried_tokens", (0, 0))  # the earlier turns': a record counts its whole conversation
    return {
        "id": conv.id,
        **({"tools": conv.tools} if conv.tools else {}),
        "category": conv.category,
        "status": status,
        "messages": messages,
        "finish_reason": result.finish_reason if result is not None else None,
        "prompt_tokens": carried[0] + (result.prompt_tokens if result is not None else 0),
        "completion_tokens": carried[1] + (result.completion_tokens if result is not None else 0),
        "error": error,
        "attempts": attempts,
        "reasoning_tokens": reasoning_tokens,  # the server's count (vLLM with a reasoning parser), else null
        **turn,
        **({"answer_token_ids": answer_ids} if answer_ids is not None else {}),
        **({"prompt_token_ids": prompt_ids} if prompt_ids is not None else {}),
    }
