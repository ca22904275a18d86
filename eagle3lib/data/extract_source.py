"""Which conversations the extract stage tokenizes: the generate stage's records, kept or dropped by reason (an answer
cut at max_tokens is kept as generated), or a dataset file for prefill-only extraction."""

from __future__ import annotations

from pathlib import Path

from eagle3lib.data.datasets import Conversation, DatasetError, LoadStats, load_conversations
from eagle3lib.data.records import ReadStats, iter_generated, selected_prompt_ids

# a record of a prompt the latest generate run did not select (records.PROMPT_IDS_FILE)
NOT_SELECTED = "not among the generate run's prompts (generate.max_samples lowered after it was answered)"


class SourceError(ValueError):
    """extract.source names nothing usable: the message says what and where."""


def load_source(source: str, gen_dir: Path | None, max_samples: int | None = None,
                on_bad_record: str = "error", read: ReadStats | None = None, truncated_answers: str = "keep",
                answer_tokens: str = "generated") -> tuple[list[Conversation], str, dict[str, dict[str, int]]]:
    """(conversations, description of where they came from, {"kept": status -> n, "dropped": reason -> n} of the
    generate records). `read` counts unreadable lines of generate shards.

    An answer cut at generate.max_tokens (status truncated) is still the verifier's own tokens: it is kept by default,
    as the ids vLLM generated with no end-of-turn token after them. Without those ids (extract.answer_tokens:
    rendered, or records from before generate kept them) the chat template would close the cut answer with its
    end-of-turn token, teaching the drafter an end the verifier never wrote, so such an answer is dropped."""
    counts: dict[str, dict[str, int]] = {"kept": {}, "dropped": {}}
    if source == "generate":
        if gen_dir is None or not gen_dir.is_dir() or not any(gen_dir.glob("shard-*.jsonl")):
            raise SourceError(f"extract.source=generate: no generate output in {gen_dir} (run the generate stage first, "
                               "or set extract.source to a dataset for prefill-only extraction)")
        convs = []
        selected = selected_prompt_ids(gen_dir)
        for c in iter_generated(gen_dir, statuses=None, stats=read):
            status = c.extra.get("status")
            if selected is not None and c.id not in selected:
                reason: str | None = NOT_SELECTED
            else:
                reason = drop_reason(status, bool(c.extra.get("answer_token_ids")), truncated_answers, answer_tokens)
            side, key = ("dropped", reason) if reason else ("kept", status)
            counts[side][key] = counts[side].get(key, 0) + 1
            if not reason:
                convs.append(c)
        desc = f"generate stage ({gen_dir})"
        if max_samples is not None:
            convs = convs[:max_samples]
    else:
        loaded = LoadStats()
        try:
            convs = load_conversations(source, on_bad_record=on_bad_record, max_samples=max_samples, stats=loaded)
        except DatasetError as e:
            raise SourceError(f"extract.source: {e}") from None
        for reason, n in loaded.bad_by_reason.items():  # skipped where read (extract.on_bad_record: skip)
            counts["dropped"][f"bad record ({reason})"] = n
        desc = source
    if not convs:
        raise SourceError(f"extract.source: no conversations in {desc}"
                           + (f" to keep (dropped: {counts_line(counts['dropped'])})" if source == "generate" else ""))
    return convs, desc, counts


def drop_reason(status: str | None, has_ids: bool, truncated_answers: str, answer_tokens: str) -> str | None:
    """Why a generate record is not training data (None: it is)."""
    if status == "ok":
        return None
    if status == "truncated":
        if truncated_answers == "drop":
            return "truncated (extract.truncated_answers: drop)"
        if answer_tokens != "generated" or not has_ids:
            return "truncated, without the generated token ids"
        return None
    return {"empty": "empty answer", "failed": "failed request", "partial": "unfinished turns (generate interrupted)"
            }.get(str(status), f"status {status}")


def counts_line(counts: dict[str, int]) -> str:
    return ", ".join(f"{n:,} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"
