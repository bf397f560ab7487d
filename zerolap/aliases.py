"""DeepSpeed's module paths answered by zerolap's modules, for the ``deepspeed`` shim.

Most people reach DeepSpeed through clients (the Hugging Face Trainer, Accelerate, TRL) that
``import deepspeed`` and its submodules themselves. The opt-in distribution in ``compat/``
installs the import name ``deepspeed`` (with package metadata named ``deepspeed``, so version
gates pass); its ``__init__`` calls ``serve``, and from then on every ``deepspeed.X`` import is
answered from ``MODULES``:

* the answer is the zerolap module object itself, registered under both names, so module state,
  ``isinstance`` checks and monkeypatching agree whichever name a client used, and
  ``import zerolap as deepspeed`` reaches the same objects as attributes;
* a ``deepspeed.X`` path that is not in the table is a ``ModuleNotFoundError`` naming it (never
  a second copy of a zerolap file loaded under a DeepSpeed name): clients that probe optional
  features with ``try: import ...`` fall back as they would with an older DeepSpeed.

Nothing here behaves; the behaviour lives in the modules the table names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

__all__ = ["DEEPSPEED_API", "MODULES", "deepspeed_version", "link", "serve"]

DEEPSPEED_API = "0.19.8"
"""The DeepSpeed release whose interface zerolap mirrors (the shim's version starts with it)."""

MODULES: dict[str, str] = {
    "accelerator": "zerolap.accelerator",
    "checkpoint": "zerolap.checkpoint",
    "checkpoint.ds_to_universal": "zerolap.checkpoint.universal",
    "checkpoint.utils": "zerolap.checkpoint.utils",
    "checkpointing": "zerolap.checkpointing",
    "comm": "zerolap.comm",
    "compression": "zerolap.compression",
    "compression.helper": "zerolap.compression.helper",
    "inference": "zerolap.inference",
    "inference.config": "zerolap.config.inference",
    "inference.engine": "zerolap.inference.engine",
    "launcher": "zerolap.launcher",
    "launcher.runner": "zerolap.launcher.runner",
    "moe": "zerolap.moe",
    "moe.experts": "zerolap.moe.layer",
    "moe.layer": "zerolap.moe.layer",
    "moe.sharded_moe": "zerolap.moe.layer",
    "moe.utils": "zerolap.moe.utils",
    "monitor": "zerolap.monitor",
    "monitor.config": "zerolap.config.monitor",
    "monitor.monitor": "zerolap.monitor.monitor",
    "ops": "zerolap.ops",
    "ops.adagrad": "zerolap.ops.adagrad",
    "ops.adam": "zerolap.ops.adam",
    "ops.lion": "zerolap.ops.lion",
    "pipe": "zerolap.pipe",
    "profiling": "zerolap.profiling",
    "profiling.flops_profiler": "zerolap.profiling.flops",
    "runtime": "zerolap.runtime",
    "runtime.dataloader": "zerolap.utils.data",
    "runtime.engine": "zerolap.runtime.engine",
    "runtime.lr_schedules": "zerolap.runtime.lr_schedules",
    "runtime.pipe": "zerolap.pipe",
    "runtime.pipe.engine": "zerolap.pipe.engine",
    "runtime.pipe.module": "zerolap.pipe.module",
    "runtime.pipe.topology": "zerolap.topology",
    "runtime.sequence_parallel": "zerolap.sequence_parallel",
    "runtime.sequence_parallel.parallel_state_sp": "zerolap.sequence_parallel.state",
    "runtime.sequence_parallel.ulysses_sp": "zerolap.sequence_parallel",
    "runtime.utils": "zerolap.runtime.utils",
    "runtime.zero": "zerolap.zero",
    "runtime.zero.offload_config": "zerolap.offload.states",
    "runtime.zero.partition_parameters": "zerolap.zero.partition_parameters",
    "utils": "zerolap.utils",
    "utils.groups": "zerolap.runtime.groups",
    "utils.logging": "zerolap.utils.logging",
    "utils.module_utils": "zerolap.utils.module_utils",
    "utils.zero_to_fp32": "zerolap.utils.zero_to_fp32",
    "zero": "zerolap.zero",
}
"""DeepSpeed submodule path (below ``deepspeed.``) -> the zerolap module that answers it."""

_ON_IMPORT_ONLY = frozenset({"compression.helper", "utils.zero_to_fp32"})
"""Paths ``link`` leaves alone. Deprecated modules warn when imported, so only an explicit import
of them (as in DeepSpeed, which does not import them eagerly either) should warn. A module run
as a command (``python -m zerolap.utils.zero_to_fp32``) must not be imported before runpy runs
it, or Python warns; its package gives it as an attribute on first use instead."""


def deepspeed_version(zerolap_version: str) -> str:
    """The shim's version: DeepSpeed's API release, with zerolap's own as the local part
    (``0.19.8+zerolap.0.2.0``), so version gates compare against DeepSpeed's numbering and
    anyone reading it sees which DeepSpeed it is."""
    return f"{DEEPSPEED_API}+zerolap.{zerolap_version}"


class _AliasLoader(importlib.abc.Loader):
    """Returns the zerolap module as the module of the DeepSpeed name."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._own_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Creating the module stamped the alias's spec on it; the module keeps its own.
        module.__spec__ = self._own_spec

    def get_code(self, fullname: str):
        """The zerolap module's code, for ``python -m deepspeed.X`` (runpy runs it as
        ``__main__``)."""
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)


class _AliasFinder(importlib.abc.MetaPathFinder):
    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, fullname: str, path=None, target=None):
        prefix = f"{self.package}."
        if not fullname.startswith(prefix):
            return None
        zerolap_name = MODULES.get(fullname.removeprefix(prefix))
        if zerolap_name is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: this 'deepspeed' is zerolap's shim, which "
                f"provides {', '.join(f'{prefix}{name}' for name in sorted(MODULES))}",
                name=fullname,
            )
        # The zerolap file as the origin: ``python -m deepspeed.X`` puts it in ``sys.argv[0]``.
        origin = importlib.util.find_spec(zerolap_name).origin
        return importlib.util.spec_from_loader(fullname, _AliasLoader(zerolap_name), origin=origin)


def link(root: ModuleType) -> None:
    """Make every path of ``MODULES`` an attribute chain from ``root`` (``zerolap``, or the
    shim's ``deepspeed``), as DeepSpeed's eager imports make them: clients write
    ``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` after a bare ``import deepspeed``."""
    for path in sorted(MODULES.keys() - _ON_IMPORT_ONLY, key=lambda p: p.count(".")):
        parent_path, _, name = path.rpartition(".")
        parent = importlib.import_module(MODULES[parent_path]) if parent_path else root
        setattr(parent, name, importlib.import_module(MODULES[path]))


def serve(package: ModuleType) -> None:
    """Make ``package`` (the shim's ``deepspeed``) answer as DeepSpeed: zerolap's public names,
    DeepSpeed-style version attributes, and every submodule from ``MODULES``."""
    from importlib.metadata import PackageNotFoundError, version

    import zerolap

    for name in zerolap.__all__:
        setattr(package, name, getattr(zerolap, name))
    package.__all__ = list(zerolap.__all__)
    try:
        package.__version__ = version(package.__name__)
    except PackageNotFoundError:  # imported from a source tree, not installed
        package.__version__ = deepspeed_version(zerolap.__version__)
    major, minor, patch = (int(part) for part in DEEPSPEED_API.split("."))
    package.__version_major__, package.__version_minor__, package.__version_patch__ = (
        major,
        minor,
        patch,
    )
    package.__path__ = []  # no files below the shim: submodules come from the finder alone
    link(package)
    if not any(
        isinstance(f, _AliasFinder) and f.package == package.__name__ for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _AliasFinder(package.__name__))
