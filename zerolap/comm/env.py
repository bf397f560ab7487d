"""Where this process sits in the job, read from the launcher's environment.

Launchers announce rank and world size in their own variables. Precedence, most specific first:
explicit arguments, torchrun (``RANK``/``WORLD_SIZE``), SLURM (``SLURM_PROCID``/``SLURM_NTASKS``),
Open MPI (``OMPI_COMM_WORLD_*``). With none of them the process is a job of one.
Everything here is pure: it reads a mapping and returns a value, so it is tested without launching.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LaunchEnv", "discover_launch_env", "first_slurm_host"]

DEFAULT_MASTER_ADDR = "127.0.0.1"


@dataclass(frozen=True)
class LaunchEnv:
    """The coordinates of this process and the rendezvous address of its job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm", "mpi", "explicit" or "single"


def _int(environ: Mapping[str, str], key: str) -> int:
    try:
        return int(environ[key])
    except ValueError as err:
        raise ValueError(f"environment variable {key}={environ[key]!r} is not an integer") from err


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as ``gpu-[003-005,9],cpu1`` (here ``gpu-003``)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"cannot read a host from SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _rendezvous(environ: Mapping[str, str], default_addr: str, port: int) -> tuple[str, int]:
    addr = environ.get("MASTER_ADDR", default_addr)
    port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else port
    return addr, port


def discover_launch_env(
    environ: Mapping[str, str],
    *,
    rank: int = -1,
    world_size: int = -1,
    distributed_port: int = 29500,
) -> LaunchEnv:
    """Read rank, world size and rendezvous address; ``rank``/``world_size`` >= 0 override."""
    local_rank = _int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else None
    if rank >= 0 and world_size > 0:
        addr, port = _rendezvous(environ, DEFAULT_MASTER_ADDR, distributed_port)
        return LaunchEnv(rank, world_size, local_rank or 0, addr, port, "explicit")
    if "RANK" in environ and "WORLD_SIZE" in environ:
        addr, port = _rendezvous(environ, DEFAULT_MASTER_ADDR, distributed_port)
        rank_, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        return LaunchEnv(rank_, world, local_rank or 0, addr, port, "torchrun")
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        host = first_slurm_host(nodelist) if nodelist else DEFAULT_MASTER_ADDR
        addr, port = _rendezvous(environ, host, distributed_port)
        local = _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0
        rank_, world = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS")
        return LaunchEnv(rank_, world, local, addr, port, "slurm")
    if "OMPI_COMM_WORLD_RANK" in environ and "OMPI_COMM_WORLD_SIZE" in environ:
        rank_, world = _int(environ, "OMPI_COMM_WORLD_RANK"), _int(environ, "OMPI_COMM_WORLD_SIZE")
        local = _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_size = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
        if "MASTER_ADDR" not in environ and local_size != world:
            raise ValueError(
                f"Open MPI job spans several nodes (OMPI_COMM_WORLD_SIZE={world}, "
                f"OMPI_COMM_WORLD_LOCAL_SIZE={local_size}): set MASTER_ADDR to rank 0's host"
            )
        addr, port = _rendezvous(environ, DEFAULT_MASTER_ADDR, distributed_port)
        return LaunchEnv(rank_, world, local, addr, port, "mpi")
    return LaunchEnv(0, 1, local_rank or 0, DEFAULT_MASTER_ADDR, distributed_port, "single")
