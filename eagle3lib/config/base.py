from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StageConfig(BaseModel):
    """Base of every profile section: unknown keys and wrong types are errors, assignments are re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())
