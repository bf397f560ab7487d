"""The base of every ds_config section model: unknown keys are errors that name the dotted
path and the nearest valid key."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigSection"]


class ConfigSection(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
