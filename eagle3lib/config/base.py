from __future__ import annotations

import types
import typing
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _numbers_only(annotation) -> bool:
    """True for an int/float field (optionally None) that does not also take a bool."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    return bool not in args and any(a in (int, float) for a in args)


class StageConfig(BaseModel):
    """Base of every profile section: unknown keys and wrong types are errors, assignments are re-validated."""

    # allow_inf_nan=False: `gt=0` admits inf, and `train.lr=inf` trained (NaN losses) after torchrun had started
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)
    # keys that change how a stage runs or logs, never what it produces (its data, drafter or measured figures): a
    # change does not make a complete stage stale (config/contract.py)
    OPERATIONAL: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v, info: ValidationInfo):
        # pydantic reads true as 1 for an int field: `train.ttt_steps=true` would train one step without a word
        if isinstance(v, bool) and info.field_name and _numbers_only(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expects a number, got {str(v).lower()}")
        return v
