"""The client's optimizer, re-pointed at the elements this rank owns, and the step around it.

The client's ``torch.optim`` object is kept (so schedulers bound to it keep working); its param
groups are re-pointed at *runs*: contiguous flat ranges of one group inside this rank's chunks.
With fp32 parameters a run is a view of the flat parameter buffer itself (no master copy, since
an fp32 copy of fp32 weights would only cost memory), and so it is with bf16 parameters that are
their own master (``bf16.bf16_master_weights_and_grads``); with other fp16/bf16 parameters it is
a view of an fp32 master shard.

Runs are grouped into sub-groups of at most ``sub_group_size`` elements (``zero.sub_groups``),
and each sub-group belongs to one *tier*: ``ResidentRuns`` keep their values and state in
memory; with ``offload_optimizer: {device: nvme}`` the last sub-groups are ``SwappedRuns``
(``zerolap.offload``), whose state and fp32 master values are read in, stepped and written back
one sub-group at a time. On an accelerator, ``offload_optimizer`` (``cpu``, or ``nvme``) moves
the last sub-groups' master values, state and step to the host (``offload.host``): their
gradients are copied down as their buckets are reduced, and their parameters copied back up as
they step. Everything that reads or writes the per-run values and state from
outside the step (checkpoints, state dicts, ``safe_get_full_*``) goes through ``visit_runs``,
which does the same for the swapped ones.

Phases of ``step()``:
1. gather the owned gradient runs (fp32 copies under mixed precision);
2. fp16 (dynamic scale), and bf16 with ``check_grad_overflow``: any non-finite value on any
   rank skips the step (fp16 also shrinks the loss scale);
3. global norm: squares summed over owned runs, all-reduced when the optimizer is sharded,
   and under tensor parallelism over the tensor group too (pieces of split parameters count
   on every tensor rank, replicated parameters on tensor rank 0 only);
4. unscale and clip in one divide, then the inner optimizer steps, tier by tier.
   On an accelerator, with every run resident there, phases 2-4 leave their results on the
   device instead: the norm is a device tensor (read when asked for), clipping multiplies by a
   device factor, and a non-finite step is skipped by torch's fused Adam or AdamW itself (its
   ``found_inf``); ``confirm()`` reads whether it applied once the step's launches are queued,
   so the optimizer's kernels follow backward's with no host sync between them;
5. mixed precision: the master runs are copied back into the 16-bit parameters;
6. sharded: the parameter store brings the updated chunks to every rank that needs them
   (stages 1-2: every bucket all-gathered, by default left in flight for the next forward to
   wait on bucket by bucket, ``zero.in_flight``; stage 3: only the units kept whole).

With ``offload_optimizer.defer_step`` (stages 1-2, swapped sub-groups) phase 4 steps the
resident runs only, and each swapped sub-group steps in phase 6, just before the gather of the
first bucket that needs it, on the thread that runs the gathers (``zero.step_behind``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

import zerolap.accelerator as accelerator
import zerolap.comm as dist
import zerolap.offload as offload
from zerolap.offload.states import (
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
    ParkedStates,
    StatesParkedError,
    state_kinds,
)
from zerolap.offload.swap_file import SwapError, set_up_on_every_rank
from zerolap.utils.logging import logger
from zerolap.zero.layout import FlatLayout
from zerolap.zero.step_behind import Stepping, steps_apart, twin_of
from zerolap.zero.sub_groups import GroupEntries, SubGroup, split_runs

__all__ = ["STEP_PIECE_NUMEL", "ZeroOptimizer"]

STEP_PIECE_NUMEL = 1 << 18
"""The most elements a run stepped on the CPU holds (``zero.sub_groups``)."""


class _Skip:
    """A skip the device decided (``flag``: 1.0 to skip, 0-dim float32, what the fused step
    reads), and its copy on its way to the host: on a GPU a pinned copy and an event recorded
    right behind the flag, so that ``read`` waits for the flag and not for the optimizer's
    kernels queued after it."""

    def __init__(self, flag: torch.Tensor) -> None:
        self.flag = flag
        self._event = None
        if flag.device.type == "cuda":
            self._host = torch.empty((), dtype=flag.dtype, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(flag.device))
        else:
            self._host = flag

    def read(self) -> bool:
        if self._event is not None:
            self._event.synchronize()
        return bool(self._host.item())


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[int]]:
    """Indices of ``tensors`` by device (offloaded runs' gradients are on the host)."""
    out: dict[torch.device, list[int]] = {}
    for i, tensor in enumerate(tensors):
        out.setdefault(tensor.device, []).append(i)
    return out


def _check_steps_on_host(inner: torch.optim.Optimizer) -> None:
    """A client optimizer built for CUDA graphs cannot step state held in host memory."""
    for g, group in enumerate(inner.param_groups):
        if group.get("capturable"):
            raise ValueError(
                f"offload_optimizer: param group {g} of the client's {type(inner).__name__} has "
                "capturable=True (CUDA graphs), which cannot step state in host memory; build "
                "it with capturable=False"
            )


def slot_groups(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[int]:
    """For each parameter, the index of the client param group holding it (-1: none)."""
    where = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    return [where.get(id(p), -1) for p in params]


class ResidentRuns:
    """Runs whose values and optimizer state stay in memory: their views are permanent and
    their state lives in the inner optimizer's ``state``. ``on_host``: in host memory, apart
    from the accelerator that trains (``offload_optimizer`` there), stepped one sub-group of
    ``batches`` at a time so that each one's parameters go up while the next one steps."""

    def __init__(
        self,
        indices: list[int],
        views: list[torch.Tensor],
        inner,
        *,
        on_host: bool = False,
        batches: list[list[int]] | None = None,
    ) -> None:
        self.indices = indices
        self.views = views
        self.inner = inner
        self.on_host = on_host
        self.batches = batches if batches is not None else [indices]

    def prefetch(self) -> None:
        """Nothing to bring in."""

    def step(self, step_runs: Callable[[list[int]], None]) -> None:
        for batch in self.batches:
            if batch:
                step_runs(batch)

    def visit(self, write: bool, only: set[int] | None) -> Iterator[tuple[int, torch.Tensor, dict]]:
        for i in self.indices:
            if only is not None and i not in only:
                continue
            view = self.views[i]
            state = self.inner.state.get(view, {})
            yield i, view, state
            if write:  # an entry only for a run that has state (torch creates it lazily)
                if state:
                    self.inner.state[view] = state
                else:
                    self.inner.state.pop(view, None)

    def state_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for i in self.indices
            for t in self.inner.state.get(self.views[i], {}).values()
            if isinstance(t, torch.Tensor)
        )

    def buffer_bytes(self) -> int:
        return 0

    def swapped_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing outside memory."""


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
        check_finite: bool = True,
        sub_group_size: int = 1_000_000_000,
        swap=None,
        host=None,
        model_group=None,
        counted: list[bool] | None = None,
        low_precision_master: bool = False,
        defer_step: bool = False,
    ) -> None:
        # Param groups with no parameters are dropped, as DeepSpeed drops them: the Hugging
        # Face Trainer builds an empty "no decay" group for a LoRA model, and a scheduler made
        # after ``initialize`` (and its saved state) then counts the groups DeepSpeed counts.
        inner.param_groups[:] = [group for group in inner.param_groups if group["params"]]
        self.inner = inner
        self.layout = layout
        self.store = param_store  # FlatParams (stages 0-2) or ShardedParams (stage 3)
        self.grads = grads
        self.sharded = sharded
        self.group = group
        self.clip = clip
        self.compute_norm = compute_norm  # false: no norm, so no clipping (checked at load)
        # A non-finite gradient on any rank skips the step (without changing a scale; dynamic
        # fp16 scaling has its own check). Off only for bf16 with check_grad_overflow false.
        self.check_finite = check_finite
        self.loss_scaler = loss_scaler
        # Tensor and pipeline parallelism: the ranks holding the other pieces of this rank's
        # copy of the model (None without them); overflow and norm agree over them as well.
        self.model_group = model_group
        # The client's param groups as it built them, before they are re-pointed at runs:
        # what a stage-0 DeepSpeed checkpoint's optimizer entries are numbered by.
        self.client_groups = [list(group["params"]) for group in inner.param_groups]
        groups = slot_groups(inner, params)
        # Whether each parameter's squares count in the global norm on this rank: a parameter
        # held by several model ranks alike (replicated across the tensor group, or tied across
        # pipeline stages) is counted by one of them (``runtime.norm_share``).
        counted = counted if counted is not None else [True] * len(params)
        runs = [r for r in layout.runs(owned_ranges, groups, counted) if r.group >= 0]
        positions = [to_shard(r.bucket, r.start) for r in runs]
        # Stepped on the CPU, runs are cut to cache-sized pieces (``zero.sub_groups``).
        piece = STEP_PIECE_NUMEL if param_store.device.type == "cpu" else None
        self.runs, self.positions, self.sub_groups = split_runs(
            runs, positions, sub_group_size, piece
        )
        # Mixed precision steps fp32 master values with fp32 copies of the gradients; with
        # ``low_precision_master`` (bf16.bf16_master_weights_and_grads) the 16-bit parameters
        # are their own master, stepped with their 16-bit gradients, as fp32 ones are.
        self.low_precision_master = low_precision_master
        self.mixed = self.store.dtype != torch.float32 and not low_precision_master
        # What each run's squares count for in the global norm on this rank.
        self._count_all = all(r.counted for r in self.runs)
        self._norm_counted = torch.tensor(
            [r.counted for r in self.runs] or [True], device=self.store.device
        )
        # ``swap`` (offload_optimizer: nvme) decides which sub-groups live on disk; ``host``
        # (on an accelerator) moves the offloaded ones, or with ``cpu`` the last ``ratio`` of
        # them, to host memory. The rest stay where training runs, their master values (if
        # any) in one tensor.
        swapped = swap.choose(self.sub_groups) if swap is not None else []
        # Whether the ranks agree each step that their swapped state was read and written
        # whole: from the config, the same on every rank (a rank may own no swapped sub-group).
        self._swap_agreed = swap is not None
        self._swap_failed: Exception | None = None  # agreed: every rank refuses from then on
        # offload_optimizer.defer_step (``zero.step_behind``): the swapped sub-groups step as
        # the gathers after ``step()`` need them, so they are laid out in the order the next
        # forward needs their buckets (the engine asks only where the gathers can carry it).
        self.defer_step = defer_step and self._swap_agreed
        if self.defer_step:
            swapped = sorted(swapped, key=self._highest_bucket, reverse=True)
        self._highest = [self._highest_bucket(sg) for sg in swapped] if self.defer_step else []
        self._swapped = None  # the swapped tier, where this rank swaps any sub-group
        self._stepping: Stepping | None = None  # stepped by the coming publish()
        self._agreement = None  # (flag, handle, stepping) after it: whether every rank's step ran
        moved = swapped if swap is not None or host is None else host.choose(self.sub_groups)
        if host is not None and moved:
            _check_steps_on_host(inner)
        self.host = host
        self.state_device = host.host if host is not None else self.store.device
        taken = {i for sg in swapped for i in sg.runs}
        on_host = [i for sg in moved for i in sg.runs] if host is not None else []
        resident = [i for i in range(len(self.runs)) if i not in taken and i not in on_host]
        # A run steps the parameters' own elements when they are their own master (fp32, or
        # bf16 masters), in memory and where the run steps; otherwise (mixed precision;
        # parameters swapped to disk by offload_param nvme, or on the other side of an
        # accelerator from the step) it steps fp32 master values, copied into the parameters
        # after each step.
        own = not self.mixed and self.store.swap is None
        params_on_host = self.store.host is not None
        self.apart = [not own or (i in on_host) != params_on_host for i in range(len(self.runs))]
        self.master = self._make_master(resident, shard_numel if not moved else None)
        # Swapped sub-groups then keep the master values in their file.
        self.swap_master = any(self.apart[i] for i in taken)
        stepped_on_host = [i for i in on_host if i not in taken]
        self._taken = taken
        # The host master holds the runs stepped on the host apart from their parameters: the
        # last ones, a suffix of the shard positions from ``_host_base``.
        with_master = [i for i in stepped_on_host if self.apart[i]]
        self._host_runs = frozenset(with_master)
        self._host_base = self.positions[with_master[0]] if with_master else 0
        self.host_master = self._make_host_master(with_master)
        self.views = [self._value_view(i, i in taken) for i in range(len(self.runs))]
        # The offloaded runs' gradients: kept on the host by a sharded store, or else copied
        # down from where the reductions leave them (``host.gradients``).
        self.host_grads = None
        if on_host and not grads.place_on_host(self.positions[on_host[0]], host):
            self.host_grads = host.gradients(
                [(i, self.runs[i].bucket) for i in on_host],
                self._device_grad,
                grads.view(0, 0, 0).dtype,
            )
        for g, group_dict in enumerate(inner.param_groups):
            group_dict["params"] = [
                v for v, r in zip(self.views, self.runs, strict=True) if r.group == g
            ]
        inner.state.clear()
        self.tiers = [ResidentRuns(resident, self.views, inner)]
        if stepped_on_host:
            stepped = set(stepped_on_host)
            batches = [[i for i in sg.runs if i in stepped] for sg in moved]
            tier = ResidentRuns(stepped_on_host, self.views, inner, on_host=True, batches=batches)
            self.tiers.append(tier)
        if self._swap_agreed:  # every rank, a rank that swaps nothing too
            tier = set_up_on_every_rank(
                lambda: swap.build(self, swapped) if swapped else None,
                lambda failed: self._agree(
                    torch.tensor([failed], device=dist.buffer_device(group)), "max"
                ),
                dist.get_rank(),
            )
            if tier is not None:
                self.tiers.append(tier)
                self._swapped = tier
        if self.defer_step:  # the last gather's wait reports a failed step behind it
            param_store.after_settled = self.finish_step
        self.reload_master()
        device = param_store.device
        # Stand-ins for a rank whose chunks hold only padding (tiny model, many ranks).
        self._true = torch.tensor(True, device=device)
        self._zero = torch.zeros((), dtype=torch.float64, device=device)
        self._norm: float | torch.Tensor | None = None  # the last step's (see last_norm)
        # On an accelerator the step's decisions stay on the device where they can (update).
        self.on_accelerator = accelerator.runs_apart(device)
        self._skip: _Skip | None = None  # the device's decision, read by confirm()
        self.last_applied = True
        self.parked = ParkedStates()  # what offload_states() took off the device
        self._said_in_host = False  # offload_states on a CPU-only host says so once
        self.overflow = False  # the last step was skipped for fp16 overflow (DeepSpeed's name)
        # Stage 3: the engine's ParamFetcher, under DeepSpeed's name for the object that
        # gathers and releases parameters (clients such as TRL reach it from the optimizer).
        self.parameter_offload = None

    def _highest_bucket(self, sub_group: SubGroup) -> int:
        return max(self.runs[i].bucket for i in sub_group.runs)

    def _make_master(self, resident: list[int], numel: int | None) -> torch.Tensor | None:
        """The fp32 master values of the resident runs that step apart from the parameters,
        at their shard positions: the whole shard (``numel``), or with offloading the prefix
        the resident sub-groups (the first ones) span."""
        if not any(self.apart[i] for i in resident):
            return None
        if numel is None:
            ends = [self.positions[i] + self.runs[i].end - self.runs[i].start for i in resident]
            numel = max(ends, default=0)
        return torch.zeros(numel, dtype=torch.float32, device=self.store.device)

    def _make_host_master(self, runs: list[int]) -> torch.Tensor | None:
        """The fp32 master values of ``runs``, stepped in host memory."""
        if not runs:
            return None
        last = runs[-1]
        end = self.positions[last] + self.runs[last].end - self.runs[last].start
        return self.host.empty(end - self._host_base, torch.float32)

    def _value_view(self, i: int, swapped: bool) -> torch.Tensor:
        """What the inner optimizer steps for run ``i``: the parameters' own elements (fp32),
        a slice of a master (on the device, or on the host), or (swapped master) a tensor
        whose memory is attached only while its sub-group is in a buffer."""
        run, pos = self.runs[i], self.positions[i]
        if not self.apart[i]:
            return self.store.owned_view(run, pos)
        if swapped:
            return torch.empty(0, dtype=torch.float32, device=self.state_device)
        if i in self._host_runs:
            return self.host_master[
                pos - self._host_base : pos - self._host_base + run.end - run.start
            ]
        return self.master[pos : pos + run.end - run.start]

    def param_elements(self, i: int) -> torch.Tensor:
        """The parameter store's elements of run ``i`` (in the training dtype)."""
        return self.store.owned_view(self.runs[i], self.positions[i])

    def visit_runs(
        self, *, write: bool = False, only: set[int] | None = None
    ) -> Iterator[tuple[int, torch.Tensor, dict]]:
        """Every run (or those ``only`` names) as ``(index, fp32 values, optimizer state)``,
        swapped sub-groups read in for the while: the tensors are valid until the next item.
        With ``write``, what the caller changed in the values and the state (in place, or
        entries of the dict replaced) is kept."""
        self.finish_step()  # a step still running behind, done (and agreed)
        self.store.settle()  # the values of the last step's gathers, all arrived
        for tier in self.tiers:
            yield from tier.visit(write, only)

    def reload_master(self) -> None:
        """Master weights := the current (16-bit) parameters, after they were replaced."""
        apart = {i for i, a in enumerate(self.apart) if a}
        if not apart:
            return
        with torch.no_grad():
            for i, values, _ in self.visit_runs(write=True, only=apart):
                values.copy_(self.param_elements(i))

    def prefetch(self) -> None:
        """Start bringing swapped state in for the next step (it does not depend on the
        gradients, so the engine calls this as the step's last backward begins); offloaded
        gradients are copied to the host as that backward delivers them."""
        for tier in self.tiers:
            tier.prefetch()
        if self.host_grads is not None:
            self.host_grads.arm()

    def delivered(self, bucket: int) -> None:
        """The reducer delivered ``bucket``'s reduced gradients (offloaded runs copy them)."""
        if self.host_grads is not None:
            self.host_grads.delivered(bucket)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        self.finish_step()  # a step behind step() adds and removes entries meanwhile
        return self.inner.state

    def _device_grad(self, i: int) -> torch.Tensor:
        return self.grads.view(self.runs[i].start, self.runs[i].end, self.positions[i])

    def _owned_grads(self) -> list[torch.Tensor]:
        """Every run's gradient where training runs: as fp32 under mixed precision, except the
        offloaded runs' (read by the norm as they are, stepped from their host copies)."""
        moved = self.host_grads.offsets if self.host_grads is not None else ()
        grads = [self._device_grad(i) for i in range(len(self.runs))]
        if not self.mixed:
            return grads
        return [g if i in moved else g.float() for i, g in enumerate(grads)]

    def _combined(self, value: torch.Tensor, op: str) -> torch.Tensor:
        """``value`` combined in place over the ranks that share the optimizer and, under
        tensor parallelism, those holding the other pieces of the model (left on its device)."""
        if self.sharded:
            dist.all_reduce(value, op=op, group=self.group)
        if self.model_group is not None:
            dist.all_reduce(value, op=op, group=self.model_group)
        return value

    def _agree(self, value: torch.Tensor, op: str) -> float:
        """``_combined``, read on the host (one host sync)."""
        return self._combined(value, op).item()

    def step(self) -> bool:
        """``update()`` then, when it applied, ``publish()``; False when fp16 overflow skipped
        the step."""
        if self.update():
            self.publish()
        return self.confirm()

    def update(self) -> bool:
        """Phases 1-5 (compute only): the owned elements take their step (with ``defer_step``
        the resident ones; the swapped ones step in ``publish()``'s gathers)."""
        self.finish_step()
        self._skip = None
        self.grads.settle()  # places no reduction reached are zero; copies down have arrived
        self.store.settle()  # no chunk may change while the last step's gathers send it
        grads = self._owned_grads()
        scale = self.loss_scaler.loss_scale
        if self.loss_scaler.dynamic and not self._all_finite(grads):
            self.loss_scaler.update_scale(True)
            self._forget_host_grads()
            self._norm, self.last_applied = math.inf, False
            self.overflow = True
            return False
        self.overflow = False
        # On an accelerator the norm, the clipping and the skip of a non-finite step stay on
        # the device where they can (``_stays_on_device``): the step's kernels are then
        # launched while backward's still run, where a read of the norm first would have the
        # device drain and wait for the host's launches. Whether the step applied is read
        # after its launches (``confirm``). On a CPU there is nothing to overlap: the host
        # decides, with fp32 sums of squares (a float64 norm there casts every gradient first).
        decides = self.check_finite and not self.loss_scaler.dynamic  # skip when non-finite
        on_device = self.on_accelerator and self._stays_on_device(decides)
        norm: float | torch.Tensor | None = None
        if self.compute_norm:
            norm = self._device_norm(grads, scale) if on_device else self._global_norm(grads, scale)
        if decides and on_device:
            bad = ~torch.isfinite(norm) if norm is not None else None
            if bad is None:  # no norm: one one-element all-reduce of the finite flags
                bad = self._combined((~self._finite(grads)).float().reshape(1), "max")[0] > 0
            self._skip = _Skip(bad.float())  # torch's fused step skips itself by it (0-dim)
        elif decides:
            # The norm, agreed over the ranks, is inf or nan exactly when some gradient is.
            finite = math.isfinite(norm) if norm is not None else self._all_finite(grads)
            if not finite:
                self._forget_host_grads()
                self._norm, self.last_applied = norm, False
                self.overflow = True
                return False
        divisor, factor = scale, None
        if self.clip > 0 and isinstance(norm, torch.Tensor):
            # torch's clip_grad_norm_ without reading the norm: a factor of at most 1. A
            # non-finite norm leaves the gradients as they are (the host path returns before
            # clipping), so that each rank's own check later still tells where they came from.
            factor = torch.where(
                torch.isfinite(norm), (self.clip / (norm + 1e-6)).clamp(max=1.0), 1.0
            )
            factor = (factor / scale).float()
        elif self.clip > 0 and norm is not None and norm + 1e-6 > self.clip:
            divisor *= (norm + 1e-6) / self.clip
        if self.host_grads is not None:
            for i, host_grad in self.host_grads.take().items():
                grads[i] = host_grad
        if divisor != 1.0 or factor is not None:
            for on_device in _by_device(grads).values():
                some = [grads[i] for i in on_device]
                if factor is None:
                    torch._foreach_div_(some, divisor)
                else:  # on the device path every gradient is where the factor is
                    torch._foreach_mul_(some, factor)
        failure = None
        # The twin of the client optimizer the swapped sub-groups step with, taken before any
        # call: its entries are this step's, whatever a scheduler sets before they step. An
        # optimizer with step hooks, or a step of its own on the instance, steps here instead
        # (a hook may read the model, whose parameters are in flight behind step()); the
        # collectives are the same either way (``publish``), so ranks may differ in this.
        behind = self.defer_step and not steps_apart(self.inner)
        twin = twin_of(self.inner) if behind else None
        entries = GroupEntries(self.inner)
        if self._skip is not None:
            self.inner.found_inf = self._skip.flag  # read by torch's fused step (as GradScaler)
        try:
            for tier in self.tiers:
                if tier is not self._swapped or twin is None:
                    tier.step(lambda indices: self._step_runs(indices, grads, entries))
        except Exception as error:
            if not self._swap_agreed:
                raise
            failure = error
        finally:
            if self._skip is not None:
                del self.inner.found_inf
        if self.defer_step:
            steps = None
            if twin is not None and self._swapped is not None:
                # Only the swapped runs' gradients travel behind step() (under mixed precision
                # each is an fp32 copy), each dropped once its sub-group has stepped.
                pending = {i: grads[i] for sg in self._swapped.sub_groups for i in sg.runs}
                twin_entries = GroupEntries(twin)

                def step_behind(indices: list[int]) -> None:
                    self._step_runs(indices, pending, twin_entries, twin)
                    for i in indices:
                        del pending[i]

                steps = self._swapped.stepping(step_behind)
            self._stepping = Stepping(steps, self._highest, failure, in_step=twin is None)
        elif self._swap_agreed:
            self._agree_swap_step(failure)
        self.loss_scaler.update_scale(False)
        self._norm, self.last_applied = norm, True
        return True

    def _stays_on_device(self, decides: bool) -> bool:
        """Whether the norm can stay on the accelerator: nothing is offloaded to the host or
        to disk, so every run's gradient is there and steps there. When the step ``decides`` a
        skip, also whether the device can take that decision: torch's fused Adam or AdamW,
        whose step skips itself by a ``found_inf`` flag (as ``torch.amp.GradScaler`` uses it)
        and leaves a skipped first step's state at its zeros (fused SGD with momentum does
        not: its first buffers would keep whatever memory they got), with no step behind
        ``publish``. Decided from the configuration alone, so every rank decides alike (a rank
        whose chunks hold only padding has no offloaded runs of its own)."""
        resident = self.host is None and not self._swap_agreed
        if not decides:
            return resident
        skips_itself = isinstance(self.inner, (torch.optim.Adam, torch.optim.AdamW)) and getattr(
            self.inner, "_step_supports_amp_scaling", False
        )
        return resident and skips_itself and not self.defer_step

    def confirm(self) -> bool:
        """Whether the last step applied. A skip the device decided is read here, once the
        step's launches, and ``publish``'s, are queued: the host waits only for the flag, not
        for the step's kernels. A skipped step left the master and the optimizer's state as
        they were, and ``publish`` then sent the parameters unchanged."""
        skip, self._skip = self._skip, None
        if skip is not None and skip.read():
            self.last_applied, self.overflow = False, True
        return self.last_applied

    def refuse_if_failed(self) -> None:
        """Raise the swap failure the ranks agreed on, if any: every later backward and step
        is refused on every rank, a rank with nothing swapped included."""
        if self._swap_failed is not None:
            raise self._swap_failed

    def _agree_swap_step(self, failure: Exception | None) -> None:
        """Every rank learns whether any rank's swapped state failed its step (a file cut
        short, a disk error), before any rank publishes parameters: each then raises and
        refuses later steps, instead of the others stepping on and waiting in a collective the
        failed rank never joins. The model is no longer the same across ranks' shards: resume
        from the last checkpoint."""
        rank = dist.get_rank()
        failed = self._agree(
            torch.tensor([rank + 1.0 if failure is not None else 0.0], device=self._zero.device),
            "max",
        )
        if failed:
            raise self._record_swap_failure(failed, failure)

    def _record_swap_failure(self, failed: float, failure: Exception | None) -> Exception:
        """The ranks agreed that rank ``failed - 1`` (the highest that failed) failed its
        swapped step: this rank's own ``failure`` or the news of it, kept for every later use."""
        error = failure or SwapError(
            f"rank {int(failed) - 1}'s swapped optimizer state failed its step; this rank's "
            "shard stepped and the model is no longer consistent across ranks: resume from "
            "the last checkpoint"
        )
        self._swap_failed = error  # every later step raises it, on every rank alike
        for tier in self.tiers:  # and every other use of a swapped state (a checkpoint)
            if hasattr(tier, "state"):
                tier.state.broken = tier.state.broken or error
        return error

    def _forget_host_grads(self) -> None:
        """A skipped step: the copies down of its gradients are done with."""
        if self.host_grads is not None:
            self.host_grads.reset()

    def _finite(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Whether all of ``grads`` are finite, on the device (host parts checked there)."""
        finite = self._true
        for on_device in _by_device(grads).values():
            part = torch.stack([torch.isfinite(grads[i]).all() for i in on_device]).all()
            finite = finite & part.to(finite.device)
        return finite

    def _all_finite(self, grads: list[torch.Tensor]) -> bool:
        """Whether every rank's gradients are finite (one one-element all-reduce)."""
        return self._agree((~self._finite(grads)).double().reshape(1), "max") == 0

    def shard_finite(self) -> bool:
        """Whether this rank's own gradients are finite (no collective)."""
        return bool(self._finite(self._owned_grads()))

    def _step_runs(self, indices, grads, entries: GroupEntries, optimizer=None) -> None:
        """One call of the inner optimizer (or its twin, ``optimizer``) on runs ``indices``
        (those with a gradient: the others are skipped by every torch optimizer), then their
        16-bit parameters. A further call in the same step sees the param groups' entries as
        the first did."""
        entries.before_call()
        for i in indices:
            self.views[i].grad = grads[i]
        (optimizer or self.inner).step()
        for i in indices:
            self.views[i].grad = None
        for i in indices:
            if self.apart[i]:
                target, values = self.param_elements(i), self.views[i]
                # Up from pinned host memory without waiting (it runs while the next sub-group
                # steps): the host master is written again only after the next backward, which
                # the stream orders behind this copy. Not from a swap buffer (its I/O lane
                # refills it), nor down into host memory (the host reads it next).
                later = target.device.type != "cpu" and i not in self._taken
                target.copy_(values, non_blocking=later)

    @property
    def last_norm(self) -> float | None:
        """The last step's global gradient norm (None without ``compute_norm``), read back
        from the device on first use when the step left it there."""
        if isinstance(self._norm, torch.Tensor):
            self._norm = self._norm.item()
        return self._norm

    def _device_norm(self, grads: list[torch.Tensor], scale: float) -> torch.Tensor:
        """``_global_norm`` as a 0-dim float64 tensor on the device, with no host sync: the
        squares are summed in float64 from the start (on an accelerator torch's fused norm
        accumulates in it at fp32's memory traffic), so no fp32 overflow needs a retry."""
        return self._combined(self._squares(grads, torch.float64), "sum").sqrt()[0] / scale

    def _global_norm(self, grads: list[torch.Tensor], scale: float) -> float:
        """One fused pass over the runs; squares summed in float64 across runs and ranks. A
        replicated parameter is counted on one tensor rank, a split one on all (its pieces)."""
        total = self._agree(self._squares(grads, torch.float32), "sum")
        if not math.isfinite(total):
            # fp32 sums of squares overflow for finite gradients around 1e19: again in float64,
            # so that only a real inf or nan reads as non-finite. Every rank saw the same total,
            # so every rank takes this second all-reduce; a normal step pays nothing for it.
            total = self._agree(self._squares(grads, torch.float64), "sum")
        return math.sqrt(total) / scale

    def _squares(self, grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """This rank's weighted sum of squared run norms, computed in ``dtype``, as float64
        (one fused pass per device the gradients are on)."""
        norms = [self._zero] * max(len(grads), 1)
        for on_device in _by_device(grads).values():
            found = torch._foreach_norm([grads[i] for i in on_device], 2, dtype=dtype)
            # One copy per device, not one per run: a copy up from the host waits for the
            # device, and stage 3 offloads a run per unit.
            found = torch.stack(found).to(self._zero.device, torch.float64)
            for i, norm in zip(on_device, found.unbind(), strict=True):
                norms[i] = norm
        squares = torch.stack(norms).pow(2)
        if not self._count_all:
            # A run another rank counts adds nothing here, unless it is not finite: then it
            # must still make the norm so, to skip the step on every rank (kept as it is,
            # where multiplying an inf by 0 would report nan).
            kept = self._norm_counted | ~torch.isfinite(squares)
            squares = torch.where(kept, squares, 0.0)
        return squares.sum().reshape(1)

    def copy_master_to_params(self, only: set[int] | None = None) -> None:
        """Mixed precision: the owned 16-bit parameter elements (of runs ``only``, or all) :=
        the fp32 master's (and offloaded runs' elements := their host values)."""
        apart = {i for i, a in enumerate(self.apart) if a and (only is None or i in only)}
        if not apart:
            return
        with torch.no_grad():
            for i, values, _ in self.visit_runs(only=apart):
                self.param_elements(i).copy_(values)

    def publish(self) -> None:
        """Phase 6 (communication only): every rank receives the updated parameters. With
        ``defer_step`` the swapped sub-groups step first, each as the gather that needs it is
        about to run, and a last ring op agrees whether every rank's step ran."""
        stepping, self._stepping = self._stepping, None
        if stepping is None:
            self.store.publish()
            return
        try:
            self.store.publish(prepare=stepping.ready)
        except BaseException:
            stepping.stop()  # the gathers already queued step nothing more
            raise
        flag = torch.zeros(1, dtype=torch.float64, device=self._zero.device)
        rank = dist.get_rank()

        def fill() -> None:  # after every gather, on the ring's thread
            flag.fill_(rank + 1.0 if stepping.failure is not None else 0.0)

        handle = dist.ring_all_reduce(flag, op="max", group=self.group, async_op=True, prepare=fill)
        self._agreement = (flag, handle, stepping)
        if stepping.in_step:  # stepped inside step(): its failure is raised here, as without
            self.finish_step()

    def finish_step(self) -> None:
        """Wait for a step still running behind the last ``publish()`` (``defer_step``) and
        raise any failure the ranks agreed on: before anything reads or writes the optimizer's
        state, and before the next backward writes the gradients it steps from."""
        self.wait_behind()
        self.refuse_if_failed()

    def wait_behind(self) -> Exception | None:
        """Wait for a step still running behind the last ``publish()``; the failure the ranks
        agreed on in it, if any (kept for every later use, not raised here)."""
        pending, self._agreement = self._agreement, None
        if pending is None:
            return None
        flag, handle, stepping = pending
        try:
            handle.wait()
            failed = flag.item()
        except BaseException:
            if stepping.failure is not None:  # this rank's own failure is not lost with it
                self._record_swap_failure(dist.get_rank() + 1.0, stepping.failure)
            raise
        return self._record_swap_failure(failed, stepping.failure) if failed else None

    @property
    def cur_scale(self) -> float:
        """The loss scale (DeepSpeed's name; 1 unless fp16)."""
        return self.loss_scaler.loss_scale

    loss_scale = cur_scale

    def state_dict(self) -> dict:
        """This rank's optimizer state, as a copy: the inner optimizer's (one entry per owned
        run, swapped ones read in), the loss scaler's, and the runs it covers. It loads back
        only into the same layout (same model, world size, stage and ``sub_group_size``);
        ``engine.save_checkpoint`` is the portable form."""
        self.finish_step()
        packed = self.inner.state_dict()
        number = {id(v): k for k, v in enumerate(v for g in self.param_groups for v in g["params"])}
        state = {}
        for i, _, run_state in self.visit_runs():
            if run_state:
                state[number[id(self.views[i])]] = {
                    k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in run_state.items()
                }
        return {
            "inner": {"state": state, "param_groups": packed["param_groups"]},
            "loss_scaler": self.loss_scaler.state_dict(),
            "runs": [(r.start, r.end) for r in self.runs],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        runs = [(r.start, r.end) for r in self.runs]
        if [tuple(r) for r in state_dict.get("runs", [])] != runs:
            raise ValueError(
                "optimizer.load_state_dict: the state was saved for another layout (model, world "
                "size, ZeRO stage or sub_group_size); use engine.save_checkpoint / "
                "load_checkpoint, which load across them"
            )
        self.finish_step()
        self.inner.load_state_dict(state_dict["inner"])
        # Swapped runs' state goes to their sub-groups (resident runs' already is in place).
        for i, _, run_state in self.visit_runs(write=True):
            loaded = self.inner.state.get(self.views[i])
            if loaded is not None and loaded is not run_state:
                run_state.clear()
                run_state.update(self.inner.state.pop(self.views[i]))
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the engine's buffers and are cleared at each accumulation cycle."""

    def state_bytes(self) -> int:
        """Optimizer state held in memory where training runs (swapped sub-groups: their
        buffers; the host's share is ``host_bytes``)."""
        self.wait_behind()  # a first step behind may be adding state
        return sum(tier.state_bytes() for tier in self.tiers if not tier.on_host)

    def host_bytes(self) -> int:
        """On an accelerator with ``offload_optimizer``: the master values, optimizer state and
        gradient copies held in host memory (swap buffers are counted apart)."""
        held = sum(tier.state_bytes() for tier in self.tiers if tier.on_host)
        if self.host_master is not None:
            held += self.host_master.numel() * self.host_master.element_size()
        if self.host_grads is not None:
            held += self.host_grads.nbytes()
        return held

    # -- offload_states / reload_states (``offload.states``) ------------------------------------

    def device_states(self) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
        """The tensors of each kind ``offload_states`` moves that live where training runs."""
        kind, device = OffloadStateTypeEnum, self.store.device
        state = [
            value
            for tier in self.tiers
            if isinstance(tier, ResidentRuns) and not tier.on_host
            for i in tier.indices
            for value in self.inner.state.get(self.views[i], {}).values()
            if isinstance(value, torch.Tensor)
        ]
        found = {
            kind.lp_params: self.store.device_tensors(),
            kind.hp_params: [self.master] if self.master is not None else [],
            kind.optim_states: state,
            kind.lp_grads: self.grads.device_tensors(),
        }
        return {k: [t for t in ts if t.device == device] for k, ts in found.items()}

    def offload_states(
        self,
        include=None,
        device=OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """DeepSpeed's ``offload_states``: the kinds in ``include`` (``OffloadStateTypeEnum``;
        None: all) go to host memory until ``reload_states``. Gathers still in flight and a
        step behind are waited first; stage 3's gathered units are released."""
        device = OffloadDeviceEnum(device)
        kinds = state_kinds(include)  # every name checked before anything moves
        if device == OffloadDeviceEnum.none:
            logger.warning("offload_states: device 'none' names nowhere to go; nothing moved")
            return
        if device == OffloadDeviceEnum.nvme:
            raise ValueError(
                "offload_states: device 'nvme' is not supported (as in DeepSpeed); use 'cpu'"
            )
        if not offload.apart_from_host(self.store.device):  # looked up: tests switch it
            if not self._said_in_host:
                self._said_in_host = True
                logger.info(
                    "offload_states: training runs in host memory here (no accelerator), so "
                    "the states already are where offload_states would move them; nothing moves"
                )
            return
        self.finish_step()
        self.store.settle()
        if self.store.pinned():
            raise StatesParkedError(
                "offload_states() inside GatheredParameters: the parameters it holds gathered "
                "would be parked under it; call it after the block"
            )
        fetcher = getattr(self.store, "fetcher", None)
        if fetcher is not None:
            fetcher.release_all()
        if OffloadStateTypeEnum.contiguous_grad_buffer in kinds:
            # Scratch between steps: freed, not copied; the next reductions allocate afresh.
            self.grads.drop_buffers()
        try:
            self.parked.park(
                self.device_states(), kinds, pin_memory=pin_memory, non_blocking=non_blocking
            )
        finally:
            self._finish_moves(non_blocking)

    def reload_states(self, non_blocking: bool = False, include=None) -> None:
        """Bring back what ``offload_states`` moved (the kinds in ``include``; None: all).
        DeepSpeed's signature, ``include`` added after it (clients pass it by name)."""
        self.parked.unpark(include, non_blocking=non_blocking)
        self._finish_moves(non_blocking)

    def _finish_moves(self, non_blocking: bool) -> None:
        if self.store.device.type == "cuda":
            if not non_blocking:
                torch.cuda.synchronize(self.store.device)
            torch.cuda.empty_cache()  # the memory goes back to the device, for its next user

    def master_bytes(self) -> int:
        """fp32 master values held in memory (none for fp32 parameters)."""
        if self.master is None:
            return 0
        return self.master.numel() * self.master.element_size()

    def buffer_bytes(self) -> int:
        """Memory of the buffers swapped sub-groups pass through."""
        return sum(tier.buffer_bytes() for tier in self.tiers)

    def swapped_bytes(self) -> int:
        """Bytes of swap file holding master values and optimizer state on disk."""
        return sum(tier.swapped_bytes() for tier in self.tiers)

    def close(self) -> None:
        """Release what the tiers hold outside memory (swap files) and what the gradients
        placed on the host run (the adding thread); the optimizer is done."""
        self.store.after_settled = None
        with contextlib.suppress(Exception):  # reported by engine.destroy(), not here
            self.wait_behind()  # the swap file is still in use
        for tier in self.tiers:
            tier.close()
        self.grads.close()
