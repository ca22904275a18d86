"""The settings a generate folder's records were made with (RUN_DIR/generate/generate_key.json): a run with other
settings is refused instead of mixing its records in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3lib.config.generate import GenerateConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.core.atomic import write_json_atomic
from eagle3lib.core.manifest import read_manifest
from eagle3lib.data.datasets import DatasetError, dataset_key
from eagle3lib.data.records import list_shards
from eagle3lib.generation.records import GenerateError

KEY_FILE = "generate_key.json"
# What decides which prompts, in which order, and how they are answered. Everything else may change between runs,
# max_samples included: the order does not depend on it, so raising it extends a run with more prompts.
KEY_FIELDS = ("dataset", "shuffle", "seed", "max_tokens", "temperature", "top_p", "request_seed",
              "chat_template_kwargs", "extra_body", "turns", "stop_loops")



def run_key(cfg: GenerateConfig, verifier_cfg: VerifierConfig) -> dict[str, Any]:
    key = {k: getattr(cfg, k) for k in KEY_FIELDS}
    try:
        key["dataset"] = dataset_key(cfg.dataset)
    except DatasetError:
        pass
    key["verifier_model"] = verifier_cfg.served_model_name or verifier_cfg.model
    return json.loads(json.dumps(key))


def check_run_key(gen_dir: Path, key: dict[str, Any]) -> None:
    """Refuse to add records made with other settings to a folder that already has some."""
    path = gen_dir / KEY_FILE
    if list_shards(gen_dir):
        # folders from before generate.turns answered the last turn, and from before generate.stop_loops
        old = {"turns": "last", "stop_loops": False, **_saved_key(gen_dir)}
        diffs = [f"{k}: {old[k]!r} -> {key[k]!r}" for k in sorted(set(old) & set(key)) if old[k] != key[k]]
        if diffs:
            raise GenerateError(f"{gen_dir} holds records generated with other settings ({'; '.join(diffs)}); "
                                "delete that folder (or re-run the stage with --force) to start over")
    write_json_atomic(path, key)


def _saved_key(gen_dir: Path) -> dict[str, Any]:
    """The settings the folder's records were made with: its key file, else (deleted mid-run) the settings its manifest
    recorded when that run started; a folder that says neither is refused rather than extended with a mixture."""
    path = gen_dir / KEY_FILE
    if path.exists():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise GenerateError(f"{path}: damaged ({e}); restore it, or re-run the stage with --force to start over") from None
    params = ((read_manifest(gen_dir) or {}).get("params") or {}).get("generate")
    if not params:
        raise GenerateError(f"{gen_dir} holds records, but neither {KEY_FILE} nor its manifest says which settings made "
                            "them; restore the file, or re-run the stage with --force to start over")
    old = {k: params[k] for k in KEY_FIELDS if k in params}
    try:
        old["dataset"] = dataset_key(old["dataset"])
    except (KeyError, DatasetError):
        pass
    return json.loads(json.dumps(old))
