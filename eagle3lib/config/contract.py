"""What a stage's results depend on, from its registry row: its own section and the keys it declared it reads from
other sections (config/registry.py).

- `stage_params` is what its manifest records as `params`; `contract_changes` compares a recorded one with the
  profile as it is now, and any change makes the complete stage stale (pipeline/plan.py). Keys a section marks
  `OPERATIONAL` (how a stage runs or logs: ports, concurrency, progress bars, checkpoint cadence) never do; nor does
  a key the recorded manifest lacks (the manifest predates it: the run used what its default does).
- `ScopedProfile` is the profile a stage's context hands its code: a read of another section's key that the row does
  not declare raises `UndeclaredRead` at the read, so a dependency cannot go unrecorded (the staleness bug of a
  stage whose figures depended on keys its manifest never held).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from eagle3lib.config.profile import Profile
from eagle3lib.config.registry import SECTIONS, Read, Stage


class UndeclaredRead(AssertionError):
    """A stage read a key of another section that its registry row does not declare: a bug in eagle3lib, never a
    condition to handle (an AssertionError, so no `except ValueError` swallows it)."""


def in_force(stage: Stage, profile: Profile) -> list[Read]:
    """The stage's reads under this profile (a `when` read only when its own key is set)."""
    return stage.read_keys(profile.section(stage.section))


def _value(profile: Profile, read: Read) -> Any:
    dumped = profile.section(read.section).model_dump(mode="json")
    return dumped if read.field is None else dumped[read.field]


def stage_params(profile: Profile, stage: Stage) -> dict[str, Any]:
    """What a manifest records as a stage's parameters: the profile's name, its own section whole, and the value of
    every read in force (a whole section under its name, a key under "section.key")."""
    profile = getattr(profile, "unscoped", profile)
    params = {"profile": profile.name, stage.section: profile.section(stage.section).model_dump(mode="json")}
    for read in in_force(stage, profile):
        params[read.key] = _value(profile, read)
    return params


def value_changes(old: Any, new: Any, prefix: str) -> list[str]:
    """"key: old -> new" for each leaf that differs, nested objects compared key by key."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new)) for d in value_changes(old.get(k), new.get(k), f"{prefix}.{k}")]
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


def contract_changes(recorded: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """Each key of a stage's contract whose value differs between a manifest's `params` and `stage_params` now, as
    "section.key: old -> new". Left out: operational keys, and keys the manifest does not hold (it predates them, or
    a `when` read was off; switching it on shows as the change of its own key)."""
    changes = []
    for key, new in expected.items():
        if key == "profile" or key not in recorded:
            continue
        section, _, field = key.partition(".")
        ops = getattr(SECTIONS.get(section), "OPERATIONAL", frozenset())
        if field:
            changes += [] if field in ops else value_changes(recorded[key], new, key)
            continue
        old = recorded[key] if isinstance(recorded[key], dict) else {}
        for name in sorted((set(old) & set(new)) - ops):
            changes += value_changes(old[name], new[name], f"{key}.{name}")
    return changes


class _SectionView:
    """Another stage's section as a stage that declared some of its keys sees it: those keys, nothing else."""

    def __init__(self, cfg: BaseModel, allowed: set[str], stage: Stage, section: str):
        self._cfg, self._allowed, self._stage, self._section = cfg, allowed, stage, section

    def __getattr__(self, name: str) -> Any:
        if name in self._allowed:
            return getattr(self._cfg, name)
        raise UndeclaredRead(
            f"the {self._stage.name} stage read {self._section}.{name}, which its row in config/registry.py does not "
            f"declare (it declares {', '.join(f'{self._section}.{k}' for k in sorted(self._allowed))}): declare it "
            "there, so its manifest records it and a change makes the stage stale")


class ScopedProfile(Profile):
    """The profile as one stage may read it: its own section, and of the others what its row declares."""

    def __init__(self, profile: Profile, stage: Stage):
        super().__init__(profile.path, profile.name, profile.description, profile._sections, profile.overrides)
        self.unscoped, self.stage = profile, stage

    def section(self, name: str) -> Any:
        cfg = self.unscoped.section(name)
        if name == self.stage.section:
            return cfg
        reads = [r for r in self.stage.reads if r.section == name]
        live = [r for r in reads if r in in_force(self.stage, self.unscoped)]
        if any(r.field is None for r in live):
            return cfg
        if live:
            return _SectionView(cfg, {r.field for r in live if r.field}, self.stage, name)
        why = (f"declares it only when {self.stage.section}.{reads[0].when} is set" if reads
               else "does not declare it")
        raise UndeclaredRead(f"the {self.stage.name} stage read the {name} section, and its row in config/registry.py "
                             f"{why}: declare the keys it reads there, so its manifest records them and a change makes "
                             "the stage stale")
