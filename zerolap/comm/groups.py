"""Process-group lifecycle: joining the job, asking who we are, making sub-groups.

zerolap drives ``torch.distributed`` (gloo on CPU, NCCL on GPU) and keeps no transport of its own.
The one piece of state kept here is the local rank, which torch does not track.

A process group that ``init_distributed`` created is destroyed at a normal interpreter exit.
DeepSpeed's scripts rarely call ``destroy_process_group``, and a gloo group still alive when the
interpreter tears down can abort the process ("terminate called without an active exception",
exit code -6): its worker threads outlive the objects they hold. Measured on torch 2.13, two
ranks exiting with an ``async_op`` all-gather not yet waited for aborted 8 times in 8, and 3 in
6 with every op waited for; destroying the group first, 0 in 10. The destroy waits for ops still
in flight, which peers running the same program complete; it is bounded (``EXIT_RELEASE_S``) so
that a peer that never joins cannot hold the exit, and skipped after an uncaught exception, whose
process exits with an error anyway. A group the user created is the user's to destroy.

A destroyed group must also be let go of, or its C++ object (gloo's worker threads and
sockets) lives on until the interpreter tears down, where the abort above waits. Module-level
state that keeps a group (the job's mesh) forgets it when the default group is destroyed
(``on_destroy``), and identity checks hold it weakly (``world_ref``). And
``torch.distributed.nn.functional`` is imported with this module: torch imports it lazily
(building a torch optimizer does, through FSDP's modules), and its functions take
``group=group.WORLD`` as a default argument, evaluated at import; imported after
``init_process_group``, ten functions' defaults would hold the default group for the life of
the process. Importing zerolap (or the deepspeed shim) before the group is made, as scripts
do, keeps them at None; a program that makes its group and builds an optimizer before
importing zerolap keeps that group pinned, as plain torch would.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as torch_dist
import torch.distributed.nn.functional  # imported early: see above

from zerolap.comm import debug, watchdog
from zerolap.comm.env import discover_launch_env
from zerolap.utils.logging import logger

__all__ = [
    "DEFAULT_TIMEOUT",
    "destroy_process_group",
    "get_all_ranks_from_group",
    "get_backend",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "is_available",
    "is_initialized",
    "new_group",
]

DEFAULT_TIMEOUT = timedelta(minutes=10)
EXIT_RELEASE_S = 30.0

_local_rank = 0
_release_pid: int | None = None  # the process whose group init_distributed created
_released_group: weakref.ref | None = None  # that group, weakly (``world_ref``)
_release_registered = False
_on_destroy: list[Callable[[], None]] = []  # what to forget when the default group goes


def as_timedelta(timeout: timedelta | float | int) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | float = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: dict | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Join the job described by the launcher's environment (see ``zerolap.comm.env``).

    Idempotent: when ``torch.distributed`` is already initialised (by an earlier call or by the
    user's own ``init_process_group``) that group is used as it is. With no launcher variables the
    process forms a job of one, so single-process scripts run the same code.
    ``auto_mpi_discovery`` and ``dist_init_required`` exist for DeepSpeed's signature; discovery
    of Open MPI is always on and initialisation happens whenever it has not yet.
    """
    global _local_rank, _release_pid, _release_registered, _released_group
    if config is not None and "comms_logger" in config:
        from zerolap.comm.logger import configure

        configure(config["comms_logger"])
    environ = dict(os.environ)
    if not auto_mpi_discovery:
        environ = {k: v for k, v in environ.items() if not k.startswith("OMPI_")}
    launch = discover_launch_env(
        environ, rank=rank, world_size=world_size, distributed_port=distributed_port
    )
    _local_rank = launch.local_rank
    debug.configure_from_env()
    if torch_dist.is_initialized():
        if torch_dist.get_backend() == "nccl":
            # Created by the caller, who may not have chosen this rank's GPU: the engine's
            # tensors and every small buffer for NCCL go to the local rank's.
            torch.cuda.set_device(launch.local_rank)
        watchdog.start(
            torch_dist.get_rank(), torch_dist.get_world_size(), DEFAULT_TIMEOUT.total_seconds()
        )
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        if not torch.cuda.is_available():
            # Scripts written for GPUs pass it outright (DeepSpeed's pipeline example does);
            # torch would only say that NCCL is not built in, or fail in set_device.
            raise RuntimeError(
                f"init_distributed(dist_backend='nccl') on rank {launch.rank}: NCCL needs a "
                "CUDA GPU and this process sees none; pass dist_backend='gloo' or leave it "
                "unset (gloo is chosen when there is no GPU)"
            )
        torch.cuda.set_device(launch.local_rank)
    timeout = as_timedelta(timeout)
    if launch.world_size == 1 and init_method is None:
        # A job of one needs no rendezvous: an in-memory store cannot hang on a port.
        torch_dist.init_process_group(
            backend, store=torch_dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        init_method = init_method or f"tcp://{launch.master_addr}:{launch.master_port}"
        torch_dist.init_process_group(
            backend,
            init_method=init_method,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
        )
    if not _release_registered:
        atexit.register(_release_at_exit)
        _release_registered = True
    _release_pid = os.getpid()
    _released_group = world_ref()
    watchdog.start(launch.rank, launch.world_size, timeout.total_seconds())
    if verbose and launch.rank == 0:
        logger.info(
            f"zerolap.comm: {launch.world_size} rank(s) on {backend} "
            f"(launcher: {launch.launcher}, rendezvous {launch.master_addr}:{launch.master_port})"
        )


def _release_at_exit() -> None:
    """Destroy the group ``init_distributed`` created before the interpreter tears down (in
    the process that created it: a forked child that exits normally has the group's state
    but not its threads)."""
    if (
        os.getpid() != _release_pid
        or not torch_dist.is_initialized()
        or not is_world(_released_group)  # since replaced by the user's
        or getattr(sys, "last_value", None) is not None
    ):
        return
    try:
        releasing = threading.Thread(target=destroy_process_group, daemon=True)
        releasing.start()
    except RuntimeError:  # no new threads at this point of shutdown: release unbounded
        destroy_process_group()
        return
    releasing.join(EXIT_RELEASE_S)
    if releasing.is_alive():
        logger.warning(
            f"zerolap.comm: the process group still had ops in flight {EXIT_RELEASE_S:.0f} s "
            "into exit (a peer that never joined them); exiting without destroying it"
        )


def is_available() -> bool:
    """Whether this torch was built with ``torch.distributed`` (the comm package can work)."""
    return torch_dist.is_available()


def is_initialized() -> bool:
    return torch_dist.is_initialized()


def require_initialized(what: str) -> None:
    if not torch_dist.is_initialized():
        raise RuntimeError(
            f"zerolap.comm.{what} called before the process group exists: "
            "call zerolap.comm.init_distributed() first"
        )


def get_rank(group: torch_dist.ProcessGroup | None = None) -> int:
    require_initialized("get_rank")
    return torch_dist.get_rank(group)


def get_world_size(group: torch_dist.ProcessGroup | None = None) -> int:
    require_initialized("get_world_size")
    return torch_dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's index on its node (``LOCAL_RANK``, ``SLURM_LOCALID``, ...)."""
    return _local_rank


def group_ranks(group: torch_dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` in group-rank order."""
    if group is None:
        return list(range(torch_dist.get_world_size()))
    return torch_dist.get_process_group_ranks(group)


def backend_of(group: torch_dist.ProcessGroup | None) -> str:
    return str(torch_dist.get_backend(group))


def get_backend(group: torch_dist.ProcessGroup | None = None) -> str:
    require_initialized("get_backend")
    return backend_of(group)


def get_global_rank(group: torch_dist.ProcessGroup | None = None, group_rank: int = 0) -> int:
    """The global rank of ``group``'s member number ``group_rank``."""
    require_initialized("get_global_rank")
    ranks = group_ranks(group)
    if not 0 <= group_rank < len(ranks):
        raise ValueError(
            f"get_global_rank: group_rank={group_rank} is outside group ranks 0..{len(ranks) - 1}"
        )
    return ranks[group_rank]


def get_all_ranks_from_group(group: torch_dist.ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``group`` (the whole job when None), in group-rank order."""
    require_initialized("get_all_ranks_from_group")
    return group_ranks(group)


def get_world_group() -> torch_dist.ProcessGroup:
    """The process group of the whole job (torch's ``group.WORLD``), to pass or compare as
    ``group=``."""
    require_initialized("get_world_group")
    return torch_dist.group.WORLD


def new_group(ranks: list[int] | None = None, **kwargs) -> torch_dist.ProcessGroup:
    """A sub-group of ``ranks`` (global ranks); every rank of the job must call it."""
    require_initialized("new_group")
    world = torch_dist.get_world_size()
    if ranks is not None:
        bad = [r for r in ranks if not 0 <= r < world]
        if bad:
            raise ValueError(f"new_group: ranks {bad} are outside the job's ranks 0..{world - 1}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"new_group: ranks {ranks} repeat a rank")
    return torch_dist.new_group(ranks, **kwargs)


def world_ref() -> weakref.ref:
    """The default group, weakly: to tell later whether it is still the job's without keeping
    it alive (its object, and gloo's threads, must go when it is destroyed)."""
    return weakref.ref(torch_dist.group.WORLD)


def is_world(ref: weakref.ref | None) -> bool:
    """Whether ``ref`` (from ``world_ref``) is the current default group."""
    world = torch_dist.group.WORLD
    return ref is not None and world is not None and ref() is world


def on_destroy(forget: Callable[[], None]) -> None:
    """Call ``forget`` whenever the default group is destroyed (every group goes with it): a
    module that keeps groups beyond the objects that use them lets them go there."""
    _on_destroy.append(forget)


def destroy_process_group(group: torch_dist.ProcessGroup | None = None) -> None:
    global _release_pid
    from zerolap.comm.checks import forget_groups
    from zerolap.comm.ring import forget_channels

    forget_groups()
    forget_channels()
    if group is None or group is torch_dist.group.WORLD:  # torch destroys every group then
        _release_pid = None  # a group created after this one, by the user, is the user's
        watchdog.stop()
        for forget in _on_destroy:
            forget()
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group(group)
