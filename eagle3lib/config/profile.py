"""Profiles: YAML files in params/ with one section per stage, validated before anything runs.

A profile is named (`tiny` -> params/tiny.yaml) or given as a path. `--set section.key=value` overrides apply on top, the
value parsed as YAML (`--set train.steps=50`, `--set verifier.aux_layer_ids=[1,3,5]`). Every error names the file (or
`--set`) and the dotted key, and suggests the closest valid key for a misspelling.
"""

from __future__ import annotations

import difflib
import importlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from eagle3lib.core.paths import PARAMS_DIR

# section -> "module:Class". Stages register here; the runner and notebooks validate through this table.
SECTIONS: dict[str, str] = {
    "verifier": "eagle3lib.config.verifier:VerifierConfig",
    "verifier_report": "eagle3lib.config.verifier_report:VerifierReportConfig",
    "generate": "eagle3lib.config.generate:GenerateConfig",
    "extract": "eagle3lib.config.extract:ExtractConfig",
    "train": "eagle3lib.config.train:TrainConfig",
    "evaluate": "eagle3lib.config.evaluate:EvaluateConfig",
    "learning_curves": "eagle3lib.config.analysis:LearningCurvesConfig",
    "cost_projection": "eagle3lib.config.analysis:CostProjectionConfig",
}
TOP_LEVEL_TEXT = {"description"}  # free text allowed at the top of a profile


class ParamsError(ValueError):
    """A profile or override is wrong; the message names the file and the key."""


def section_class(section: str) -> type[BaseModel]:
    module, cls = SECTIONS[section].split(":")
    return getattr(importlib.import_module(module), cls)


def available_sections() -> list[str]:
    """Sections whose config module exists (stages land one by one)."""
    out = []
    for name, target in SECTIONS.items():
        try:
            importlib.import_module(target.split(":")[0])
        except ModuleNotFoundError:
            continue
        out.append(name)
    return out


def resolve_profile_path(profile: str | Path) -> Path:
    p = Path(profile)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise ParamsError(f"profile file not found: {p}")
        return p.resolve()
    candidate = PARAMS_DIR / f"{profile}.yaml"
    if not candidate.exists():
        names = sorted(x.stem for x in PARAMS_DIR.glob("*.yaml") if x.stem != "hardware")
        raise ParamsError(f"unknown profile '{profile}': no {candidate} (profiles: {', '.join(names)})")
    return candidate


def parse_set(items: list[str] | None) -> dict[str, Any]:
    """`["train.steps=50", ...]` -> `{"train.steps": 50}` with YAML-typed values."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ParamsError(f"--set {item!r}: expected section.key=value")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ParamsError(f"--set {item!r}: value is not valid YAML: {e}") from e
    return out


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _load_raw(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: a profile is a mapping of sections, got {type(raw).__name__}")
    return raw


def _apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> None:
    for dotted, value in overrides.items():
        if "." not in dotted:
            raise ParamsError(f"--set {dotted}: expected section.key (sections: {', '.join(SECTIONS)})")
        section, key = dotted.split(".", 1)
        if section not in SECTIONS:
            raise ParamsError(f"--set {dotted}: unknown section '{section}'{_suggest(section, list(SECTIONS))}")
        sec = raw.setdefault(section, {})
        if sec is None:
            sec = raw[section] = {}
        sec[key] = value


def _validate(section: str, data: Any, source: str, override_keys: set[str]) -> BaseModel:
    cls = section_class(section)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ParamsError(f"{source}: section '{section}' must be a mapping, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            key = ".".join(str(x) for x in err["loc"])
            where = "--set" if f"{section}.{err['loc'][0]}" in override_keys else source
            if err["type"] == "extra_forbidden":
                hint = _suggest(str(err["loc"][0]), list(cls.model_fields))
                msgs.append(f"{where}: unknown key '{section}.{key}'{hint}")
            else:
                msgs.append(f"{where}: '{section}.{key}': {err['msg']} (got {err.get('input')!r})")
        raise ParamsError("\n".join(msgs)) from None


class Profile:
    """A validated profile: `profile.section("train")` is the typed TrainConfig."""

    def __init__(self, path: Path, name: str, description: str, sections: dict[str, BaseModel], overrides: dict[str, Any]):
        self.path = path
        self.name = name
        self.description = description
        self._sections = sections
        self.overrides = overrides

    def section(self, name: str) -> Any:
        if name not in self._sections:
            raise ParamsError(f"{self.path}: section '{name}' is not available (module not installed?)")
        return self._sections[name]

    @property
    def verifier(self) -> Any:
        return self.section("verifier")

    def as_dict(self) -> dict[str, Any]:
        return {k: v.model_dump(mode="json") for k, v in self._sections.items()}


def load_profile(profile: str | Path, overrides: dict[str, Any] | None = None, sections: list[str] | None = None) -> Profile:
    """Load and validate `sections` (default: every available one) of a profile, overrides applied."""
    path = resolve_profile_path(profile)
    raw = _load_raw(path)
    overrides = dict(overrides or {})
    _apply_overrides(raw, overrides)
    description = str(raw.pop("description", "")) if "description" in TOP_LEVEL_TEXT else ""
    for key in raw:
        if key not in SECTIONS:
            src = "--set" if any(k.startswith(f"{key}.") for k in overrides) else str(path)
            raise ParamsError(f"{src}: unknown section '{key}'{_suggest(key, list(SECTIONS))}")
    wanted = sections if sections is not None else available_sections()
    wanted = list(dict.fromkeys(["verifier", *wanted]))
    validated = {name: _validate(name, raw.get(name), str(path), set(overrides)) for name in wanted}
    return Profile(path, path.stem, description, validated, overrides)
