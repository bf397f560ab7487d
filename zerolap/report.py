"""``zerolap report``: what this environment offers zerolap, like DeepSpeed's ``ds_report``."""

from __future__ import annotations

import os
import platform
import sys

__all__ = ["deepspeed_status", "environment_report"]


def deepspeed_status() -> str:
    """Which ``deepspeed`` an ``import deepspeed`` reaches: zerolap's shim, a real DeepSpeed, or
    none (read from the package metadata, without importing it)."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return "none installed (zerolap's shim: pip install ./compat from zerolap's source tree)"
    try:
        dist = importlib.metadata.distribution("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return "a 'deepspeed' module without package metadata: clients will not detect it"
    where = dist.locate_file("")
    if "+zerolap" in dist.version:
        return f"zerolap's shim {dist.version} (clients that import deepspeed run on zerolap)"
    return f"real DeepSpeed {dist.version} at {where}: import deepspeed does not reach zerolap"


def environment_report() -> list[tuple[str, str]]:
    import torch
    import torch.distributed as torch_dist

    import zerolap

    rows = [
        ("zerolap", f"{zerolap.__version__} at {os.path.dirname(zerolap.__file__)}"),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", f"{torch.__version__} at {os.path.dirname(torch.__file__)}"),
        ("platform", f"{platform.platform()}, {os.cpu_count()} CPU cores"),
        ("torch threads", str(torch.get_num_threads())),
        ("distributed", "available" if torch_dist.is_available() else "NOT available"),
    ]
    for backend, check in (
        ("gloo", torch_dist.is_gloo_available),
        ("nccl", torch_dist.is_nccl_available),
        ("mpi", torch_dist.is_mpi_available),
    ):
        rows.append((f"backend {backend}", "yes" if check() else "no"))
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        rows.append(("cuda", f"{torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {names}"))
        nccl = (
            ".".join(map(str, torch.cuda.nccl.version())) if torch_dist.is_nccl_available() else "-"
        )
        rows.append(("nccl version", nccl))
    else:
        rows.append(("cuda", "not available (training runs on CPU with gloo)"))
    for package in ("pydantic", "tqdm", "psutil", "matplotlib"):
        try:
            module = __import__(package)
            rows.append((package, getattr(module, "__version__", "installed")))
        except ImportError:
            rows.append((package, "MISSING"))
    rows.append(("deepspeed import", deepspeed_status()))
    launch = [
        k for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK") if k in os.environ
    ]
    rows.append(("launcher variables", ", ".join(launch) or "none (a job of one)"))
    return rows
