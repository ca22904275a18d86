"""The benchmark sets drafter cards report acceptance on, in their published formats, read as conversations.

| set | file and record | the conversation |
|---|---|---|
| MT-Bench | `question.jsonl`: {"question_id", "category", "turns": [t1, t2]} | user t1; the later turns in extra["turns"] |
| Spec-Bench | `question.jsonl`: the same shape, categories mt_bench, translation, summarization, qa, math_reasoning, rag | as MT-Bench |
| HumanEval | {"task_id", "prompt", ...} (JSONL or the hub's Parquet) | user: the prompt; category "humaneval" |
| GSM8K | {"question", "answer"} | user: the question; category "gsm8k" |
| chat | {"messages": [...]} or {"conversations": [...]} | as is (eagle3lib/data/datasets.py) |

The chat template is applied downstream as for any conversation (acceptance measured on raw text is misreported).
A multi-turn question's later turns follow the verifier's own answers: the evaluate stage generates those first
(eagle3lib/evaluation/turns.py).

`hf:OWNER/NAME` names a hub dataset repository: its JSONL/Parquet files are fetched with huggingface_hub where a hub
is reachable; where none is (these machines, CI), the error names the command to fetch it elsewhere and the local
path to set instead. Tests only write small local files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HUB_PREFIX = "hf:"


def benchmark_messages(rec: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None] | None:
    """(messages, default category) for a benchmark record, or None when the record has no benchmark shape."""
    if "turns" in rec:
        turns = rec["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError("'turns' must be a non-empty list of strings (MT-Bench / Spec-Bench question.jsonl)")
        return [{"role": "user", "content": turns[0]}], None
    if "task_id" in rec and "prompt" in rec:
        if not isinstance(rec["prompt"], str):
            raise ValueError("'prompt' must be a string (HumanEval)")
        return [{"role": "user", "content": rec["prompt"]}], "humaneval"
    if "question" in rec and "answer" in rec:
        if not isinstance(rec["question"], str):
            raise ValueError("'question' must be a string (GSM8K)")
        return [{"role": "user", "content": rec["question"]}], "gsm8k"
    return None


def benchmark_id(rec: dict[str, Any]) -> str | None:
    """The record's own id in its benchmark's field (question_id, task_id), if any."""
    for key in ("id", "question_id", "task_id"):
        if rec.get(key) is not None:
            return str(rec[key])
    return None


def later_turns(rec: dict[str, Any]) -> list[str]:
    turns = rec.get("turns")
    return list(turns[1:]) if isinstance(turns, list) else []


def hub_dataset_files(name: str) -> list[Path]:
    """The JSONL/Parquet files of hub dataset `hf:OWNER/NAME`, fetched (and cached) with huggingface_hub; ValueError
    naming the way out when it cannot be (eagle3lib.data.datasets turns it into a DatasetError)."""
    repo = name[len(HUB_PREFIX):]
    hint = (f"fetch it where a hub is reachable (`huggingface-cli download --repo-type dataset {repo} --local-dir "
            f"DIR`) and set the path of its JSONL or Parquet file instead of {name}")
    if "/" not in repo:
        raise ValueError(f"{name}: a hub dataset is named hf:OWNER/NAME")
    try:
        from huggingface_hub import snapshot_download

        root = Path(snapshot_download(repo, repo_type="dataset", allow_patterns=["*.jsonl", "*.parquet", "*.json"]))
    except Exception as e:  # offline, unknown repository, gated: every case gets the same way out
        why = " ".join(str(e).split())[:200]
        raise ValueError(f"{name}: cannot fetch it from the hub ({type(e).__name__}: {why}); {hint}") from None
    files = sorted(p for p in root.rglob("*") if p.suffix in (".jsonl", ".parquet"))
    if not files:
        raise ValueError(f"{name}: the repository has no JSONL or Parquet file; {hint}")
    return files
