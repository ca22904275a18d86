"""Measurement phases kept once complete (RUN_DIR/evaluate/phases/<name>.json), keyed by everything they depend on,
so a rerun after a failure resumes at the phase that failed and a changed input measures again."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.core.atomic import write_json_atomic
from eagle3lib.core.manifest import now_iso
from eagle3lib.vllm.measure import EvalPrompt, PassSettings

# how a pass runs without changing what it measures: a progress bar, how long to wait for a reply
NOT_MEASURED = {"progress", "request_timeout_s", "connect_timeout_s"}


def fingerprint(ckpt: Path) -> dict[str, Any]:
    return {"path": str(ckpt), "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns]
                                         for p in sorted(ckpt.iterdir()) if p.is_file()}}


def digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def load_phase(out_dir: Path, name: str, key: dict[str, Any]) -> dict[str, Any] | None:
    """phases/<name>.json's result when it was measured with the same key (everything the phase depends on)."""
    path = out_dir / "phases" / f"{name}.json"
    try:
        saved = json.loads(path.read_text())
        return saved["result"] if saved.get("key") == digest(key) else None
    except (OSError, json.JSONDecodeError, KeyError):
        return None


def save_phase(out_dir: Path, name: str, key: dict[str, Any], result: dict[str, Any]) -> None:
    write_json_atomic(out_dir / "phases" / f"{name}.json", {"key": digest(key), "finished_at": now_iso(),
                                                            "result": result})


def measurement_key(how: PassSettings, prompts: list[EvalPrompt], ckpt: Path | None, k: int | None,
                    vcfg: VerifierConfig, model_path: str, server_args: list[str], url: str | None = None,
                    **extra: Any) -> dict[str, Any]:
    """What a vLLM measurement depends on (its reuse key, the one schema of every phase served through vLLM): how
    its passes ran (modes, temperature, max_tokens, concurrency, warm-up, buckets, per prompt), the prompts (ids and
    token ids), the drafter (its files' fingerprint; None: the verifier alone) and K, how the verifier was served
    (model, dtype, server arguments) and a given server's URL. A phase kept under another key is measured again."""
    return {"pass": {f: v for f, v in asdict(how).items() if f not in NOT_MEASURED},
            "prompts": [[p.id, p.token_ids] for p in prompts], "ckpt": fingerprint(ckpt) if ckpt is not None else None,
            "k": k, "verifier": [vcfg.model, model_path], "dtype": vcfg.dtype,
            "server_args": [*vcfg.extra_server_args, *server_args], "url": url, **extra}
