"""``ConfigError`` and the one readable message built from every problem found in a ds_config.

Pydantic reports each problem with a location (``("zero_optimization", "stage")``), the value it
received and a message. Our own rules (unknown keys, cross-field rules, values zerolap cannot
honour) raise a ``PydanticCustomError`` of type ``PROBLEMS`` carrying a list of ``Problem``, each
naming its keys relative to the section that found it, so the final message can print full dotted
keys for those too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

__all__ = [
    "AUTO_HINT",
    "PROBLEMS",
    "ConfigError",
    "Problem",
    "format_validation_error",
    "problems_error",
    "show",
]

PROBLEMS = "zerolap_config"
"""The pydantic error type of problems found by zerolap's own rules."""

AUTO_HINT = "'auto' is a placeholder that the Hugging Face Trainer fills in; give a value"
"""Said wherever ``"auto"`` reaches a value zerolap needs."""


class ConfigError(ValueError):
    """A ds_config that zerolap cannot run, found before training starts."""


class Problem(NamedTuple):
    """One problem found by a section's own rules."""

    keys: tuple[str, ...]
    """The dotted keys involved, relative to the section (empty: the section itself)."""
    message: str
    """What is wrong and what is allowed."""


def problems_error(problems: list[Problem]) -> PydanticCustomError:
    """The error a section's validator raises for ``problems`` (keys relative to the section)."""
    summary = "; ".join(f"{', '.join(p.keys) or 'section'}: {p.message}" for p in problems)
    return PydanticCustomError(PROBLEMS, summary, {"problems": problems})


def format_validation_error(error: ValidationError, *, source: str = "ds_config") -> str:
    """Every problem in ``error`` on its own line, each led by its dotted key."""
    lines: list[str] = []
    for entry in error.errors(include_url=False):
        prefix = _dotted(entry["loc"])
        if entry["type"] == PROBLEMS:
            for problem in entry["ctx"]["problems"]:
                keys = ", ".join(_join(prefix, key) for key in problem.keys)
                lines.append(f"{keys or prefix or '(top level)'}: {problem.message}")
        elif entry["type"] == "missing":
            lines.append(f"{prefix}: required key is missing")
        else:
            lines.append(f"{prefix or '(top level)'}: {_describe(entry)}")
    count = f"{len(lines)} problem" + ("s" if len(lines) > 1 else "")
    return f"{source} is invalid ({count}):\n" + "\n".join(f"  - {line}" for line in lines)


def show(value: Any, limit: int = 80) -> str:
    """``value`` as it would read in JSON-ish form, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(entry: dict[str, Any]) -> str:
    message = entry["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    value = entry["input"]
    text = f"got {show(value)}; {message}"
    return f"{text} ({AUTO_HINT})" if value == "auto" else text


def _dotted(loc: tuple[str | int, ...]) -> str:
    text = ""
    for part in loc:
        text = text + f"[{part}]" if isinstance(part, int) else _join(text, part)
    return text


def _join(prefix: str, key: str) -> str:
    if not prefix:
        return key
    return f"{prefix}.{key}" if key else prefix
