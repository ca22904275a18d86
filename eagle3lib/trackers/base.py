"""What every tracker shares: the record -> scalar naming, params flattening, and the import check."""

from __future__ import annotations

import importlib
import math
from typing import Any

TRACKERS = ("tensorboard", "wandb", "mlflow")
KINDS = ("train", "val", "served")  # metrics.jsonl record kinds, in the order one step writes them
# numeric record fields that are not metrics: the x axis, and the wall clock (it becomes each point's timestamp)
NOT_METRICS = ("kind", "step", "time")


class TrackerError(RuntimeError):
    """A tracker that cannot be used: raised before training starts, naming the setting to change."""


def require(tracker: str, module: str):
    """The tracker's package, or a clear error naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TrackerError(f"train.report_to lists '{tracker}', but its package is not installed ({e}); install it "
                           f"with: pip install -e '.[{tracker}]'  (or remove '{tracker}' from train.report_to)") from None


def metric_values(rec: dict[str, Any]) -> dict[str, float]:
    """`{kind}/{field}` -> value for the numeric fields of one metrics.jsonl record (None = not finite: skipped)."""
    kind = rec["kind"]
    out = {}
    for k, v in rec.items():
        if k in NOT_METRICS or isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            continue
        out[f"{kind}/{k}"] = float(v)
    return out


def records_from_metrics(points: dict[tuple[str, int], dict[str, float]], times: dict | None = None) -> list[dict]:
    """{(kind, step): {"kind/field": value}} -> metrics.jsonl-shaped records, ordered by step then kind."""
    out = []
    for (kind, step), values in sorted(points.items(), key=lambda kv: (kv[0][1], KINDS.index(kv[0][0])
                                                                       if kv[0][0] in KINDS else 9, kv[0][0])):
        rec: dict[str, Any] = {"kind": kind, "step": step}
        rec.update({k.split("/", 1)[1]: v for k, v in values.items()})
        out.append(rec)
    return out


def split_tag(tag: str) -> tuple[str, str]:
    """'train/loss' -> ('train', 'loss'); a tag without a kind ('lr') belongs to the train records."""
    kind, _, field = tag.partition("/")
    if not field:
        return "train", kind
    return kind, field.replace("/", "_")


def flat_params(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested profile sections -> {'train.lr': '0.0001', ...}: the one shape every tracker's params accept."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_params(v, f"{key}."))
        else:
            out[key] = str(v)[:500]  # MLflow caps a value's length; a param this long is a list nobody reads whole
    return out


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows -> a Markdown table (TensorBoard's text tab renders it; numbers to 4 significant digits)."""
    if not rows:
        return "(no rows)"
    cols = list(dict.fromkeys(k for r in rows for k in r))

    def cell(v: Any) -> str:
        if v is None:
            return ""
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def last_steps(records: list[dict[str, Any]], upto: int | None = None) -> dict[str, int]:
    """The newest step per kind among records a tracker already holds (at most `upto`)."""
    out: dict[str, int] = {}
    for r in records:
        if upto is None or r["step"] <= upto:
            out[r["kind"]] = max(out.get(r["kind"], -1), r["step"])
    return out
