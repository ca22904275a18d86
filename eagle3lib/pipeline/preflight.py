"""What can be checked against the verifier itself (its config.json, not only the profile) before any stage runs or
any server starts: the auxiliary layer ids fit its depth, and the drafter layer can be served beside it here. A run
that would fail in the train stage after an hour of generation fails in a second instead."""

from __future__ import annotations

import sys
from typing import Any

from eagle3lib.config.profile import ParamsError

DRAFTER_STAGES = ("train", "data_scaling")  # the stages that build a drafter from train.drafter_layer
# Analysis stages read other stages' outputs, not the verifier: a run of only these checks nothing against it (and
# does not wait on the hub for a model this machine cannot reach: the kimi-k2.5 profile's deployment stage)
ANALYSIS_STAGES = ("learning_curves", "cost_projection", "compare_runs", "deployment")


def preflight(prof: Any, stage_names: list[str]) -> None:
    """Raises ParamsError naming the profile, the key and the fix; prints why when the verifier's config cannot be read
    here (a hub id on a machine without access: the stages that need it will say so)."""
    import torch

    from eagle3lib.model.drafter_shape import choose_drafter_layer
    from eagle3lib.model.verifier import aux_layer_ids, load_config, missing_local_folder, resolve_model

    if stage_names and all(s in ANALYSIS_STAGES for s in stage_names):
        return
    missing = missing_datasets(prof, stage_names)
    if missing:  # before the runner starts a verifier server for generate (~30 s on CPU, minutes for a large model)
        raise ParamsError("\n".join(f"{prof.path}: {p}" for p in missing))
    vcfg = prof.verifier
    if missing_local_folder(vcfg.model):
        raise ParamsError(f"{prof.path}: verifier.model: no such folder: {vcfg.model}")
    try:
        vconf = load_config(resolve_model(vcfg.model), vcfg.trust_remote_code)
    except ValueError as e:
        print(f"[preflight] skipped: {e}", file=sys.stderr)
        return
    problems = weight_problems(resolve_model(vcfg.model)) + reasoning_parser_problems(vcfg.reasoning_parser)
    try:
        aux_layer_ids(vcfg.aux_layer_ids, int(vconf.num_hidden_layers))
    except ValueError as e:
        problems.append(str(e))
    if any(s in stage_names for s in DRAFTER_STAGES):
        tcfg = prof.section("train")
        try:
            choose_drafter_layer(tcfg.drafter_layer, vconf, torch.cuda.is_available())
        except ValueError as e:
            problems.append(str(e))
        problems += train_launch_problems(tcfg, torch.cuda.is_available())
    if "recipes" in stage_names:
        problems += recipe_problems(prof, vconf, torch.cuda.is_available())
    if problems:
        raise ParamsError("\n".join(f"{prof.path}: {p}" for p in problems))


def weight_problems(model_path: str) -> list[str]:
    """A verifier safetensors file cut short (an interrupted download or copy) is named here: vLLM's start-up only
    said its last log line, 40 s in."""
    from pathlib import Path

    from eagle3lib.pipeline.model_folder import safetensors_bytes

    folder, unread = Path(model_path), []
    for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        safetensors_bytes(f, unread)
    return [f"verifier.model: {u}" for u in unread]


def installed_reasoning_parsers() -> list[str] | None:
    """The reasoning parser names the installed vLLM registers, read from its source without importing vLLM (seconds);
    None when they cannot be read (another vLLM layout: the check is skipped)."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    init = Path(spec.origin).parent / "reasoning" / "__init__.py" if spec and spec.origin else None
    try:
        tree = ast.parse(init.read_text()) if init else None
    except (OSError, SyntaxError):
        return None
    for node in ast.walk(tree) if tree else []:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(getattr(t, "id", "") == "_REASONING_PARSERS_TO_REGISTER" for t in node.targets)):
            return sorted(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    return None


def reasoning_parser_problems(name: str | None) -> list[str]:
    """verifier.reasoning_parser must be one vLLM knows ("none" was accepted and failed the server 40 s in)."""
    known = installed_reasoning_parsers() if name else None
    if not known or name in known:
        return []
    hint = "; null (no parser) is written without quotes" if name.lower() in ("none", "null", "off", "false") else ""
    return [f"verifier.reasoning_parser: {name!r} is not a reasoning parser of the installed vLLM ({', '.join(known)})"
            f"{hint}"]


def recipe_problems(prof: Any, vconf: Any, cuda: bool) -> list[str]:
    """Each chain recipe's train settings checked as the train stage would check them, before the first of many
    trainings starts (a recipe this verifier cannot take would otherwise fail after the others have trained)."""
    from eagle3lib.config.profile import load_profile
    from eagle3lib.config.recipes import DFLASH
    from eagle3lib.model.drafter_shape import choose_drafter_layer

    rcfg, problems = prof.section("recipes"), []
    for name in rcfg.names:
        if name == DFLASH:
            continue
        try:
            tcfg = load_profile(prof.path, {**prof.overrides, **rcfg.overrides(name)}).section("train")
            layer = choose_drafter_layer(tcfg.drafter_layer, vconf, cuda)
        except (ParamsError, ValueError) as e:
            problems.append(f"recipes.names: {name}: {str(e).splitlines()[0]}")
            continue
        if tcfg.parallel_drafting and layer == "mla":
            problems.append(f"recipes.names: {name}: P-EAGLE drafters are served as llama layers (vLLM 0.32) and this "
                            "verifier's drafter here is an MLA layer (train.drafter_layer: auto on a machine without "
                            f"CUDA); leave {name} out")
    return problems


def missing_datasets(prof: Any, stage_names: list[str]) -> list[str]:
    """The dataset files the stages would read that do not exist, and builtin datasets whose package is not
    installed (hub datasets are not checked)."""
    from pathlib import Path

    from eagle3lib.data.datasets import HUB_PREFIX, DatasetError, resolve_path

    wanted = []
    if "generate" in stage_names:
        wanted.append(("generate.dataset", prof.section("generate").dataset))
    if "extract" in stage_names and prof.section("extract").source != "generate":
        wanted.append(("extract.source", prof.section("extract").source))
    if "evaluate" in stage_names:
        wanted.append(("evaluate.prompts", prof.section("evaluate").prompts))
    problems = []
    for key, path in wanted:
        if path.startswith("builtin:"):
            try:
                resolve_path(path)
            except DatasetError as e:
                problems.append(f"{key}: {e}")
        elif not path.startswith(HUB_PREFIX) and not Path(path).exists():
            problems.append(f"{key}: no such file: {path} (relative paths are from the directory the run starts in)")
    return problems


def train_launch_problems(tcfg: Any, cuda: bool) -> list[str]:
    """What the train section asks of this machine and its files, checked before torchrun starts its processes (each
    of these used to fail in every rank, under ~30 lines of torchrun's ChildFailedError)."""
    from pathlib import Path

    problems = []
    if tcfg.device == "cuda" and not cuda:
        problems.append("train.device: cuda, but this machine has no CUDA device (set auto or cpu)")
    if tcfg.init_from and not Path(tcfg.init_from).expanduser().is_dir():
        problems.append(f"train.init_from: no such folder: {tcfg.init_from}")
    return problems
