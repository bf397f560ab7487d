"""``zerolap report``: what this environment offers zerolap, like DeepSpeed's ``ds_report``."""

from __future__ import annotations

import os
import platform
import sys

__all__ = ["environment_report"]


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
    launch = [
        k for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK") if k in os.environ
    ]
    rows.append(("launcher variables", ", ".join(launch) or "none (a job of one)"))
    return rows
