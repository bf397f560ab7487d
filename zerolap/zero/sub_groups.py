"""``sub_group_size``: the optimizer's owned runs cut into sub-groups it steps one at a time.

A rank's optimizer addresses its owned elements as runs (``FlatLayout.runs``): contiguous shard
ranges of one param group. Sub-groups are consecutive stretches of at most ``sub_group_size``
of those elements, in run order; a run crossing a sub-group boundary is cut there, so every run
lies in exactly one sub-group. An elementwise optimizer (every ``torch.optim`` one zerolap
drives: its runs already cut parameters across ranks) computes the same values whichever way
its elements are grouped; what sub-groups decide is how much state must be in memory at once
when it is swapped (``zerolap.offload``).

DeepSpeed cuts its stage-3 sub-groups at whole parameters, so one may exceed the size; here the
bound is exact. ``sub_group_size: 0`` makes every run a sub-group of its own.

Runs may also be cut into pieces of at most ``piece_numel`` elements inside a sub-group: a
non-fused optimizer (torch's default on the CPU) runs each of its operations over one run
before the next, so a run larger than the cache makes every operation a trip to memory. On 2
CPU cores, AdamW over 21M elements took 123 ms as one run and 36 ms in runs of 2^18 (1 MiB of
fp32 each, so a parameter, its gradient and two moments stay in cache between operations;
``benchmarks/optimizer_bench.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from zerolap.zero.layout import OwnedRun

__all__ = ["GroupEntries", "SubGroup", "last_share", "split_runs"]


@dataclass(frozen=True)
class SubGroup:
    index: int
    runs: range  # indices into the split runs
    numel: int


def split_runs(
    runs: list[OwnedRun],
    positions: list[int],
    sub_group_numel: int,
    piece_numel: int | None = None,
) -> tuple[list[OwnedRun], list[int], list[SubGroup]]:
    """``runs`` (at shard ``positions``) cut at sub-group boundaries, and into pieces of at
    most ``piece_numel``: the new runs, their positions, and the sub-groups over them."""
    limit = sub_group_numel if sub_group_numel > 0 else None
    out_runs: list[OwnedRun] = []
    out_positions: list[int] = []
    bounds: list[int] = [0]  # index of each sub-group's first run, then the end
    filled = 0
    for run, pos in zip(runs, positions, strict=True):
        start = run.start
        while start < run.end:
            if limit is None:
                take = run.end - start
            else:
                if filled == limit:
                    bounds.append(len(out_runs))
                    filled = 0
                take = min(run.end - start, limit - filled)
            if piece_numel is not None:
                take = min(take, piece_numel)
            out_runs.append(replace(run, start=start, end=start + take))
            out_positions.append(pos + start - run.start)
            start += take
            filled += take
        if limit is None:
            bounds.append(len(out_runs))
    if limit is not None and out_runs:
        bounds.append(len(out_runs))
    sub_groups = []
    for index, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        numel = sum(r.end - r.start for r in out_runs[lo:hi])
        sub_groups.append(SubGroup(index, range(lo, hi), numel))
    return out_runs, out_positions, sub_groups


def last_share(sub_groups: list[SubGroup], ratio: float) -> list[SubGroup]:
    """The last sub-groups, holding ``ratio`` of the elements in whole sub-groups (what
    ``offload_optimizer.ratio`` moves off: the first ones stay and step while the moved ones
    are brought in)."""
    total = sum(sg.numel for sg in sub_groups)
    kept_numel, kept = 0, 0
    for sg in sub_groups:
        if kept_numel + sg.numel > (1.0 - ratio) * total:
            break
        kept_numel += sg.numel
        kept += 1
    return sub_groups[kept:]


class GroupEntries:
    """The client optimizer's own param-group entries (all but ``params``) as they were when
    taken, put back before each further call of its ``step()`` in one optimizer step.

    Stepped a sub-group (or a tier) at a time, the optimizer is called several times per step.
    torch's optimizers keep their counts per parameter and do not mind; one that counts in the
    group (apex's FusedAdam and optimizers like it: ``group["step"] += 1``, the step its bias
    correction uses) would count every call. Each call then starts from the entries of the
    step's start, and the last call's leave them as one call would. The entries are the same
    objects again (a tensor learning rate a scheduler holds keeps working), their values put
    back in place."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.taken = [
            {key: (value, _copy(value)) for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups
        ]
        self._called = False

    def before_call(self) -> None:
        """Before each call of ``step()`` in the step: the entries restored, but the first."""
        if self._called:
            self.restore()
        self._called = True

    def restore(self) -> None:
        for group, taken in zip(self.optimizer.param_groups, self.taken, strict=True):
            for key in [k for k in group if k != "params" and k not in taken]:
                del group[key]  # added by the call since (a first step's counter)
            for key, (value, copy) in taken.items():
                if isinstance(value, torch.Tensor):
                    value.copy_(copy)  # a count advanced in place
                group[key] = value


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value
