"""Regenerating every assistant turn of a conversation in order (`generate.turns: all`), each from the verifier's own
earlier answers, instead of only the last one after the dataset's earlier answers (`generate.turns: last`).

A conversation is cut at its assistant messages into segments of the other messages: [system, user1], [user2], ...
Turn k's prompt is segment 1, the verifier's answer 1, ..., segment k. The dataset's assistant messages are dropped
(another model wrote them: keeping them trains the drafter on text the verifier would not have written after its
own answers). Conversations whose turns involve tools keep `last`: a tool result answers one particular call of the
dataset's assistant, which a regenerated turn need not make.

Records (eagle3lib/generation/records.py): one id per conversation. An answered turn that is not the last is written
with status "partial" and its `turn` / `turns`; the next turn's prompt is that record's messages plus the next segment,
so a killed run continues from the latest record, asking every turn once. The last turn's record holds the whole
regenerated conversation with the usual status. A turn cut off (truncated) or empty after earlier answered turns
ends the conversation at the turns before it, status ok (`stopped_at_turn` says where): those turns are complete
verifier text, still training data.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from eagle3lib.data.datasets import Conversation


def segments(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The runs of non-assistant messages that end with a user message, in order: one per turn to answer."""
    out, cur = [], []
    for m in messages:
        if m["role"] == "assistant":
            if cur and cur[-1]["role"] == "user":
                out.append(cur)
            cur = []  # a run that does not end in a user message (none here) is folded away with the answer
        else:
            cur.append(m)
    if cur and cur[-1]["role"] == "user":
        out.append(cur)
    return out


def uses_tools(conv: Conversation) -> bool:
    return bool(conv.tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in conv.messages)


def first_turn(conv: Conversation) -> Conversation | None:
    """The conversation's turn 1 as a prompt to answer (extra: turn, turns), or None when it has at most one turn or
    uses tools (then `turns: last` applies: the caller keeps its usual prompt)."""
    segs = segments(conv.messages)
    if len(segs) < 2 or uses_tools(conv):
        return None
    return replace(conv, messages=list(segs[0]), extra={**conv.extra, "turn": 1, "turns": len(segs), "answered": 0})


def next_turn(conv: Conversation, answered: list[dict[str, Any]], turn: int,
              carried_tokens: tuple[int, int] = (0, 0)) -> Conversation:
    """Turn `turn` + 1's prompt: the messages so far (the verifier's answers included) and the next segment;
    `carried_tokens` (prompt, completion) of the turns so far, so the last record counts the whole conversation."""
    segs = segments(conv.messages)
    return replace(conv, messages=[*answered, *segs[turn]],
                   extra={**conv.extra, "turn": turn + 1, "turns": len(segs), "answered": len(answered),
                          "carried_tokens": carried_tokens})


def resume_turn(conv: Conversation, rec: dict[str, Any]) -> Conversation | None:
    """What to send for `conv` given its latest record `rec` of a turn-by-turn run: the next turn after a partial
    record, the same turn again after a failed one (its messages are that turn's prompt); None for the rest."""
    tokens = (int(rec.get("prompt_tokens") or 0), int(rec.get("completion_tokens") or 0))
    if rec.get("status") == "partial":
        return next_turn(conv, rec["messages"], rec["turn"], tokens)
    if rec.get("status") == "failed" and rec.get("turn", 1) > 1:
        k = rec["turn"]
        return next_turn(conv, rec["messages"][: len(rec["messages"]) - len(segments(conv.messages)[k - 1])], k - 1,
                         tokens)
    return None
