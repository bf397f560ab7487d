"""Looking up ``torch.optim`` optimizers and learning-rate schedulers by name, and the keyword
arguments they take, so a ds_config naming them can be checked at load."""

from __future__ import annotations

import inspect
from types import ModuleType

__all__ = ["init_arguments", "torch_classes"]


def torch_classes(module: ModuleType, base: type) -> dict[str, type]:
    """Lower-cased name -> class, for the public subclasses of ``base`` in ``module``."""
    classes = {}
    for name, value in vars(module).items():
        public = not name.startswith("_")
        if public and inspect.isclass(value) and issubclass(value, base) and value is not base:
            classes[name.lower()] = value
    return classes


def init_arguments(cls: type, *, skip: tuple[str, ...]) -> list[str] | None:
    """Names of the keyword arguments ``cls(...)`` takes, less ``skip``; None when it takes any
    (``**kwargs``)."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]  # drop self
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind is not p.VAR_POSITIONAL and p.name not in skip]
