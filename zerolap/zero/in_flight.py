"""Stages 1-2: the all-gather of updated parameters travels while the next forward computes.

After a sharded optimizer step every rank holds only its own chunks up to date; the all-gather
that brings the others back is started when ``step()`` ends and not waited there. Until a
bucket's gather is waited, its parameters are *in flight*, and two things make sure no code
ever computes with a stale chunk:

* ``ForwardWaits``: a forward pre-hook on every module that holds managed parameters waits for
  the buckets holding them, so a bucket is waited in the hook of the first module that uses one
  of its parameters, having had all the time since ``step()`` to arrive (the FSDP2 and Megatron
  scheme; DeepSpeed waits at the end of the step).
* ``InFlightParameter``: each in-flight parameter's class is swapped to this subclass, whose
  ``__torch_function__`` waits for every gather before any torch function touches its values:
  reading ``.data``, ``state_dict()``, a copy into an EMA model, printing. Metadata (shape,
  dtype, ``.grad``, ``requires_grad``, hashing) is read without waiting. Waiting restores the
  class, so a parameter in use is a plain ``nn.Parameter`` again and costs nothing more.

The engine's own readers and writers (the optimizer's next step, checkpoints, ``destroy``) call
the store's ``settle()`` first, which waits for whatever is still in flight.
"""

from __future__ import annotations

import copy
import time
import weakref
from collections.abc import Callable

import torch

__all__ = ["ForwardWaits", "InFlightParameter", "settle_params"]

# Functions that read a parameter's metadata or its gradient, never its values: called on an
# in-flight parameter without waiting (nn.Module.zero_grad, the engine's own bookkeeping).
_METADATA = {
    torch.Tensor.grad.__get__,
    torch.Tensor.grad.__set__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.is_leaf.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.__hash__,
}


class InFlightParameter(torch.nn.Parameter):
    """The class of a parameter whose bucket's all-gather has not been waited yet; the store it
    belongs to is its ``_zerolap_in_flight`` attribute."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _METADATA:
            settle_params((*args, *kwargs.values()))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo):
        """A copy (a "best model" snapshot) is taken of the arrived values, and is a plain
        parameter: nothing it belongs to is in flight."""
        settle_params((self,))  # this parameter is a plain one from here on
        return copy.deepcopy(self, memo)


def settle_params(values) -> None:
    """Wait for the gathers of every in-flight parameter among ``values`` (a flat sequence;
    lists and tuples in it are looked into one level, as torch functions take them)."""
    for value in values:
        if isinstance(value, (list, tuple)):
            settle_params([v for v in value if not isinstance(v, (list, tuple))])
        elif type(value) is InFlightParameter:
            # Another thread's wait may restore the class and drop the attribute meanwhile.
            store = getattr(value, "_zerolap_in_flight", None)
            if store is not None:
                store.settle()


class ForwardWaits:
    """Forward pre-hooks that wait for the buckets of a module's own managed parameters."""

    def __init__(
        self,
        module: torch.nn.Module,
        params: list[torch.nn.Parameter],
        bucket_of: list[int],
        store,
        *,
        record: Callable[..., None],
    ) -> None:
        """``params[i]`` lies in bucket ``bucket_of[i]`` of ``store``, whose
        ``wait_buckets(indices)`` returns whether it had to wait; ``record(phase, start, end,
        compute=False)`` hears of each wait."""
        self.store = store
        self.record = record
        where = {id(p): b for p, b in zip(params, bucket_of, strict=True)}
        self._hooks = []
        for submodule in module.modules():
            buckets = sorted(
                {where[id(p)] for p in submodule.parameters(recurse=False) if id(p) in where}
            )
            if buckets:
                hook = self._make_hook(submodule, buckets)
                self._hooks.append(submodule.register_forward_pre_hook(hook))

    def _make_hook(self, owner: torch.nn.Module, buckets: list[int]):
        owner = weakref.ref(owner)

        def hook(module, inputs) -> None:
            # A deepcopy of the model carries this hook along; the copy's parameters are its
            # own, never in flight.
            if module is not owner() or not self.store.in_flight:
                return
            start = time.perf_counter()
            if self.store.wait_buckets(buckets):
                self.record("param_wait", start, time.perf_counter(), compute=False)

        return hook

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
