"""Stage 3: parameters a module reads without calling the module that owns them.

``nn.MultiheadAttention`` hands ``self.out_proj.weight`` to its functional form instead of
calling ``out_proj``: the owner's fetch hooks never run, so the read would find the unit
sharded and an empty tensor. Every module that owns sharded parameters gets, as its
``_parameters``, a dict that notices such reads: while a hooked module is running, reading a
parameter that is not ``AVAILABLE`` gathers its unit on the spot and registers it as used by the
running module (``zero.external``), so that from then on it is fetched, prefetched, held and
released with that module, forward and backward. A read outside every module's forward (user
code inspecting ``model.fc.weight``) gathers nothing, nor does one in the root's own code when
the root had no unit of its own to gather (``ParamFetcher.borrowing``). DeepSpeed notices these
reads the same way.
"""

from __future__ import annotations

import torch

from zerolap.zero.status import ParamStatus

__all__ = ["WatchedParameters", "owners_of", "unwatch", "watch"]


class WatchedParameters(dict):
    """A module's ``_parameters`` that has the fetcher gather what a running module borrows."""

    __slots__ = ("fetcher",)

    def __getitem__(self, key: str):
        param = dict.__getitem__(self, key)
        status = getattr(param, "ds_status", None)
        if status is not None and status is not ParamStatus.AVAILABLE and self.fetcher.borrowing():
            self.fetcher.borrow(param)
        return param


def watch(modules, fetcher) -> None:
    for module in modules:
        watched = WatchedParameters(module._parameters)
        watched.fetcher = fetcher
        module.__dict__["_parameters"] = watched


def unwatch(modules) -> None:
    for module in modules:
        if isinstance(module._parameters, WatchedParameters):
            module.__dict__["_parameters"] = dict(module._parameters)


def owners_of(root: torch.nn.Module, params) -> list[torch.nn.Module]:
    """The modules of ``root`` that register one of ``params`` directly."""
    wanted = {id(p) for p in params}
    return [m for m in root.modules() if any(id(p) in wanted for p in m.parameters(recurse=False))]
