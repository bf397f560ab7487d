"""``offload_states()`` / ``reload_states()``: the engine's model states taken off the accelerator
between uses and brought back, with DeepSpeed's names (``deepspeed.runtime.zero.offload_config``).

RLHF frameworks (OpenRLHF's ``deepspeed_enable_sleep`` and others) train and generate on the
same GPUs: before generation they call ``engine.optimizer.offload_states(include=[...],
device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)`` to free the trainer's memory
for the inference engine, and ``engine.reload_states()`` before training again.

How: each state's device memory is copied into host memory and its storage resized to nothing;
a reload gives the same storage its memory back and copies the bytes in. The storage objects
stay, so every view of them (parameters viewing the flat buffer, the optimizer's runs, the
gradient slots) sees the values again with nothing re-linked, and a reload is bit for bit.

The kinds, as DeepSpeed names them:

* ``lp_params``: the parameters' memory (stages 0-2: the flat buffer; stage 3: the shard and
  the units kept whole; gathered units are released first);
* ``hp_params``: the fp32 master values (mixed precision);
* ``optim_states``: the optimizer's state (Adam's moments, its step where it is a tensor);
* ``lp_grads``: the gradient storage (the flat gradient buffer, or the gradient shard);
* ``contiguous_grad_buffer``: the buckets reductions pass through (stages 2-3): scratch between
  steps, so freed rather than copied, and allocated again by the next backward.

What is already in host memory (``offload_optimizer``'s part, ``offload_param``'s shard, every
state on a CPU-only host) stays where it is. While a kind is parked the engine refuses, by
name, what needs it: forward needs ``lp_params``; backward also the gradients; ``step()`` and
checkpoints everything. With ``lp_params`` parked ``ParkedGuard`` refuses the model's own
entries too: the forward of any of its modules called directly (generation), their
``state_dict()`` and ``load_state_dict()``, stage 3's ``GatheredParameters``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import torch

__all__ = [
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
    "ParkedGuard",
    "ParkedStates",
    "StatesParkedError",
    "state_kinds",
]


class OffloadDeviceEnum(str, enum.Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


NEEDED = {  # what each engine operation reads
    "forward": {OffloadStateTypeEnum.lp_params},
    "backward": {OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads},
    "step": set(OffloadStateTypeEnum),
    "save_checkpoint": set(OffloadStateTypeEnum),
    "load_checkpoint": set(OffloadStateTypeEnum),
}


class StatesParkedError(RuntimeError):
    """An engine operation needs states that ``offload_states()`` took off the device."""


def state_kinds(include: Iterable | None) -> list[OffloadStateTypeEnum]:
    """The kinds ``include`` names (None: all), each checked."""
    if include is None:
        return list(OffloadStateTypeEnum)
    kinds = []
    for kind in include:
        try:
            kinds.append(OffloadStateTypeEnum(kind))
        except ValueError:
            names = ", ".join(k.value for k in OffloadStateTypeEnum)
            raise ValueError(
                f"offload_states: unknown state type {kind!r}; the types are {names}"
            ) from None
    return kinds


class ParkedStates:
    """The states ``offload_states()`` parked in host memory, by kind: for each storage, the
    host copy its bytes went to."""

    def __init__(self) -> None:
        self._parked: dict[OffloadStateTypeEnum, list[tuple[torch.UntypedStorage, torch.Tensor]]]
        self._parked = {}
        # Told the parked kinds after each change (the engine guards the model's own entries:
        # its forward, its state_dict, stage 3's gathers).
        self.listeners: list = []

    def _tell(self) -> None:
        for listener in self.listeners:
            listener(self.kinds)

    @property
    def kinds(self) -> set[OffloadStateTypeEnum]:
        return set(self._parked)

    @property
    def active(self) -> bool:
        """Whether anything is parked: the check every forward, backward and step makes."""
        return bool(self._parked)

    def park(
        self,
        states: dict[OffloadStateTypeEnum, list[torch.Tensor]],
        include: Iterable | None,
        *,
        pin_memory: bool,
        non_blocking: bool,
    ) -> int:
        """Move the device memory of the kinds in ``include`` (None: all) that are not parked
        yet to host memory; the bytes moved. A storage several kinds share goes with the
        first."""
        try:
            return self._park(states, include, pin_memory, non_blocking)
        finally:  # a kind parked before a failure (no host memory left) is guarded all the same
            self._tell()

    def _park(self, states, include, pin_memory: bool, non_blocking: bool) -> int:
        moved, seen = 0, set()
        for kind in state_kinds(include):
            if kind in self._parked:
                continue
            parked = []
            for tensor in states.get(kind, []):
                storage = tensor.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                pin = pin_memory and storage.device.type == "cuda"
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.untyped_storage().copy_(storage, non_blocking=non_blocking)
                parked.append((storage, host))
            # The device memory goes once every copy is queued: the allocator orders its reuse
            # after them on the stream.
            for storage, host in parked:
                storage.resize_(0)
                moved += host.numel()
            self._parked[kind] = parked
        return moved

    def unpark(self, include: Iterable | None, *, non_blocking: bool) -> int:
        """Bring the parked kinds in ``include`` (None: all) back; the bytes moved."""
        moved = 0
        for kind in state_kinds(include):
            parked = self._parked.get(kind, [])
            while parked:  # each one forgotten only once restored: a reload that runs out of
                storage, host = parked[0]  # memory leaves the rest parked, and guarded
                storage.resize_(host.numel())
                storage.copy_(host.untyped_storage(), non_blocking=non_blocking)
                moved += host.numel()
                parked.pop(0)
            self._parked.pop(kind, None)
        self._tell()
        return moved

    def forget(self) -> None:
        """Drop every host copy: the engine that owned them is gone."""
        self._parked.clear()
        self._tell()

    def parked_bytes(self) -> dict[OffloadStateTypeEnum, int]:
        return {kind: sum(h.numel() for _, h in parked) for kind, parked in self._parked.items()}

    def require(self, what: str, needs: Iterable | None = None) -> None:
        """Raise if ``what`` needs a parked kind: ``needs`` (None: every kind)."""
        if not self._parked:
            return
        missing = sorted(k.value for k in set(needs or OffloadStateTypeEnum) & self.kinds)
        if missing:
            raise StatesParkedError(
                f"{what} needs {', '.join(missing)}, which offload_states() took off the "
                "device: call engine.reload_states() first"
            )


class ParkedGuard:
    """While ``lp_params`` is parked, what reaches the parameters' memory without the engine
    is refused by name instead of failing deep in torch (or, on a GPU, reading freed memory):
    the forward of the model or of any module in it (generation calls them directly; a PEFT
    model calls its base model's), ``state_dict()`` and ``load_state_dict()`` on any of them,
    and stage 3's ``GatheredParameters`` (a store with ``refusal``). The forward hooks go
    first, before stage 3's gathers. Holds the model and the store, never the engine."""

    def __init__(self, parked: ParkedStates, module: torch.nn.Module, store) -> None:
        self.parked, self.module, self.store = parked, module, store
        self.handles: list = []
        parked.listeners.append(self.update)

    def _refuse(self, what: str) -> None:
        self.parked.require(what, {OffloadStateTypeEnum.lp_params})

    def update(self, kinds: set[OffloadStateTypeEnum]) -> None:
        parked = OffloadStateTypeEnum.lp_params in kinds
        if parked and not self.handles:
            for name, module in self.module.named_modules():
                called = f"'{name}'" if name else "the model"
                self.handles += [
                    module.register_forward_pre_hook(
                        lambda m, args, what=f"{called}'s forward": self._refuse(what),
                        prepend=True,
                    ),
                    module.register_state_dict_pre_hook(
                        lambda m, prefix, keep, what=f"{called}'s state_dict()": self._refuse(what)
                    ),
                    module.register_load_state_dict_pre_hook(
                        lambda m, *args, what=f"{called}'s load_state_dict()": self._refuse(what)
                    ),
                ]
            if hasattr(self.store, "refusal"):
                self.store.refusal = lambda: self._refuse("GatheredParameters")
        elif not parked:
            self._take_off()

    def _take_off(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if hasattr(self.store, "refusal"):
            self.store.refusal = None

    def remove(self) -> None:
        """The engine hands the model over: the hooks come off for good."""
        self._take_off()
        if self.update in self.parked.listeners:
            self.parked.listeners.remove(self.update)
