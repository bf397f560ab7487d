"""The base of every ds_config section model.

Every section inherits these rules from ``ConfigSection``:

* an unknown key is an error naming its dotted path and the nearest valid key (at the top
  level, where DeepSpeed tolerates them, a warning saying the same);
* a key given in two spellings at once (``bf16`` and ``bfloat16``) is an error;
* ``"auto"`` means "the default", as in DeepSpeed's own pydantic sections (the Hugging Face
  Trainer writes it for values it fills in);
* a field marked ``DeepSpeedOnly`` is a DeepSpeed key zerolap accepts and stores, so DeepSpeed
  configs load unchanged; ``unsupported_keys()`` names it when it is set to something other than
  its default or "off", and a value in its ``reject_if`` (one that zerolap cannot ignore without
  changing the results) is an error.

A section's own cross-field rules live in one place, its ``_check`` method.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import AliasChoices, BaseModel, ConfigDict, ValidationInfo, model_validator
from pydantic.fields import FieldInfo

from zerolap.config.errors import Problem, problems_error, show

__all__ = ["ConfigSection", "DeepSpeedOnly", "enabled", "is_set", "is_true", "nearest_key"]


@dataclass(frozen=True)
class DeepSpeedOnly:
    """Field marker (``Annotated[T, DeepSpeedOnly(...)]``): a DeepSpeed key zerolap accepts but
    does not implement."""

    reject_if: Callable[[Any], bool] | None = None
    """True for values that zerolap cannot ignore without changing the results."""
    reason: str = ""
    """Why such a value is rejected, for the error message."""


def is_true(value: Any) -> bool:
    return value is True


def is_set(value: Any) -> bool:
    return value is not None


def enabled(value: Any) -> bool:
    """A DeepSpeed feature block (``{"enabled": true, ...}``) that is switched on."""
    return isinstance(value, Mapping) and value.get("enabled") is True


def nearest_key(key: str, choices: list[str]) -> str | None:
    """The valid key closest to ``key``, compared without case, if any is close."""
    by_lower = {choice.lower(): choice for choice in choices}
    found = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[found[0]] if found else None


class ConfigSection(BaseModel):
    """One ds_config section: DeepSpeed's keys as fields, each with a docstring."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        protected_namespaces=(),
    )

    auto_means_default: ClassVar[bool] = True
    """Drop ``"auto"`` values before validation (DeepSpeed does so in its pydantic sections)."""
    unknown_key_is_error: ClassVar[bool] = True
    """An unknown key fails validation; a section that tolerates them (the top level, as
    DeepSpeed does) sets this false and ``extra="allow"``, and reports them with
    ``unknown_keys()``."""

    @classmethod
    def key_spellings(cls) -> dict[str, list[str]]:
        """Field name -> the ds_config keys that set it, DeepSpeed's own spelling first."""
        return {name: _spellings(name, info) for name, info in cls.model_fields.items()}

    @classmethod
    def config_key(cls, field_name: str) -> str:
        """The ds_config key of ``field_name`` (its DeepSpeed spelling)."""
        return _spellings(field_name, cls.model_fields[field_name])[0]

    def unknown_keys(self) -> list[str]:
        """Keys a tolerant section received but does not know, each with the nearest valid
        key when one is close (``zero_optimisation (did you mean zero_optimization?)``)."""
        valid = [key for keys in self.key_spellings().values() for key in keys]
        out = []
        for key in self.model_extra or {}:
            suggestion = nearest_key(str(key), valid)
            out.append(f"{key} (did you mean {suggestion}?)" if suggestion else str(key))
        return out

    def unsupported_keys(self) -> list[str]:
        """Dotted keys set in this section (and those below) that zerolap does not implement."""
        keys: list[str] = []
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            key = self.config_key(name)
            if _marker(info) is not None:
                if name in self.model_fields_set and _is_on(value, info.default):
                    keys.append(key)
            elif isinstance(value, ConfigSection):
                keys += [f"{key}.{sub_key}" for sub_key in value.unsupported_keys()]
        return keys

    def advice(self) -> list[str]:
        """Warnings about values that load but do nothing where they are (an offload block at
        a stage that cannot use it), as dotted keys with a reason, from this section and those
        below; the engine logs them once."""
        notes = [f"{', '.join(p.keys)}: {p.message}" for p in self._advise()]
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, ConfigSection):
                key = self.config_key(name)
                notes += [f"{key}.{note}" for note in value.advice()]
        return notes

    def _advise(self) -> list[Problem]:
        """This section's warnings (sections override); keys relative to the section."""
        return []

    @classmethod
    def _rewrite_legacy(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Turn deprecated DeepSpeed spellings into current ones (sections override)."""
        return data

    def _check(self, context: Mapping[str, Any]) -> list[Problem]:
        """This section's cross-field rules (sections override). May fill in defaults that depend
        on other fields, as DeepSpeed does; writes go through ``_set_derived``."""
        return []

    def _set_derived(self, name: str, value: Any) -> None:
        # Bypasses validate_assignment, which would re-run the validators from inside them.
        self.__dict__[name] = value

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data  # pydantic reports the wrong type, naming the section
        data = dict(data)
        if cls.auto_means_default:
            data = {key: value for key, value in data.items() if not _is_auto(value)}
        data = cls._rewrite_legacy(data)
        problems = _double_spellings(cls, data)
        if cls.unknown_key_is_error:
            problems = _unknown_keys(cls, data) + problems
        if problems:
            raise problems_error(problems)
        return data

    @model_validator(mode="after")
    def _check_values(self, info: ValidationInfo) -> ConfigSection:
        problems = self._rejected_values() + self._check(info.context or {})
        if problems:
            raise problems_error(problems)
        return self

    def _rejected_values(self) -> list[Problem]:
        problems = []
        for name, info in type(self).model_fields.items():
            marker = _marker(info)
            value = getattr(self, name)
            if marker is not None and marker.reject_if is not None and marker.reject_if(value):
                message = f"got {show(value)}; zerolap does not implement this: {marker.reason}"
                problems.append(Problem((self.config_key(name),), message))
        return problems


def _spellings(name: str, info: FieldInfo) -> list[str]:
    alias = info.validation_alias
    if isinstance(alias, AliasChoices):
        return [choice for choice in alias.choices if isinstance(choice, str)]
    if isinstance(alias, str):
        return [alias]
    return [info.alias or name]


def _marker(info: FieldInfo) -> DeepSpeedOnly | None:
    return next((m for m in info.metadata if isinstance(m, DeepSpeedOnly)), None)


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _is_on(value: Any, default: Any) -> bool:
    """Whether a DeepSpeed-only value asks for something (a warning is worth printing)."""
    if value is None or value == default:
        return False
    if isinstance(value, Mapping):
        return bool(value.get("enabled")) if "enabled" in value else bool(value)
    return True


def _unknown_keys(section: type[ConfigSection], data: dict[str, Any]) -> list[Problem]:
    valid = [key for keys in section.key_spellings().values() for key in keys]
    problems = []
    for key in data:
        if key in valid:
            continue
        suggestion = nearest_key(str(key), valid)
        if suggestion:
            hint = f"did you mean {suggestion}?"
        elif len(valid) <= 12:
            hint = f"valid keys: {', '.join(valid)}"
        else:
            hint = "it is neither a DeepSpeed nor a zerolap key"
        problems.append(Problem((str(key),), f"unknown key; {hint}"))
    return problems


def _double_spellings(section: type[ConfigSection], data: dict[str, Any]) -> list[Problem]:
    problems = []
    for keys in section.key_spellings().values():
        given = tuple(key for key in keys if key in data)
        if len(given) > 1:
            problems.append(Problem(given, f"these keys set the same value; give only {keys[0]}"))
    return problems
