"""The generate stage's prompts: the dataset, shuffled, each conversation cut to what the verifier answers, capped.

`generate.turns: last` (the default): the conversation up to its last user turn, earlier assistant turns as the dataset
wrote them. `first`: the conversation's first user turn (and a system turn before it) only, the rest dropped. `all`:
turn 1 of a multi-turn conversation; the stage asks the later turns from the verifier's own answers
(eagle3lib/data/multi_turn.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from eagle3lib.config.generate import GenerateConfig
from eagle3lib.data.datasets import Conversation, DatasetError, LoadStats, count_bad, load_conversations
from eagle3lib.data.multi_turn import first_turn, segments, uses_tools


@dataclass
class Prompts:
    items: list[Conversation]  # prompts to answer: the conversation up to its last user turn, in run order
    load: LoadStats
    skipped_no_user_turn: int = 0
    skipped_empty_user_turn: int = 0  # the turn to answer is empty or null: nothing to answer, no training signal
    duplicate_ids: int = 0  # skipped with on_bad_record=skip (counted in bad_records too)
    originals: dict[str, Conversation] = field(default_factory=dict)  # turns "all": id -> the dataset's conversation
    tools_last_turn: int = 0  # turns "all": multi-turn conversations with tools, regenerated at their last turn only
    skipped_too_long: int = 0  # the prompt and generate.max_tokens do not fit verifier.max_model_len (the server
    # would refuse the request)


def load_prompts(cfg: GenerateConfig, fits: Callable[[Conversation], bool] | None = None) -> Prompts:
    """The stage's prompts: dataset -> shuffled -> prompt() -> `fits` -> capped at max_samples. Bad records per
    on_bad_record. `fits` is asked only until max_samples prompts are found, so a capped run tokenizes few."""
    stats = LoadStats()
    convs = load_conversations(cfg.dataset, on_bad_record=cfg.on_bad_record, shuffle=cfg.shuffle, seed=cfg.seed, stats=stats)
    out = Prompts([], stats)
    seen: dict[str, str] = {}
    for c in convs:
        prompt = c.prompt()
        if cfg.turns == "first" and prompt is not None and (segs := segments(c.messages)):
            prompt = segs[0]
        if prompt is None:
            out.skipped_no_user_turn += 1
            continue
        if not str(prompt[-1].get("content") or "").strip():
            out.skipped_empty_user_turn += 1
            continue
        if c.id in seen:  # an explicit id used twice: outputs are keyed by id, so this would lose one of them
            if cfg.on_bad_record == "error":
                raise DatasetError(f"{c.source}: id {c.id!r} already used at {seen[c.id]} (ids must be unique; "
                                   "or set generate.on_bad_record: skip)")
            out.duplicate_ids += 1
            count_bad(stats, "duplicate_id", f"{c.source}: id {c.id!r} already used at {seen[c.id]}")
            continue
        seen[c.id] = c.source
        item = Conversation(c.id, prompt, c.category, c.source, c.extra, c.tools)
        if fits is not None and not fits(item):
            out.skipped_too_long += 1
            continue
        if cfg.turns == "all":
            if (first := first_turn(c)) is not None:
                item = first
                out.originals[c.id] = c
            elif len(segments(c.messages)) > 1 and uses_tools(c):
                out.tools_last_turn += 1
        out.items.append(item)
        if cfg.max_samples is not None and len(out.items) >= cfg.max_samples:
            break
    return out


