"""Several drafters side by side: `evaluate.drafters` lists drafter folders (either layout: the speculators one, the
EAGLE one, an MLA drafter, a P-EAGLE or a DFlash one; e.g. the drafter served today, or a published one on disk) measured beside this run's on
the same prompts, at the same K, with the same verifier server settings: vLLM greedy tau, acceptance per draft position
and per prompt category, tokens/s, and the training-time estimate where the folder's train manifest has one. Each is
checked against the verifier before any server starts, and each gets its own speculative server (vLLM fixes the
speculator per server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3lib.config.evaluate import EvaluateConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.data.context_buckets import bucket_key
from eagle3lib.evaluation.inputs import EvaluateError, check_drafter
from eagle3lib.evaluation.phases import fingerprint
from eagle3lib.evaluation.spec_pass import measure_spec
from eagle3lib.vllm.speculative_config import is_dflash_drafter, served_as


def checked_drafters(paths: list[str], vconf, model_path: str, cuda: bool) -> list[tuple[str, Path]]:
    """(label, folder) per evaluate.drafters entry, each servable beside this verifier; raises naming the entry."""
    from eagle3lib.model.checkpoint import CheckpointError, check_servable, read_config

    out, labels = [], set()
    for i, p in enumerate(paths):
        ckpt = Path(p).expanduser().resolve()
        try:
            if not ckpt.is_dir():
                raise EvaluateError(f"{ckpt}: no such folder")
            if is_dflash_drafter(ckpt):  # its own config and checks (eagle3lib/model/dflash.py)
                from eagle3lib.model.dflash import dflash_problems

                if problems := dflash_problems(ckpt, vconf):
                    raise EvaluateError(f"{ckpt / 'config.json'}: this DFlash drafter does not fit {model_path} "
                                        f"({'; '.join(problems)})")
            else:
                check_drafter(ckpt, read_config(ckpt), vconf, model_path, cuda)
                check_servable(ckpt)
        except (CheckpointError, EvaluateError) as e:
            raise EvaluateError(f"evaluate.drafters[{i}]: {e}") from None
        label = ckpt.name if ckpt.name not in ("final", "best") else f"{ckpt.parent.parent.name}/{ckpt.name}"
        while label in labels:
            label += "'"
        labels.add(label)
        out.append((label, ckpt))
    return out


def estimate_of(ckpt: Path) -> float | None:
    """The validation tau estimate of a drafter folder written by a train stage (final/ or best/), else None."""
    try:
        m = json.loads((ckpt.parent / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    f = m.get("figures") or {}
    return f.get("best_val_tau_est") if ckpt.name == "best" else f.get("val_tau_est") if ckpt.name == "final" else None


def drafter_row(label: str, res: dict[str, Any], estimate: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {"drafter": label, "tau": res.get("tau"), "tau_estimate": estimate,
                           "tokens_per_s": res.get("tokens_per_s")}
    for i, rate in enumerate(res.get("accept_rate_pos") or [], 1):
        row[f"accept_rate_pos_{i}"] = rate
    for cat, c in sorted((res.get("categories") or {}).items()):
        row[f"tau_{cat}"] = c.get("tau")
    for label, c in (res.get("context_buckets") or {}).items():  # evaluate.context_buckets
        row[f"tau_{bucket_key(label)}"] = c.get("tau")
    return row


def compare_drafters(cfg: EvaluateConfig, vcfg: VerifierConfig, model_path: str, drafters: list[tuple[str, Path]],
                     prompts, k: int, out_dir: Path, vkey: dict[str, Any],
                     own: tuple[str, dict[str, Any], float | None]) -> list[dict[str, Any]]:
    """This run's drafter first (from the main measurement), then each of `drafters` on its own server."""
    rows = [drafter_row(*own)]
    for i, (label, ckpt) in enumerate(drafters, 1):
        res = measure_spec(cfg, vcfg, model_path, ckpt, prompts, k, out_dir, f"vllm_drafter_{i}",
                           {**vkey, "which": f"drafter_{i}", "ckpt": fingerprint(ckpt)})
        rows.append({**drafter_row(label, res, estimate_of(ckpt)), "served_as": served_as(ckpt)})
    return rows
