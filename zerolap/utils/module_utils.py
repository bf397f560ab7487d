"""``deepspeed.utils.module_utils``: dotted-path access to submodules."""

from __future__ import annotations

import torch

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: torch.nn.Module, module_name: str):
    """``model.a.b.c`` for ``"a.b.c"``."""
    target = model
    for name in module_name.split("."):
        target = getattr(target, name)
    return target


def recursive_setattr(model: torch.nn.Module, module_name: str, module) -> None:
    """``model.a.b.c = module`` for ``"a.b.c"``."""
    *path, last = module_name.split(".")
    setattr(recursive_getattr(model, ".".join(path)) if path else model, last, module)
