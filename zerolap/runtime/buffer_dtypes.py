"""Which buffers ``data_types.keep_in_fp32_modules`` keeps in fp32 when ``buffer_dtype`` casts
the others.

The names follow transformers' rule for ``_keep_in_fp32_modules``: a pattern (``*`` standing
for any run of characters) is searched in the buffer's full name, and a model's own
declarations apply under the module that declares them.
"""

from __future__ import annotations

import re

import torch

__all__ = ["fp32_buffers"]


def _declared(module: torch.nn.Module, dtype: torch.dtype) -> set[str]:
    """Patterns from the modules' ``_keep_in_fp32_modules_strict`` (and, under fp16,
    ``_keep_in_fp32_modules``), each anchored under the module declaring it."""
    patterns = set()
    for prefix, child in module.named_modules():
        names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
        if dtype == torch.float16:
            names |= set(getattr(child, "_keep_in_fp32_modules", None) or [])
        for name in names:
            pattern = name.replace("*", ".*")
            patterns.add(rf"^{re.escape(prefix)}\..*{pattern}" if prefix else pattern)
    return patterns


def fp32_buffers(
    module: torch.nn.Module, setting: list[str] | str | None, dtype: torch.dtype
) -> set[str]:
    """Full names of ``module``'s buffers to keep in fp32 when training in ``dtype``."""
    if setting is None or setting == "auto":
        patterns = _declared(module, dtype)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    if not patterns:
        return set()
    matcher = re.compile("|".join(sorted(patterns)))
    return {name for name, _ in module.named_buffers() if matcher.search(name)}
