"""What a run would do with each selected stage, and why: skip it, run it for the first time, resume it, repair it,
or run it again from scratch. The runner acts on these decisions; `eagle3lib run --dry-run` prints them and touches
nothing.

A complete stage is run again when it is stale:
- its input stage completed again since it started (ids, not clocks: a clock stepped by NTP, or stages run on
  machines whose clocks differ, would make a finished stage look older than its input and redo it), or runs first in
  this run;
- a key of its contract changed: its own section or a key of another section its registry row declares it reads
  (config/contract.py; operational keys excepted).
A complete stage whose declared outputs are gone (or whose store is damaged) is repaired: run again for what is
missing. Stages marked always_run (analysis of other stages' outputs) run each time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from eagle3lib.config.contract import contract_changes, stage_params
from eagle3lib.config.profile import Profile
from eagle3lib.config.registry import Stage
from eagle3lib.core.manifest import read_manifest
from eagle3lib.data.store_index import store_problems

Action = Literal["skip", "run", "resume", "repair", "again"]
WORDS: dict[Action, str] = {"skip": "skip", "run": "run", "resume": "resume", "repair": "repair",
                            "again": "run again from scratch"}


@dataclass(frozen=True)
class Decision:
    action: Action
    why: str

    def line(self, name: str) -> str:
        return f"{name:16} {WORDS[self.action]:22} {self.why}"


def input_stale(run_dir: Path, stage: Stage) -> str | None:
    """Why the complete stage no longer matches its input (None if it does): it started from another output of its
    input stage than the one there now. A failed or interrupted attempt of the input does not count (its data is
    unchanged or, resumed, still to be completed); a stage made before ids were recorded is never called stale."""
    upstream = stage.input_stage
    mine = read_manifest(run_dir / stage.name)
    theirs = read_manifest(run_dir / upstream) if upstream else None
    if not (mine and theirs) or theirs.get("status") != "complete":
        return None
    used, now = (mine.get("input_ids") or {}).get(upstream), theirs.get("output_id")
    if used and now and used != now:
        return f"{upstream} was re-run after it (its outputs are {now[:8]}, this stage used {used[:8]})"
    return None


def stale_reason(run_dir: Path, stage: Stage, m: dict[str, Any], profile: Profile | None = None,
                 inputs_running: frozenset[str] = frozenset()) -> str | None:
    """Why the complete stage (its manifest `m`) must run again (None if it need not): its input was made again (or is
    made again in this run: `inputs_running`), or a key of its contract under `profile` differs from what `m`
    recorded."""
    if why := input_stale(run_dir, stage):
        return why
    if stage.input_stage in inputs_running:
        return f"its input stage {stage.input_stage} runs before it in this run"
    if profile is None:
        return None
    changes = contract_changes(m.get("params") or {}, stage_params(profile, stage))
    return f"changed since it ran: {'; '.join(changes)}" if changes else None


def missing_outputs(stage_dir: Path, m: dict[str, Any], disposable: frozenset[str] = frozenset()) -> list[str]:
    """The outputs a complete stage's manifest declares (paths relative to its folder) that are not there, its
    disposable ones excepted. Absolute paths are references to other stages' files (evaluate's checkpoint)."""
    declared = [p for k, v in (m.get("outputs") or {}).items() if k not in disposable
                for p in (v if isinstance(v, list) else [v])]
    return [p for p in declared if isinstance(p, str) and p and not os.path.isabs(p) and "://" not in p
            and not (stage_dir / p).exists()]


def damaged_outputs(stage_dir: Path, m: dict[str, Any], stage: Stage) -> str | None:
    """Why a complete stage's outputs can no longer be trusted (None if they can): a declared output is missing (a
    deleted train/final was "complete, skipped", and evaluate then blamed a setting nobody set), or its store is
    damaged (checked by names and sizes)."""
    if missing := missing_outputs(stage_dir, m, stage.disposable):
        return f"its outputs {', '.join(missing)} are missing"
    if not stage.store:
        return None
    problems = store_problems(stage_dir, (m.get("figures") or {}).get("samples"))
    return f"its store is damaged ({'; '.join(problems)})" if problems else None


def decide(stage: Stage, run_dir: Path, profile: Profile | None, force: bool,
           inputs_running: frozenset[str] = frozenset()) -> Decision:
    """What a run does with `stage`. A damaged manifest raises (ValueError naming it) unless forced: a forced stage
    starts over, its folder set aside whole."""
    if force:
        return Decision("again", "--force")
    if stage.always_run:
        return Decision("run", "it analyses other stages' outputs: run each time")
    m = read_manifest(run_dir / stage.name)
    if m is None:
        return Decision("run", "not run yet")
    if m.get("status") != "complete":
        return Decision("resume", f"its last attempt is {m.get('status')}: it resumes from what that one finished")
    if why := stale_reason(run_dir, stage, m, profile, inputs_running):
        return Decision("again", why)
    if damage := damaged_outputs(run_dir / stage.name, m, stage):
        return Decision("repair", f"complete, but {damage}: run again for what is missing")
    return Decision("skip", "complete; nothing it depends on changed")


def plan(stages: list[Stage], run_dir: Path, profile: Profile, force: bool) -> list[tuple[Stage, Decision]]:
    """The decision for each of `stages` in order, each knowing which earlier ones will make new outputs (a repaired
    store is the same data: its stages after it keep theirs)."""
    running: set[str] = set()
    out = []
    for stage in stages:
        d = decide(stage, run_dir, profile, force, frozenset(running))
        if d.action in ("run", "resume", "again") or (d.action == "repair" and not stage.store):
            running.add(stage.name)
        out.append((stage, d))
    return out
