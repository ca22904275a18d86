"""What `generate.stop_loops` saves, replayed on a generate folder made without it: for every answer, the length at
which vLLM's repetition_detection (as the option sets it, eagle3lib/data/loops.repetition_detection) would have ended
it, and whether the training data extract keeps from it (loops trimmed to two periods) is the same.

    .venv/bin/python benchmarks/stop_loops.py runs/smollm2/generate

Exact on the tokens, not a timing: up to the stop the server samples the same tokens with or without the option
(the stop rule reads the answer, it does not change the distribution), so the answers on file say what the option
would have cut. Generated tokens are what the generate stage's time follows on a busy server; the seconds themselves
are the stage's manifest's (`output_tokens_per_s`). Prints one JSON object; nothing is written.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from eagle3lib.data.loops import loops, repetition_detection, trim_loop
from eagle3lib.data.records import latest_records


def stop_length(ids: list[int], min_pattern_size: int, max_pattern_size: int, min_count: int) -> int | None:
    """The output length at which vLLM's rule fires first: the last min_count x L tokens are one L-token pattern
    repeated, for some L in [min_pattern_size, max_pattern_size] (vllm/v1/core/sched/utils.py, checked after every
    token); None when it never does."""
    a = np.asarray(ids, dtype=np.int64)
    first: int | None = None
    for size in range(max(1, min_pattern_size), max_pattern_size + 1):
        if min_count * size > len(a):
            break
        same = (a[size:] == a[:-size]).astype(np.int64)  # same[k]: a[k + size] == a[k]
        need = (min_count - 1) * size  # consecutive matches: a[t - count*size : t] periodic in size
        full = np.flatnonzero(np.convolve(same, np.ones(need, dtype=np.int64), "valid") == need)
        if len(full):
            t = int(full[0]) + min_count * size  # the window same[j : j + need] ends the answer at j + count*size
            first = t if first is None else min(first, t)
    return first


def replay(gen_dir: Path) -> dict[str, object]:
    params = repetition_detection()
    answers = stopped = same_data = broke_off = 0
    generated = generated_with_stop = kept = kept_with_stop = 0
    for rec, _where in latest_records(gen_dir).values():
        ids = rec.get("answer_token_ids")
        if rec.get("status") not in ("ok", "truncated") or not ids:
            continue
        answers += 1
        # the answer's own end of turn (an ok answer's last token) ends it before the repetition check would
        stop_ids = [ids[-1]] if rec["status"] == "ok" else []
        body = ids[:-1] if stop_ids else ids
        t = stop_length(body, **params)
        cut = ids if t is None or t >= len(body) else ids[:t]
        stopped += cut is not ids
        generated += len(ids)
        generated_with_stop += len(cut)
        full_data, cut_data = trim_loop(ids, stop_ids), trim_loop(cut, stop_ids if cut is ids else [])
        kept += len(full_data)
        kept_with_stop += len(cut_data)
        same_data += full_data == cut_data
        broke_off += cut is not ids and not loops(ids, stop_ids)  # its repetition ended before the answer did
    return {
        "generate_dir": str(gen_dir),
        "repetition_detection": params,
        "answers": answers,
        "answers_stopped": stopped,
        "answers_same_training_tokens": same_data,
        "answers_stopped_whose_repetition_broke_off": broke_off,
        "generated_tokens": generated,
        "generated_tokens_with_stop": generated_with_stop,
        "generated_tokens_saved_share": round(1 - generated_with_stop / max(1, generated), 4),
        "training_tokens": kept,  # answer tokens after loop trimming (extract's looping_answers: trim)
        "training_tokens_with_stop": kept_with_stop,
        "training_tokens_lost_share": round(1 - kept_with_stop / max(1, kept), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("generate_dir", type=Path, help="a run's generate folder (made without stop_loops)")
    print(json.dumps(replay(ap.parse_args().generate_dir), indent=1))


if __name__ == "__main__":
    main()
