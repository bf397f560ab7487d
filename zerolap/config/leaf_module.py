"""``zero_optimization.leaf_module``: which modules stage 3 gathers whole, with their subtree
(``zero.leaf_modules``). DeepSpeed's keys and defaults: the mixture-of-experts blocks of
Mixtral, Qwen2-MoE and Qwen3-MoE, whose experts run only on the tokens routed to them."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from zerolap.config.section import ConfigSection

__all__ = ["LeafModuleConfig"]

DEFAULT_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]


class LeafModuleConfig(ConfigSection):
    """The ``zero_optimization.leaf_module`` section."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_CLASSES))
    """Module classes (plain or fully qualified names) gathered as one unit with their
    children."""
    names: list[str] = Field(default_factory=list)
    """Modules named exactly so (``named_modules`` names) are leaves."""
    name_suffixes: list[str] = Field(default_factory=list)
    """Modules whose names end with one of these are leaves."""

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value
