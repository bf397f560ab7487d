"""Giving a model back: what an engine attached to it, taken off again.

An engine attaches hooks to the model's modules and parameters, points parameters into its
buffers, and under stage 3 keeps only a shard of each. ``engine.destroy()`` takes all of it off
and makes every parameter whole again (a collective under stage 3). An engine dropped without
``destroy()`` must not outlive its last reference, nor leave hooks that take the model's
gradients: the parts the model's hooks reach (fetcher, reducer, stores) never hold the engine,
so it dies with its last reference, and a finalizer then takes the hooks off with
``Attachments.release(gather=False)``. A finalizer runs whenever the last reference goes, at
different moments on different ranks, so it must not communicate: stage-3 parameters stay
sharded, owned by their store, as ``zero.Init`` leaves a model. ``GatheredParameters`` still
reads them, and the next ``initialize`` on the model gathers them whole (``take_over``), on
every rank at the same point of the program.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from zerolap.comm import CommError
from zerolap.offload.states import OffloadStateTypeEnum
from zerolap.utils.logging import logger
from zerolap.zero.sharded_params import ShardedParams

__all__ = ["Attachments", "take_over"]


@dataclasses.dataclass
class Attachments:
    """The engine's parts that the model reaches, each None when the engine did not build it."""

    module: torch.nn.Module
    params: list[torch.nn.Parameter]
    param_access: object | None
    optimizer: object | None
    reducer: object | None
    fetcher: object | None
    param_store: object | None
    forward_waits: object | None  # stages 1-2: the hooks that wait for parameter gathers
    # Other parts holding hooks on the model (a pipeline's deferred weight gradients), each
    # with ``remove()``; a subclass engine adds its own after construction.
    hooks: list = dataclasses.field(default_factory=list)

    def release(self, *, gather: bool) -> None:
        """Take every hook and reference off the model and free the engine's buffers.
        ``gather``: stage-3 parameters are made whole (a collective: ``destroy()``); without
        it they stay sharded, owned by their store (a finalizer)."""
        values = True  # whether the parameters hold their values (not parked and lost)
        if self.optimizer is not None and self.optimizer.parked.active:
            values = self._take_back_parameters(self.optimizer.parked)
        if self.param_access is not None:
            self.param_access.detach(self.params)
        if self.optimizer is not None:
            self.optimizer.close()  # swap files removed
        if self.reducer is not None:
            self.reducer.remove_hooks()
        if self.forward_waits is not None:
            self.forward_waits.remove()
        for owner in self.hooks:
            owner.remove()
        self.hooks = []
        if self.fetcher is not None:
            self.fetcher.remove_hooks()
            self.fetcher.unwatch()
            self.param_store.fetcher = None
            self.param_store.after_write_back.clear()  # the optimizer's: it would outlive us
            if gather:
                # Every unit back to its shard first, as a finalizer leaves them, so that
                # ``unshard_all`` gathers the same units whichever way an engine went.
                self.param_store.release_orphaned()
                self.param_store.unshard_all()
            else:
                # A gather still in flight is waited for; one that failed (a rank died) was
                # or will be reported by the collectives around it, not by a finalizer.
                with contextlib.suppress(CommError):
                    self.param_store.release_orphaned()
        elif self.param_store is not None:
            # As above: a finalizer does not report a failed gather; its parameters stay
            # guarded (in flight), so reading them raises the error instead.
            with contextlib.suppress(CommError) if not gather else contextlib.nullcontext():
                if values:
                    self.param_store.detach_params()
        for param in self.module.parameters():
            param.grad = None
        self.module.__dict__.pop("_zerolap_engine", None)
        self.params = []
        self.param_access = self.optimizer = self.reducer = self.fetcher = None
        self.param_store = self.forward_waits = None

    @staticmethod
    def _take_back_parameters(parked) -> bool:
        """offload_states() parked some state: the parameters' memory comes back (the model
        is handed over with it; ``destroy()`` brought it back already, or raised); the rest
        was the engine's and is dropped. A finalizer's reload that fails (no device memory)
        is reported and the model left without its values, rather than with the engine's
        hooks. Whether the parameters hold their values."""
        try:
            parked.unpark([OffloadStateTypeEnum.lp_params], non_blocking=False)
            return True
        except Exception as error:
            logger.warning(
                f"the model's parameters, parked by offload_states(), could not be brought "
                f"back as the engine let go of the model ({error}); they are left empty"
            )
            return False
        finally:
            parked.forget()


def take_over(module: torch.nn.Module) -> None:
    """Before ``initialize`` wraps ``module``: a live engine still wrapping it (an RLHF trainer
    wraps its policy once for inference, then for training) is destroyed, and parameters left
    sharded by an engine dropped without ``destroy()`` are gathered whole. Both release every
    unit and then gather each, in order, so ranks that differ in which case they are in (a
    reference to the old engine kept on one rank only) still issue the same gathers."""
    ref = getattr(module, "_zerolap_engine", None)
    previous = ref() if ref is not None else None
    if previous is not None and previous.module is module and not previous.destroyed:
        logger.info("initialize(): the model was wrapped by another engine; destroying that one")
        previous.destroy()
    stores = {}
    for param in module.parameters():
        owner = getattr(param, "ds_owner", None)
        if isinstance(owner, ShardedParams) and owner.fetcher is None:  # no engine drives it
            stores.setdefault(id(owner), owner)
    if stores:
        logger.info(
            "initialize(): the model is still sharded by an engine dropped without destroy(); "
            "gathering its parameters"
        )
    for store in stores.values():
        store.unshard_all()
