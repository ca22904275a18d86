"""Profiles: YAML files in params/ with one section per stage, validated before anything runs.

A profile is named (`tiny` -> params/tiny.yaml) or given as a path. `--set section.key=value` overrides apply on top, the
value parsed as YAML (`--set train.steps=50`, `--set verifier.aux_layer_ids=[1,3,5]`). Every error names the file (or
`--set`) and the dotted key, and suggests the closest valid key for a misspelling.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from eagle3lib.config.profile_paths import resolve_paths
from eagle3lib.config.registry import SECTIONS
from eagle3lib.core.hints import did_you_mean
from eagle3lib.core.paths import PARAMS_DIR

TOP_LEVEL_TEXT = {"description"}  # free text allowed at the top of a profile
# Keys that were renamed: a profile or --set using the old name gets an error naming the new one.
RENAMED = {
    "extract.max_seq_len": "extract.max_sample_tokens",  # the per-sample cut (train's row length is another thing)
    "train.max_seq_len": "train.packed_row_tokens",  # tokens per packed row
    "evaluate.k": "evaluate.ttt_steps",  # one name for the draft steps everywhere (vLLM: num_speculative_tokens)
}


class ParamsError(ValueError):
    """A profile or override is wrong; the message names the file and the key."""


def section_class(section: str) -> type[BaseModel]:
    return SECTIONS[section]


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


def _key_lines(node: yaml.Node, path: Path, prefix: str = "", out: dict[str, int] | None = None) -> dict[str, int]:
    """"section.key" -> line of every mapping key in the file; a key given twice in one mapping is an error (plain
    YAML would silently keep the last one)."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            name, line = str(k.value), k.start_mark.line + 1
            if name in seen:
                raise ParamsError(f"{path}:{line}: duplicate key '{prefix}{name}' (also at line {seen[name]})")
            seen[name] = line
            out.setdefault(f"{prefix}{name}", line)
            _key_lines(v, path, f"{prefix}{name}.", out)
    elif isinstance(node, yaml.SequenceNode):
        for v in node.value:
            _key_lines(v, path, prefix, out)
    return out


def load_yaml_strict(path: Path) -> Any:
    """A YAML file as yaml.safe_load reads it, but a key given twice in one mapping is refused naming the file, the
    key and both lines (the hardware table: a second row of one name silently replaced the first)."""
    text = path.read_text()
    if text.strip():
        _key_lines(yaml.compose(text), path)
    return yaml.safe_load(text)


def _load_raw(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """(the profile's sections, the line of each key)."""
    try:
        text = path.read_text()
        lines = _key_lines(yaml.compose(text), path) if text.strip() else {}
        raw = yaml.safe_load(text) or {}
    except OSError as e:
        raise ParamsError(f"{path}: cannot read the profile ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: a profile is a mapping of sections, got {type(raw).__name__}")
    if not raw:  # almost always the wrong file (or one not saved yet): every stage would run on the defaults
        raise ParamsError(f"{path}: the profile is empty (no section is set); write its sections, e.g. copy "
                          f"{PARAMS_DIR / 'tiny.yaml'}")
    return raw, lines


def _apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> None:
    for dotted, value in overrides.items():
        if "." not in dotted:
            raise ParamsError(f"--set {dotted}: expected section.key (sections: {', '.join(SECTIONS)})")
        section, key = dotted.split(".", 1)
        if section not in SECTIONS:
            raise ParamsError(f"--set {dotted}: unknown section '{section}'{did_you_mean(section, list(SECTIONS))}")
        sec = raw.setdefault(section, {})
        if sec is None:
            sec = raw[section] = {}
        sec[key] = value


_DOTTED = re.compile(r"\b([a-z_]+)\.([a-z_0-9]+)\b")


class _Where:
    """Names where a value came from: `--set`, or FILE:LINE of its key (the section's line when the key is absent)."""

    def __init__(self, path: Path, lines: dict[str, int], override_keys: set[str]):
        self.path, self.lines, self.override_keys = path, lines, override_keys

    def __call__(self, *dotted: str) -> str:
        if any(d in self.override_keys for d in dotted):
            return "--set"
        for d in dotted:
            for name in (d, d.split(".")[0]):
                if name in self.lines:
                    return f"{self.path}:{self.lines[name]}"
        return str(self.path)


def _errors(section: str, data: Any, where: _Where) -> tuple[BaseModel | None, list[str]]:
    """The validated section, or every problem with it, one line each naming the key."""
    cls = section_class(section)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return None, [f"{where(section)}: section '{section}' must be a mapping, got {type(data).__name__}"]
    try:
        return cls.model_validate(data), []
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = [str(x) for x in err["loc"]]
            msg = str(err["msg"]).removeprefix("Value error, ")
            if not loc:  # a rule over several fields: its message names them as section.key
                keys = [f"{s}.{k}" for s, k in _DOTTED.findall(msg) if s == section] or [section]
                msgs.append(f"{where(*keys)}: {msg}")
                continue
            dotted = f"{section}.{'.'.join(loc)}"
            top = f"{section}.{loc[0]}"
            if err["type"] == "extra_forbidden" and dotted in RENAMED:
                msgs.append(f"{where(top)}: '{dotted}' is now called '{RENAMED[dotted]}'")
            elif err["type"] == "extra_forbidden":
                msgs.append(f"{where(top)}: unknown key '{dotted}'{did_you_mean(loc[0], list(cls.model_fields))}")
            else:  # our own validators say what they got; pydantic's range messages do not
                got = "" if err["type"] == "value_error" else f" (got {err.get('input')!r})"
                msgs.append(f"{where(dotted, top)}: '{dotted}': {msg}{got}")
        return None, msgs


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


def _generate_fits_context(validated: dict[str, BaseModel], where: _Where) -> list[str]:
    """generate.max_tokens against verifier.max_model_len: vLLM refuses (HTTP 400) every request whose max_tokens
    leaves no room for a prompt in the context, so such a pair would fail every prompt of the run."""
    gen, ver = validated.get("generate"), validated.get("verifier")
    if gen is None or ver is None or gen.max_tokens is None or gen.max_tokens < ver.max_model_len:
        return []
    return [f"{where('generate.max_tokens', 'verifier.max_model_len')}: generate.max_tokens ({gen.max_tokens}) must be "
            f"below verifier.max_model_len ({ver.max_model_len}): the server refuses every request whose prompt and "
            "answer budget exceed its context; lower generate.max_tokens (or raise verifier.max_model_len, the "
            "server's --max-model-len)"]


def load_profile(profile: str | Path, overrides: dict[str, Any] | None = None, sections: list[str] | None = None) -> Profile:
    """Load and validate `sections` (default: every available one) of a profile, overrides applied. Every problem of
    every section is reported at once, one line each, naming the key and where it was set."""
    path = resolve_profile_path(profile)
    raw, lines = _load_raw(path)
    overrides = dict(overrides or {})
    _apply_overrides(raw, overrides)
    where = _Where(path, lines, set(overrides))
    description = str(raw.pop("description", "")) if "description" in TOP_LEVEL_TEXT else ""
    for key in raw:
        if key not in SECTIONS:
            src = "--set" if any(k.startswith(f"{key}.") for k in overrides) else where(key)
            raise ParamsError(f"{src}: unknown section '{key}'{did_you_mean(key, list(SECTIONS))}")
    wanted = sections if sections is not None else list(SECTIONS)
    wanted = list(dict.fromkeys(["verifier", *wanted]))
    validated, problems = {}, []
    for name in wanted:
        cfg, errs = _errors(name, raw.get(name), where)
        problems += errs
        if cfg is not None:
            validated[name] = cfg
    problems += _generate_fits_context(validated, where)
    if problems:
        raise ParamsError("\n".join(problems))
    return Profile(path, path.stem, description, resolve_paths(validated), overrides)
