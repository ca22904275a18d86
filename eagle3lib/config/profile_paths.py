"""The one rule for relative paths in a profile (or `--set`): they are relative to the directory the run was started in.

They are made absolute once, when the profile is loaded, so that every process of a run reads the same file (a stage
notebook runs in the repository, torchrun's processes in their stage folder: eagle3lib/core/paths.run_cwd) and the
stage manifests record the file that was read. Only values a profile sets are resolved: the defaults name what ships
with the repository (params/hardware.yaml). Named forms are no paths: `builtin:...`, `hf:...`, `ssh://...`, the
`generate` source, `best`/`final`, and a hub id such as `org/name` unless it is a folder here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from eagle3lib.core.paths import run_cwd

_NAMED = re.compile(r"^[A-Za-z][\w+.-]*:")  # builtin:tiny, hf:org/name, ssh://host/path


def _path(v: str, base: Path) -> str:
    if _NAMED.match(v):
        return v
    p = Path(v).expanduser()
    return v if str(p) == v and p.is_absolute() else os.path.abspath(base / p)


def _model(v: str, base: Path) -> str:
    # `org/name` is a hub id unless such a folder exists here; ./x, ../x, ~/x and a/b/c are always paths
    # (eagle3lib/model/verifier.py: missing_local_folder then names the folder)
    looks_local = v.startswith(("./", "../", "~")) or v.count("/") > 1 or (base / v).is_dir()
    return _path(v, base) if looks_local else v


def _unless(*names: str) -> Callable[[str, Path], str]:
    return lambda v, base: v if v in names else _path(v, base)


def _each(one: Callable[[str, Path], str]) -> Callable[[list[str], Path], list[str]]:
    return lambda vs, base: [one(v, base) for v in vs]


PATH_KEYS: dict[str, Callable[[Any, Path], Any]] = {
    "verifier.model": _model,
    "generate.dataset": _path,
    "extract.source": _unless("generate"),
    "train.init_from": _path,
    "evaluate.checkpoint": _unless("best", "final"),
    "evaluate.drafters": _each(_path),
    "evaluate.prompts": _path,
    "learning_curves.sources": _each(_path),
    "cost_projection.hardware_file": _path,
    "cost_projection.manifests_run_dir": _path,
    "compare_runs.runs": _each(_path),
    "deployment.hardware_file": _path,
    "deployment.results_run_dir": _path,
}


def resolve_paths(sections: dict[str, BaseModel], base: Path | None = None) -> dict[str, BaseModel]:
    """`sections` with every relative path a profile set made absolute against `base` (default: run_cwd())."""
    base = base or run_cwd()
    out = dict(sections)
    for dotted, resolve in PATH_KEYS.items():
        section, key = dotted.split(".", 1)
        cfg = out.get(section)
        if cfg is None or key not in cfg.model_fields_set or getattr(cfg, key) is None:
            continue
        value = getattr(cfg, key)
        new = resolve(value, base)
        if new != value:
            out[section] = cfg.model_copy(update={key: new})
    return out
