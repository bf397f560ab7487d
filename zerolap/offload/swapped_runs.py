"""The optimizer's swapped tier: runs whose state (and fp32 master values) live in a swap file,
stepped one sub-group at a time (``offload_optimizer: {device: nvme}``).

``SwapPlan`` is what the engine hands the optimizer: which sub-groups to swap (``ratio``) and how
to build the tier. ``SwappedRuns`` is the tier: for each sub-group in turn it opens the
sub-group's buffer (``SwappedState``), *attaches* it to the inner optimizer (the master views'
memory, and a state dict whose per-element tensors are views into the buffer), lets the
optimizer step those runs, *detaches* (state written by a first step is copied into the buffer),
and closes the sub-group, which writes it back in the background.

The optimizer's per-element state tensors are found once, at construction, by stepping the
inner optimizer on a one-element stand-in parameter per param group (``probe_fields``):
their names and dtypes fix the file's layout, so its space is taken before training starts.
Per-run entries that are not per element (Adam's ``step``) stay in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from zerolap.offload.optimizer_swap import Field, OpenSubGroup, SwappedState
from zerolap.offload.swap_file import SwapError, give_back_free_heap, swap_path
from zerolap.zero.sub_groups import GroupEntries, SubGroup, last_share

__all__ = ["SwapPlan", "SwappedRuns", "probe_fields"]


def probe_fields(inner: torch.optim.Optimizer, device: torch.device) -> list[Field]:
    """The per-element state tensors ``inner`` keeps, as ``Field``s: one step on a one-element
    stand-in parameter in each param group (zero gradient), its state then dropped."""
    saved = [group["params"] for group in inner.param_groups]
    entries = GroupEntries(inner)  # the probe's steps are not the client's
    fields: dict[str, torch.dtype] = {}
    try:
        for g in range(len(inner.param_groups)):
            probe = torch.zeros(1, dtype=torch.float32, device=device, requires_grad=True)
            probe.grad = torch.zeros_like(probe)
            for h, group in enumerate(inner.param_groups):
                group["params"] = [probe] if h == g else []
            inner.step()
            for key, value in inner.state.pop(probe, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == probe.shape:
                    fields.setdefault(key, value.dtype)
    finally:
        for group, params in zip(inner.param_groups, saved, strict=True):
            group["params"] = params
        entries.restore()
    return [Field(name, dtype) for name, dtype in fields.items()]


class SwapPlan:
    """``offload_optimizer: {device: nvme}`` on one rank."""

    def __init__(
        self,
        *,
        directory: Path,
        rank: int,
        ratio: float,
        buffer_count: int,
        pipeline_read: bool,
        pipeline_write: bool,
        pin: bool,
    ) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.ratio = ratio
        self.buffer_count = buffer_count
        self.pipeline_read = pipeline_read
        self.pipeline_write = pipeline_write
        self.pin = pin

    def choose(self, sub_groups: list[SubGroup]) -> list[SubGroup]:
        """The sub-groups to swap: the last ones, holding ``ratio`` of the elements."""
        return last_share(sub_groups, self.ratio)

    def build(self, optimizer, swapped: list[SubGroup]) -> SwappedRuns:
        fields = probe_fields(optimizer.inner, optimizer.state_device)
        if optimizer.swap_master:
            fields = [Field("master", torch.float32), *fields]
        state = SwappedState(
            path=swap_path(self.directory, self.rank, "optimizer"),
            sub_groups=swapped,
            run_numels=[r.end - r.start for r in optimizer.runs],
            fields=fields,
            buffer_count=self.buffer_count,
            pipeline_read=self.pipeline_read,
            pipeline_write=self.pipeline_write,
            pin=self.pin,
        )
        return SwappedRuns(optimizer, swapped, state)


class SwappedRuns:
    def __init__(self, optimizer, sub_groups: list[SubGroup], state: SwappedState) -> None:
        self.views = optimizer.views
        self.inner = optimizer.inner
        self.mixed = optimizer.swap_master  # its values are the master field's
        self.on_host = optimizer.host is not None  # apart from the accelerator that trains
        self.sub_groups = sub_groups
        self.state = state
        self.names: dict[int, tuple[str, ...]] = {}  # run -> its per-element state fields
        self.scalars: dict[int, dict] = {}  # run -> its other state entries (kept in memory)
        self._detached = torch.empty(0, dtype=torch.float32, device=optimizer.state_device)

    # -- the step -----------------------------------------------------------------------------

    def prefetch(self) -> None:
        self.state.prefetch()

    def step(self, step_runs: Callable[[list[int]], None]) -> None:
        for _ in self.stepping(step_runs):
            pass

    def stepping(self, step_runs: Callable[[list[int]], None]) -> Iterator[SubGroup]:
        """The step, one sub-group at a time in ``sub_groups`` order: each is yielded once it
        has stepped (its write-back started), so that a caller can stop between sub-groups
        (``zero.step_behind`` steps only those the next gather needs)."""
        self.state.begin_pass()
        for position, sub_group in enumerate(self.sub_groups):
            opened = self.state.open(position)
            self._attach(opened)
            try:
                step_runs(list(sub_group.runs))
            except BaseException:
                self.state.broken = SwapError(
                    "the optimizer step failed part-way through the swapped sub-groups; the "
                    "model and its swapped state no longer agree: resume from a checkpoint"
                )
                raise
            finally:
                self._detach(opened)
            self.state.close(position, stateful=self._stateful(sub_group))
            yield sub_group
        give_back_free_heap()  # the step's temporaries, freed by now

    def _run_state(self, opened: OpenSubGroup, k: int, i: int) -> dict:
        if opened.fresh or i not in self.names:
            return {}
        fields = opened.fields[k]
        return {name: fields[name] for name in self.names[i]} | self.scalars[i]

    def _attach(self, opened: OpenSubGroup) -> None:
        for k, i in enumerate(opened.sub_group.runs):
            if self.mixed:
                self.views[i].data = opened.fields[k]["master"]
            state = self._run_state(opened, k, i)
            if state:
                self.inner.state[self.views[i]] = state

    def _detach(self, opened: OpenSubGroup) -> None:
        for k, i in enumerate(opened.sub_group.runs):
            self._keep(i, self.inner.state.pop(self.views[i], {}), opened.fields[k])
            if self.mixed:
                self.views[i].data = self._detached

    def _keep(self, i: int, state: dict, fields: dict[str, torch.Tensor]) -> None:
        """Record run ``i``'s state: per-element tensors into its fields (copied, if the
        optimizer made new ones), everything else in memory."""
        names, scalars = [], {}
        for key, value in state.items():
            field = fields.get(key) if key != "master" else None
            if field is not None and isinstance(value, torch.Tensor) and value.shape == field.shape:
                if value.data_ptr() != field.data_ptr():
                    field.copy_(value)
                names.append(key)
            else:
                scalars[key] = value
        if names or scalars:
            self.names[i], self.scalars[i] = tuple(names), scalars
        else:
            self.names.pop(i, None)
            self.scalars.pop(i, None)

    def _stateful(self, sub_group: SubGroup) -> bool:
        return any(i in self.names for i in sub_group.runs)

    # -- outside the step ---------------------------------------------------------------------

    def visit(self, write: bool, only: set[int] | None) -> Iterator[tuple[int, torch.Tensor, dict]]:
        positions = [
            p
            for p, sg in enumerate(self.sub_groups)
            if only is None or any(i in only for i in sg.runs)
        ]
        for position, opened in zip(positions, self.state.visit(positions), strict=True):
            states = [self._run_state(opened, k, i) for k, i in enumerate(opened.sub_group.runs)]
            for k, i in enumerate(opened.sub_group.runs):
                if only is None or i in only:
                    values = opened.fields[k]["master"] if self.mixed else self.views[i]
                    yield i, values, states[k]
            if write:
                for k, i in enumerate(opened.sub_group.runs):
                    self._keep(i, states[k], opened.fields[k])
                self.state.close(position, stateful=self._stateful(opened.sub_group))

    # -- accounting -----------------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Only the per-run entries kept in memory; the buffers are counted apart."""
        return sum(
            v.numel() * v.element_size()
            for scalars in self.scalars.values()
            for v in scalars.values()
            if isinstance(v, torch.Tensor)
        )

    def buffer_bytes(self) -> int:
        return self.state.buffer_bytes()

    def swapped_bytes(self) -> int:
        return self.state.file_bytes()

    def close(self) -> None:
        self.state.close_file()
