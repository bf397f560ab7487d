"""The client's optimizer, re-pointed at the elements this rank owns, and the step around it.

The client's ``torch.optim`` object is kept (so schedulers bound to it keep working); its param
groups are re-pointed at *runs*: contiguous flat ranges of one group inside this rank's chunks.
With fp32 parameters a run is a view of the flat parameter buffer itself (no master copy, since
an fp32 copy of fp32 weights would only cost memory); with fp16/bf16 parameters it is a view of
an fp32 master shard.

Phases of ``step()``:
1. gather the owned gradient runs (fp32 copies under mixed precision);
2. fp16 (dynamic scale), and bf16 with ``check_grad_overflow``: any non-finite value on any
   rank skips the step (fp16 also shrinks the loss scale);
3. global norm: squares summed over owned runs, all-reduced when the optimizer is sharded;
4. unscale and clip in one multiply, then the inner optimizer steps;
5. mixed precision: the master runs are copied back into the 16-bit parameters;
6. sharded: the parameter store brings the updated chunks to every rank that needs them
   (stages 1-2: every bucket all-gathered; stage 3: only the units kept whole).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

import zerolap.comm as dist
from zerolap.zero.layout import FlatLayout

__all__ = ["ZeroOptimizer"]


def slot_groups(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[int]:
    """For each parameter, the index of the client param group holding it (-1: none)."""
    where = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    return [where.get(id(p), -1) for p in params]


class ZeroOptimizer:
    def __init__(
        self,
        inner: torch.optim.Optimizer,
        *,
        params: list[torch.nn.Parameter],
        layout: FlatLayout,
        param_store,
        grads,
        owned_ranges: list[tuple[int, int]],
        to_shard: Callable[[int, int], int],
        shard_numel: int,
        sharded: bool,
        group,
        clip: float,
        loss_scaler,
        compute_norm: bool = True,
        check_overflow: bool = False,
    ) -> None:
        self.inner = inner
        self.layout = layout
        self.store = param_store  # FlatParams (stages 0-2) or ShardedParams (stage 3)
        self.grads = grads
        self.sharded = sharded
        self.group = group
        self.clip = clip
        self.compute_norm = compute_norm  # false: no norm, so no clipping (checked at load)
        # bf16's check_grad_overflow: a non-finite gradient on any rank skips the step, as
        # dynamic fp16 scaling does (without changing a scale).
        self.check_overflow = check_overflow
        self.loss_scaler = loss_scaler
        # The client's param groups as it built them, before they are re-pointed at runs:
        # what a stage-0 DeepSpeed checkpoint's optimizer entries are numbered by.
        self.client_groups = [list(group["params"]) for group in inner.param_groups]
        groups = slot_groups(inner, params)
        self.runs = [r for r in layout.runs(owned_ranges, groups) if r.group >= 0]
        self.positions = [to_shard(r.bucket, r.start) for r in self.runs]
        self.master = self._make_master(shard_numel)
        self.reload_master()
        self.views = [
            self._param_view(r, pos) for r, pos in zip(self.runs, self.positions, strict=True)
        ]
        for g, group_dict in enumerate(inner.param_groups):
            group_dict["params"] = [
                v for v, r in zip(self.views, self.runs, strict=True) if r.group == g
            ]
        inner.state.clear()
        device = param_store.device
        # Stand-ins for a rank whose chunks hold only padding (tiny model, many ranks).
        self._true = torch.tensor(True, device=device)
        self._zero = torch.zeros((), dtype=torch.float64, device=device)
        self.last_norm: float | None = None
        self.last_applied = True
        self.overflow = False  # the last step was skipped for fp16 overflow (DeepSpeed's name)
        # Stage 3: the engine's ParamFetcher, under DeepSpeed's name for the object that
        # gathers and releases parameters (clients such as TRL reach it from the optimizer).
        self.parameter_offload = None

    def _make_master(self, shard_numel: int) -> torch.Tensor | None:
        if self.store.dtype == torch.float32:
            return None
        return torch.zeros(shard_numel, dtype=torch.float32, device=self.store.device)

    def reload_master(self) -> None:
        """Master weights := the current (16-bit) parameters, after they were replaced."""
        if self.master is None:
            return
        for run, pos in zip(self.runs, self.positions, strict=True):
            self.master[pos : pos + run.end - run.start].copy_(self.store.owned_view(run, pos))

    def _param_view(self, run, pos: int) -> torch.Tensor:
        if self.master is None:
            return self.store.owned_view(run, pos)
        return self.master[pos : pos + run.end - run.start]

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def _owned_grads(self) -> list[torch.Tensor]:
        grads = [
            self.grads.view(r.start, r.end, pos)
            for r, pos in zip(self.runs, self.positions, strict=True)
        ]
        return grads if self.master is None else [g.float() for g in grads]

    def _agree(self, value: torch.Tensor, op: str) -> float:
        """``value`` combined over the ranks that share the optimizer (one host sync)."""
        if self.sharded:
            dist.all_reduce(value, op=op, group=self.group)
        return value.item()

    def step(self) -> bool:
        """``update()`` then, when it applied, ``publish()``; False when fp16 overflow skipped
        the step."""
        applied = self.update()
        if applied:
            self.publish()
        return applied

    def update(self) -> bool:
        """Phases 1-5 (compute only): the owned elements take their step."""
        grads = self._owned_grads()
        scale = self.loss_scaler.loss_scale
        if self.loss_scaler.dynamic or self.check_overflow:
            finite = torch.stack([torch.isfinite(g).all() for g in grads] or [self._true]).all()
            if self._agree((~finite).double().reshape(1), "max") > 0:
                self.loss_scaler.update_scale(True)
                self.last_norm, self.last_applied = math.inf, False
                self.overflow = True
                return False
        self.overflow = False
        norm = self._global_norm(grads, scale) if self.compute_norm else None
        divisor = scale
        if self.clip > 0 and norm is not None and norm + 1e-6 > self.clip:
            divisor *= (norm + 1e-6) / self.clip
        for view, grad in zip(self.views, grads, strict=True):
            if divisor != 1.0:
                grad.div_(divisor)
            view.grad = grad
        self.inner.step()
        for view in self.views:
            view.grad = None
        self.loss_scaler.update_scale(False)
        self.last_norm, self.last_applied = norm, True
        self.copy_master_to_params()
        return True

    def _global_norm(self, grads: list[torch.Tensor], scale: float) -> float:
        """One fused pass over the runs; squares summed in float64 across runs and ranks."""
        norms = torch._foreach_norm(grads) if grads else [self._zero]
        squares = torch.stack([n.double() for n in norms]).pow(2).sum().reshape(1)
        return math.sqrt(self._agree(squares, "sum")) / scale

    def copy_master_to_params(self) -> None:
        """Mixed precision: the owned 16-bit parameter elements := the fp32 master's."""
        if self.master is None:
            return
        for run, pos in zip(self.runs, self.positions, strict=True):
            self.store.owned_view(run, pos).copy_(self.master[pos : pos + run.end - run.start])

    def publish(self) -> None:
        """Phase 6 (communication only): every rank receives the updated parameters."""
        self.store.publish()

    @property
    def cur_scale(self) -> float:
        """The loss scale (DeepSpeed's name; 1 unless fp16)."""
        return self.loss_scaler.loss_scale

    loss_scale = cur_scale

    def state_dict(self) -> dict:
        """This rank's optimizer state: the inner optimizer's (one entry per owned run), the
        loss scaler's, and the runs it covers. It loads back only into the same layout (same
        model, world size and stage); ``engine.save_checkpoint`` is the portable form."""
        return {
            "inner": self.inner.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "runs": [(r.start, r.end) for r in self.runs],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        runs = [(r.start, r.end) for r in self.runs]
        if [tuple(r) for r in state_dict.get("runs", [])] != runs:
            raise ValueError(
                "optimizer.load_state_dict: the state was saved for another layout (model, world "
                "size or ZeRO stage); use engine.save_checkpoint / load_checkpoint, which load "
                "across them"
            )
        self.inner.load_state_dict(state_dict["inner"])
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the engine's buffers and are cleared at each accumulation cycle."""

    def state_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for s in self.inner.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )

    def master_bytes(self) -> int:
        return 0 if self.master is None else self.master.numel() * self.master.element_size()
