"""Barriers: ``barrier``, ``monitored_barrier`` and ``check_in``.

They move no data, so their log records carry 0 bytes; they are logged all the same, because the
time a rank spends in one is time it waits for its slowest peer. ``check_in`` meets in the
rendezvous store instead of the process group, so a rank that never comes costs no mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as torch_dist

from zerolap.comm import watchdog
from zerolap.comm.checks import check_group
from zerolap.comm.collectives import Group, launch
from zerolap.comm.groups import as_timedelta
from zerolap.comm.handle import CommError, Handle
from zerolap.comm.logger import logged

__all__ = ["barrier", "check_in", "monitored_barrier"]


def barrier(group: Group = None, async_op: bool = False, device_ids: Sequence[int] | None = None):
    """Wait until every rank of ``group`` has reached this call. ``device_ids`` (NCCL only)
    names the GPUs the barrier runs on, as in torch."""
    info = check_group("barrier", group)
    extra = {} if device_ids is None else {"device_ids": list(device_ids)}
    return launch(
        "barrier",
        info,
        None,
        lambda: torch_dist.barrier(group, async_op=True, **extra),
        async_op,
    )


def monitored_barrier(
    group: Group = None, timeout: timedelta | float | None = None, wait_all_ranks: bool = False
) -> None:
    """A barrier that says which ranks failed to reach it within ``timeout`` (seconds or a
    timedelta; the group's own timeout when None).

    On gloo this is torch's ``monitored_barrier``: group rank 0 waits for every other rank and
    the ``CommError`` it raises names the first rank that did not arrive (every missing rank with
    ``wait_all_ranks``) by its *group* rank, beside the group's global ranks in group-rank order;
    the other ranks fail once rank 0 gives up. A timeout leaves the group's connections broken,
    so a job that wants to carry on watches with a group of its own. Other backends (NCCL) have
    no monitored barrier: there it falls back to a plain barrier waited on with ``timeout``,
    whose ``CommError`` names the waiting rank and the group but not the missing ranks. For a
    monitored barrier on an NCCL job, pass a gloo group made with ``new_group(backend="gloo")``.
    """
    op = "monitored_barrier"
    info = check_group(op, group)
    timeout = None if timeout is None else as_timedelta(timeout)
    with logged(op, info.size, info.device()):
        if info.backend != "gloo":
            work = torch_dist.barrier(group, async_op=True)
            Handle(work, op, info).wait(timeout)
            return
        try:
            torch_dist.monitored_barrier(group, timeout=timeout, wait_all_ranks=wait_all_ranks)
        except RuntimeError as err:
            raise CommError(f"{info.describe(op)} failed: {err}") from err


def check_in(name: str, group: Group = None) -> None:
    """The start of a call that every rank of ``group`` must make (``save_checkpoint``): returns
    once all have made it, and raises ``CheckInError`` as soon as one of them is seen waiting in
    a collective instead (``zerolap.comm.watchdog``), so that neither side waits out the
    timeout. Nothing moves through the process group; without the watchdog, nothing is
    checked."""
    info = check_group("check_in", group)
    watchdog.check_in(name, info.ranks)
