"""The `recipes` section: drafting recipes trained on this run's store and measured side by side through vLLM
(eagle3lib/stages/recipes.py).

A recipe is the train stage's settings plus a few `train.*` overrides (a loss, EAGLE 3.1's flags, parallel drafting),
or DFlash, which trains another drafter (eagle3lib/model/dflash.py, eagle3lib/training/dflash_loop.py). Each trains
on the same store, each is measured on evaluate's prompts, K and server settings, beside the verifier alone.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from eagle3lib.config.base import StageConfig
from eagle3lib.config.train import TrainConfig
from eagle3lib.core.hints import did_you_mean

# name -> train overrides: each applied on top of the profile's train section. "kl" is the default loss (the train
# stage's own run when the profile changes nothing else, then reused instead of trained again).
BUILTIN_RECIPES: dict[str, dict[str, Any]] = {
    "kl": {"train.loss": "kl"},  # forward KL to the verifier's distribution (EAGLE-3's)
    "reverse_kl": {"train.loss": "reverse_kl"},  # mode-seeking
    "jsd": {"train.loss": "jsd"},  # Jensen-Shannon, bounded
    "tv": {"train.loss": "tv"},  # total variation: the rejection rate itself
    "ce_argmax": {"train.loss": "ce_argmax"},  # hard cross-entropy on the verifier's argmax (what greedy accepts)
    "eagle3.1": {"train.fc_norm": True, "train.norm_output": True},  # EAGLE 3.1's normalisation flags, forward KL
    "peagle": {"train.parallel_drafting": True},  # P-EAGLE: all K drafts from one forward (parallel_drafting: true)
}
DFLASH = "dflash"  # block-diffusion drafting (vLLM method dflash): its own drafter and trainer, not train overrides
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # a recipe's name is its folder: RUN_DIR/recipes/<name>


def _bad_name(name: str) -> str | None:
    if _NAME.fullmatch(name):
        return None
    return (f"{name!r} cannot name a recipe: it becomes the folder RUN_DIR/recipes/<name>, so letters, digits, '.', "
            "'_' and '-' only, not starting with '.'")


def _train_problems(over: dict[str, Any]) -> list[str]:
    """What the train section would refuse in a recipe's overrides, found by `params` instead of after the recipes
    before it have trained. Rules over several keys need the profile's own train section: the pre-run check applies
    those (eagle3lib/pipeline/preflight.py recipe_problems)."""
    fields = list(TrainConfig.model_fields)
    data = {k.removeprefix("train."): v for k, v in over.items()}
    problems = [f"unknown key 'train.{k}'{did_you_mean(k, fields)}" for k in data if k not in fields]
    try:
        TrainConfig.model_validate({k: v for k, v in data.items() if k in fields})
    except ValidationError as e:
        for err in e.errors():
            if err["loc"]:
                got = "" if err["type"] == "value_error" else f" (got {err.get('input')!r})"
                msg = str(err["msg"]).removeprefix("Value error, ")
                problems.append(f"'train.{'.'.join(str(x) for x in err['loc'])}': {msg}{got}")
    return problems


class RecipesConfig(StageConfig):
    custom: dict[str, dict[str, Any]] = {}  # your own recipes: name -> train overrides, e.g. {"lr-1e-3":
    # {"train.lr": 0.001}}; list the name in `names` to run it
    names: list[str] = ["kl", "reverse_kl", "jsd", "tv", "ce_argmax", "eagle3.1", "peagle", DFLASH]  # which recipes,
    # in the table's order: BUILTIN_RECIPES' names, "dflash", or a key of `custom`
    modes: list[Literal["greedy", "sampled"]] = ["greedy", "sampled"]  # vLLM decodings measured per recipe (sampled
    # at evaluate.temperature): greedy verification accepts only the argmax, so a loss can win one and lose the other
    seeds: list[int] = []  # training seeds (train.seed) per recipe; [] = the train section's seed alone. Two or
    # more: every recipe trained once per seed (RUN_DIR/recipes/<name>.seed-<seed>/ beside the default seed's folder),
    # every drafter measured with each prompt alone, and each recipe's tau and its difference to the first recipe get
    # intervals over prompts and a verdict: one seed's ranking is one draw (eagle3lib/studies/recipe_seeds.py)
    dflash_steps: int = Field(1000, ge=1)  # DFlash optimizer steps (4 sequences x 32 blocks each; ~30 s per 1,000 on
    # the tiny verifier, 2 cores)
    dflash_layers: int = Field(1, ge=1)  # DFlash drafter layers (each reads the whole context: one is the paper's
    # smallest)
    progress: bool = True  # tqdm bars of each measurement

    @field_validator("custom")
    @classmethod
    def _custom(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, over in v.items():
            if problem := _bad_name(name):
                raise ValueError(problem)
            if name in BUILTIN_RECIPES or name == DFLASH:
                raise ValueError(f"{name!r} is a built-in recipe's name; choose another")
            bad = [k for k in over if not k.startswith("train.")]
            if bad:
                raise ValueError(f"{name!r}: a recipe overrides train.* keys only, got {bad}")
            if problems := _train_problems(over):
                raise ValueError(f"recipes.custom.{name}: {'; '.join(problems)}")
        return v

    @field_validator("names")
    @classmethod
    def _names(cls, v: list[str], info: ValidationInfo) -> list[str]:
        known = [*BUILTIN_RECIPES, DFLASH, *(info.data.get("custom") or {})]  # custom is validated first (declared first)
        for i, n in enumerate(v):
            if problem := _bad_name(n):
                raise ValueError(f"item {i}: {problem}")
            if n not in known and "custom" in info.data:  # else custom's own error says what is wrong with its recipes
                raise ValueError(f"item {i}, {n!r}, is not a recipe; known: {', '.join(known)}")
        if len(set(v)) != len(v):
            raise ValueError(f"a recipe listed twice: {v}")
        if not v:
            raise ValueError("at least one recipe")
        return v

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v) or any(x < 0 for x in v):
            raise ValueError(f"distinct seeds >= 0, got {v}")
        return v

    @field_validator("modes")
    @classmethod
    def _modes(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one of greedy, sampled")
        return v

    def overrides(self, name: str) -> dict[str, Any]:
        """The train overrides of recipe `name` ({} for DFlash)."""
        return {} if name == DFLASH else {**BUILTIN_RECIPES, **self.custom}[name]
