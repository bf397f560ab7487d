"""One parameter's full fp32 value, gradient and optimizer state, wherever its shards live.

DeepSpeed's ``safe_get_full_fp32_param``, ``safe_get_full_grad``,
``safe_get_full_optimizer_state`` and their setters take only the parameter; the engine hangs a
weak reference to its ``ParamAccess`` on each trainable parameter (``param.ds_access``) so they
can find the shards.

A parameter's elements are the flat range ``[offset, offset + numel)``. Each rank holds the
optimizer runs it owns (``zero.layout``); a full value is assembled from the owned pieces into a
zero tensor and summed over the group its bucket is spread over (the data-parallel group; for
an expert spread over ranks, the ranks holding the same experts), so every element comes from
its one owner (stage 0 owns everything: no communication). The getters are collectives whenever the
optimizer is sharded, and so are the setters (the updated parameter is published to every
rank): call them on every rank, as in DeepSpeed.

Gradients are those accumulated since the last step (valid between ``backward`` and ``step``),
returned unscaled: the average over ranks of the loss's gradient, divided by the accumulation
steps as ``backward`` divides the loss.
"""

from __future__ import annotations

import weakref

import torch

import zerolap.comm as dist

__all__ = ["ParamAccess", "access_of"]


class ParamAccess:
    def __init__(self, optimizer, params: list[torch.nn.Parameter], groups: list) -> None:
        self.optimizer = optimizer
        self.groups = groups  # per bucket of the layout, the group its chunks are spread over
        self.slot_of = {id(p): slot for slot, p in enumerate(params)}
        ref = weakref.ref(self)
        for param in params:
            param.ds_access = ref

    def detach(self, params) -> None:
        for param in params:
            if hasattr(param, "ds_access"):
                del param.ds_access

    def _pieces(self, param) -> dict[int, tuple[int, int, int]]:
        """Run index -> (offset in the run, offset in the parameter, count) of each owned
        piece of ``param``."""
        layout = self.optimizer.layout
        place = layout.slots[self.slot_of[id(param)]]
        start, end = place.offset, place.offset + place.numel
        pieces = {}
        for i, run in enumerate(self.optimizer.runs):
            lo, hi = max(start, run.start), min(end, run.end)
            if lo < hi:
                pieces[i] = (lo - run.start, lo - start, hi - lo)
        return pieces

    def _assemble(self, param, pieces: dict, tensors) -> torch.Tensor | None:
        """The parameter's elements from ``tensors`` (``(run index, tensor or None)`` for the
        runs in ``pieces``), summed over the ranks that share the optimizer."""
        opt = self.optimizer
        group = self.groups[opt.layout.slots[self.slot_of[id(param)]].bucket]
        # Assembled where the group's collectives take tensors (the device under NCCL),
        # returned on the CPU.
        device = dist.buffer_device(group) if opt.sharded else torch.device("cpu")
        numel = param.ds_numel if hasattr(param, "ds_numel") else param.numel()
        out = torch.zeros(numel, device=device)
        found = False
        for i, tensor in tensors:
            if tensor is not None:
                run_at, param_at, count = pieces[i]
                out[param_at : param_at + count] = tensor[run_at : run_at + count].float()
                found = True
        if opt.sharded:
            dist.all_reduce(out, group=group)
            flag = torch.tensor([float(found)], device=device)
            dist.all_reduce(flag, op="max", group=group)
            found = flag.item() > 0
        shape = param.ds_shape if hasattr(param, "ds_shape") else param.shape
        return out.cpu().view(shape) if found else None

    def fp32_value(self, param) -> torch.Tensor:
        pieces = self._pieces(param)
        visited = self.optimizer.visit_runs(only=set(pieces))
        return self._assemble(param, pieces, ((i, values) for i, values, _ in visited))

    def grad(self, param) -> torch.Tensor | None:
        opt = self.optimizer
        opt.grads.settle()  # gradients offloaded to the host have arrived
        pieces = self._pieces(param)
        grads = (
            (i, opt.grads.view(opt.runs[i].start, opt.runs[i].end, opt.positions[i]))
            for i in pieces
        )
        full = self._assemble(param, pieces, grads)
        return None if full is None else full / opt.loss_scaler.loss_scale

    def optimizer_state(self, param, key: str) -> torch.Tensor | None:
        def per_element(value):
            return value if isinstance(value, torch.Tensor) and value.dim() == 1 else None

        pieces = self._pieces(param)
        visited = self.optimizer.visit_runs(only=set(pieces))
        return self._assemble(
            param, pieces, ((i, per_element(state.get(key))) for i, _, state in visited)
        )

    def set_fp32_value(self, param, value: torch.Tensor) -> None:
        flat = value.detach().reshape(-1)
        pieces = self._pieces(param)
        with torch.no_grad():
            for i, values, _ in self.optimizer.visit_runs(write=True, only=set(pieces)):
                run_at, param_at, count = pieces[i]
                values[run_at : run_at + count].copy_(flat[param_at : param_at + count])
        self.optimizer.copy_master_to_params(only=set(pieces))
        self.optimizer.publish()

    def set_optimizer_state(self, param, value: torch.Tensor, key: str) -> None:
        flat = value.detach().reshape(-1)
        pieces = self._pieces(param)
        with torch.no_grad():
            for i, _, state in self.optimizer.visit_runs(write=True, only=set(pieces)):
                if key not in state:
                    raise KeyError(f"optimizer state has no {key!r} (has {sorted(state)})")
                run_at, param_at, count = pieces[i]
                state[key][run_at : run_at + count].copy_(flat[param_at : param_at + count])


def access_of(param: torch.Tensor) -> ParamAccess | None:
    """The ``ParamAccess`` of the engine training ``param``, or None."""
    ref = getattr(param, "ds_access", None)
    return ref() if ref is not None else None
