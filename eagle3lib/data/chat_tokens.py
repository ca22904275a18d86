"""Conversations -> token ids + loss mask, rendered with the verifier's own chat template.

The loss mask is True on the tokens the assistant produces (reasoning, content and the end-of-turn token, as the
template renders them), False on system/user turns and on the assistant header.
- Templates with `{% generation %}` markers (the tiny verifier's): transformers' `return_assistant_tokens_mask=True`.
- Templates without them (Qwen3's, Kimi's): the assistant spans are found by rendering prefixes. Span i starts where
  `render(messages[:i], add_generation_prompt=True)` stops agreeing with the full rendering, and ends after the first
  end-of-turn marker (the tokenizer's eos token, or an explicit `end_of_turn`) following that start; tokens are mapped
  to spans through the tokenizer's character offsets. This copes with templates that render earlier turns differently
  (Qwen3 drops the reasoning of assistant turns before the last user message).
Answers as generated: a generate record carries the last answer's token ids as vLLM produced them
(`answer_token_ids`). With `answer_tokens="generated"` that answer is those ids after the rendering of everything
before it with the generation prompt, which is exactly what the server rendered and the verifier continued; the chat
template re-renders an answer from its parsed reasoning and content, and a template that adds its own whitespace
around them (the tiny verifier's adds newlines that vLLM's qwen3 parser leaves in both) trains the drafter on text the
verifier never produced. Every such answer is also rendered the template's way and the two are compared
(`rerendered_differently`), so a run says how much its template would have changed.
The prompt as served: with the answer ids a record also carries the prompt's ids as the server tokenized it
(`prompt_token_ids`). The sample is built on those, not on this process's rendering, which differs whenever the
server rendered otherwise (generate's and extract's chat_template_kwargs differ, vLLM normalised tool definitions, the
server has template flags). Where the renderings agree the sample is the same either way and earlier assistant turns
keep their loss mask (`prompts_as_served`); where they differ, the server's ids are used with only the last answer in
the loss, since this process cannot place earlier turns in ids it did not render (`prompts_rendered_differently`).
Longer samples than `max_sample_tokens` are truncated or dropped; samples without any assistant token are skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from eagle3lib.data.loops import loops, trim_loop

GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TokenizeError(ValueError):
    """A conversation cannot be rendered or tokenized; the message names the sample."""


@dataclass
class Tokenized:
    id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]
    truncated: bool = False

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class TokenizeStats:
    conversations: int = 0  # seen
    kept: int = 0  # returned, ready to extract
    skipped_no_assistant: int = 0  # no assistant token at all
    truncated: int = 0  # cut to max_sample_tokens and kept
    dropped_too_long: int = 0  # longer than max_sample_tokens and dropped (policy drop, or no assistant token left)
    bad_samples: int = 0  # failed to render/tokenize, skipped (on_bad_record="skip")
    duplicate_ids: int = 0  # a second sample with an id already seen, skipped
    answers_as_generated: int = 0  # kept samples whose last answer is the verifier's generated token ids
    looping_answers: int = 0  # ... of which the answer loops (the same n-gram repeated to its end, data/loops.py)
    loop_tokens_trimmed: int = 0  # answer tokens cut from looping answers (extract.looping_answers: trim)
    answers_ended: int = 0  # ... of which ended by themselves (not cut at max_tokens): compared with the template's
    rerendered_differently: int = 0  # ... of those, the answers the chat template renders into other tokens
    tokens: int = 0  # in kept samples
    loss_tokens: int = 0  # in kept samples
    errors: list[str] = field(default_factory=list)  # first few messages of skipped bad samples
    rerendered_examples: list[str] = field(default_factory=list)  # first few sample ids rendered differently
    prompts_as_served: int = 0  # samples built on the server's prompt ids, this process rendering the same ids
    prompts_rendered_differently: int = 0  # ... where it renders other ids: the server's used, earlier turns unmasked
    prompt_examples: list[str] = field(default_factory=list)  # first few sample ids whose prompt rendered differently

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in self.__dict__.items() if k not in ("errors", "rerendered_examples", "prompt_examples")}


def has_generation_markers(tokenizer: Any) -> bool:
    tmpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tmpl, dict):  # named templates: the default one is what apply_chat_template uses
        tmpl = tmpl.get("default")
    return bool(tmpl) and GENERATION_RE.search(tmpl) is not None


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as templates expect them: content never None, reasoning under `reasoning_content`, tool-call
    arguments as objects. vLLM parses the arguments' JSON text the same way before rendering (`_postprocess_messages`
    in vllm/renderers/chat_utils.py, 0.32), so the tokens extracted are the tokens the server rendered."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if "reasoning_content" not in m and m.get("reasoning"):
            m["reasoning_content"] = m["reasoning"]
        if m.get("tool_calls"):
            m["tool_calls"] = [_parsed_call(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _parsed_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    fn["arguments"] = json.loads(args) if isinstance(args, str) and args.strip() else (args or {})
    return {**call, "function": fn}


def _lcp(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on prefix equality (strings can be long)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _mask_by_generation(tok: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any],
                        generation_prompt: bool = False) -> tuple[list[int], list[int]]:
    enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                  add_generation_prompt=generation_prompt, **kwargs)
    return list(enc["input_ids"]), list(enc["assistant_masks"])


def assistant_char_spans(tok: Any, messages: list[dict[str, Any]], full: str, kwargs: dict[str, Any],
                         end_markers: list[str]) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `full` (the rendering of all messages), by prefix rendering.

    Start: after `render(messages[:i], add_generation_prompt=True)` when that is a prefix of `full`; otherwise (the
    template renders earlier turns differently for a shorter conversation) after the next occurrence of the generation
    prompt's header (what add_generation_prompt appends) following the previous turn. End: after the last end-of-turn
    marker of this turn when its rendering is known (`render(messages[:i + 1])` is a prefix of `full`; gpt-oss ends
    its analysis and final channels with one marker each), else after the first marker following the start.
    """
    spans = []
    pos = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True, **kwargs)
        if full.startswith(prefix) and len(prefix) >= pos:
            start = len(prefix)
        else:
            base = tok.apply_chat_template(messages[:i], tokenize=False, **kwargs) if i else ""
            header = prefix[len(base):] if prefix.startswith(base) else ""
            k = full.find(header, pos) if header else -1
            if k < 0:
                raise TokenizeError(f"assistant turn {i}: cannot locate its start in the rendered conversation "
                                    f"(generation prompt {header!r} not found)")
            start = k + len(header)
        upto = tok.apply_chat_template(messages[: i + 1], tokenize=False, **kwargs)
        exact = full.startswith(upto) and len(upto) > start  # this turn's own rendering ends at `limit`
        limit = len(upto) if exact else len(full)
        # known end: its last marker ends it (a turn can hold several: gpt-oss's analysis<|end|> then final<|end|>)
        find, pick = (full.rfind, max) if exact else (full.find, min)
        ends = [p + len(mk) for mk in end_markers if (p := find(mk, start, limit)) >= 0]
        if ends:
            end = pick(ends)
        elif limit < len(full) or full.startswith(upto):
            end = len(full[:limit].rstrip())
        else:
            raise TokenizeError(f"assistant turn {i}: no end-of-turn marker ({end_markers}) found after it")
        if end > start:
            spans.append((start, end))
        pos = max(pos, end)
    return spans


def _mask_by_prefixes(tok: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any], end_markers: list[str],
                      generation_prompt: bool = False) -> tuple[list[int], list[int]]:
    # the spans are found by rendering prefixes with the generation prompt: a trailing one in `full` holds none
    full = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)
    spans = assistant_char_spans(tok, messages, full, kwargs, end_markers)
    if getattr(tok, "is_fast", False):  # character offsets map tokens to spans
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [0] * len(ids)
        j = 0
        for t, (a, _b) in enumerate(enc["offset_mapping"]):
            while j < len(spans) and spans[j][1] <= a:
                j += 1
            if j < len(spans) and spans[j][0] <= a < spans[j][1]:
                mask[t] = 1
        return ids, mask
    # slow tokenizers (Kimi's tiktoken one) have no offsets: tokenize the pieces between span boundaries separately.
    # Boundaries sit at special tokens in chat templates, so this equals tokenizing the whole text; checked.
    ids, mask, pos = [], [], 0
    for a, b in [*spans, (len(full), len(full))]:
        for lo, hi, m in ((pos, a, 0), (a, b, 1)):
            if hi > lo:
                piece = tok.encode(full[lo:hi], add_special_tokens=False)
                ids += piece
                mask += [m] * len(piece)
        pos = b
    if ids != list(tok.encode(full, add_special_tokens=False)):
        raise TokenizeError("tokenizing the assistant spans separately differs from tokenizing the whole conversation "
                            "(a span boundary inside a token); use a fast tokenizer or a template with {% generation %}")
    return ids, mask


class ChatTokenizer:
    """Renders and tokenizes conversations for extraction; one instance per verifier tokenizer."""

    def __init__(self, tokenizer: Any, max_sample_tokens: int, too_long: Literal["truncate", "drop"] = "truncate",
                 chat_template_kwargs: dict[str, Any] | None = None, end_of_turn: list[str] | None = None,
                 mask_method: Literal["auto", "generation", "prefix"] = "auto",
                 answer_tokens: Literal["generated", "rendered"] = "generated",
                 looping_answers: Literal["keep", "trim"] = "keep"):
        if getattr(tokenizer, "chat_template", None) is None:
            raise TokenizeError("the verifier's tokenizer has no chat template")
        self.tok = tokenizer
        self.max_sample_tokens = max_sample_tokens
        self.too_long = too_long
        self.kwargs = dict(chat_template_kwargs or {})
        if mask_method == "auto":
            mask_method = "generation" if has_generation_markers(tokenizer) else "prefix"
        self.mask_method = mask_method
        markers = list(end_of_turn or [])
        if not markers and tokenizer.eos_token:
            markers = [tokenizer.eos_token]
        self.end_markers = markers
        self.answer_tokens = answer_tokens
        self.looping_answers = looping_answers
        single = [tokenizer.encode(m, add_special_tokens=False) for m in markers]
        self.stop_ids = [ids[0] for ids in single if len(ids) == 1]  # end-of-turn ids a loop detector ignores

    def encode(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        msgs = _template_messages(messages)
        kwargs = {**self.kwargs, "tools": tools} if tools else self.kwargs
        if self.mask_method == "generation":
            ids, mask = _mask_by_generation(self.tok, msgs, kwargs)
        else:
            ids, mask = _mask_by_prefixes(self.tok, msgs, kwargs, self.end_markers)
        return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)

    def encode_generated(self, messages: list[dict[str, Any]], answer_ids: list[int],
                         tools: list[dict[str, Any]] | None = None, prompt_ids: list[int] | None = None,
                         stats: TokenizeStats | None = None, sample_id: str = "") -> tuple[np.ndarray, np.ndarray]:
        """Everything before the last (assistant) turn as the server rendered the request (`prompt_ids`, when it sent
        them back; else rendered here with the generation prompt), then that turn's generated ids, all of them in the
        loss mask (earlier assistant turns as `encode` masks them, where this rendering is the server's)."""
        if not messages or messages[-1].get("role") != "assistant":
            raise TokenizeError("answer_token_ids given, but the conversation does not end with an assistant turn")
        msgs = _template_messages(messages[:-1])
        kwargs = {**self.kwargs, "tools": tools} if tools else self.kwargs
        if self.mask_method == "generation":
            ids, mask = _mask_by_generation(self.tok, msgs, kwargs, generation_prompt=True)
        else:
            ids, mask = _mask_by_prefixes(self.tok, msgs, kwargs, self.end_markers, generation_prompt=True)
        if prompt_ids is not None and stats is not None:
            if list(ids) == list(prompt_ids):
                stats.prompts_as_served += 1
            else:
                stats.prompts_rendered_differently += 1
                if len(stats.prompt_examples) < 3:
                    stats.prompt_examples.append(sample_id)
                ids, mask = list(prompt_ids), [0] * len(prompt_ids)
        return (np.asarray([*ids, *answer_ids], dtype=np.int32),
                np.asarray([*mask, *([1] * len(answer_ids))], dtype=bool))

    def _tokens(self, conv: Any, stats: TokenizeStats) -> tuple[np.ndarray, np.ndarray]:
        tools = getattr(conv, "tools", None)
        ids, mask = self.encode(conv.messages, tools)
        answer = (getattr(conv, "extra", None) or {}).get("answer_token_ids")
        if self.answer_tokens != "generated" or not answer:
            return ids, mask
        whole = answer
        if loops(answer, self.stop_ids):
            stats.looping_answers += 1
            if self.looping_answers == "trim":
                answer = trim_loop(answer, self.stop_ids)
                stats.loop_tokens_trimmed += len(whole) - len(answer)
        prompt_ids = conv.extra.get("prompt_token_ids")
        gen_ids, gen_mask = self.encode_generated(conv.messages, answer, tools, prompt_ids, stats, conv.id)
        stats.answers_as_generated += 1
        if conv.extra.get("status") == "truncated":  # no end of turn: the template's rendering would always close it
            return gen_ids, gen_mask
        stats.answers_ended += 1
        as_generated = gen_ids if answer is whole else self.encode_generated(conv.messages, whole, tools)[0]
        end = int(np.flatnonzero(mask)[-1]) + 1 if mask.any() else len(ids)  # the template's text after the turn
        if not np.array_equal(ids[:end], as_generated):  # (Qwen3's "\n" after <|im_end|>) is not part of the answer
            stats.rerendered_differently += 1
            if len(stats.rerendered_examples) < 3:
                stats.rerendered_examples.append(conv.id)
        return gen_ids, gen_mask

    def __call__(self, conversations: Iterable[Any], stats: TokenizeStats, on_bad_record: str = "error") -> Iterator[Tokenized]:
        """Tokenized samples ready to extract; skipped ones are counted in `stats`."""
        seen: set[str] = set()
        for conv in conversations:
            stats.conversations += 1
            if conv.id in seen:
                stats.duplicate_ids += 1
                continue
            seen.add(conv.id)
            try:
                ids, mask = self._tokens(conv, stats)
            except Exception as e:  # template errors are jinja exceptions of many kinds
                msg = f"{conv.source or conv.id}: sample {conv.id!r} does not tokenize with the verifier's chat template: {type(e).__name__}: {e}"
                if on_bad_record == "skip":
                    stats.bad_samples += 1
                    if len(stats.errors) < 5:
                        stats.errors.append(msg)
                    continue
                raise TokenizeError(msg) from e
            if not mask.any():
                stats.skipped_no_assistant += 1
                continue
            truncated = False
            if len(ids) > self.max_sample_tokens:
                if self.too_long == "drop":
                    stats.dropped_too_long += 1
                    continue
                ids, mask = ids[: self.max_sample_tokens], mask[: self.max_sample_tokens]
                if not mask.any():
                    stats.dropped_too_long += 1
                    continue
                truncated = True
                stats.truncated += 1
            stats.kept += 1
            stats.tokens += len(ids)
            stats.loss_tokens += int(mask.sum())
            yield Tokenized(conv.id, ids, mask, truncated)
