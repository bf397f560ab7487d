"""DeepSpeed's backend object, ``deepspeed.comm.TorchBackend``, for the code that names it.

DeepSpeed's communication benchmark times torch's own tensor collectives through the class's
``get_all_gather_function`` / ``get_reduce_scatter_function`` as the baseline for its
``deepspeed.comm`` ones; other clients hold an instance and call the operations on it. Here an
instance joins the job as ``init_distributed`` does and answers every ``zerolap.comm`` operation
as a method, so both kinds of client run, and what they call is checked and logged like any
``zerolap.comm`` call.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as torch_dist

import zerolap.comm as dist  # the package, which re-exports every operation (and this class)
from zerolap.comm import groups

__all__ = ["TorchBackend"]


class TorchBackend:
    def __init__(
        self,
        backend: str | None = None,
        timeout: timedelta | float = groups.DEFAULT_TIMEOUT,
        init_method: str | None = None,
        rank: int = -1,
        world_size: int = -1,
        name: str = "torch",
    ) -> None:
        self.name = name
        groups.init_distributed(
            backend, timeout=timeout, init_method=init_method, rank=rank, world_size=world_size
        )

    @classmethod
    def get_all_gather_function(cls):
        """torch's all-gather into one tensor (what DeepSpeed's benchmark times raw)."""
        return torch_dist.all_gather_into_tensor

    @classmethod
    def get_reduce_scatter_function(cls):
        """torch's reduce-scatter of one tensor."""
        return torch_dist.reduce_scatter_tensor

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in dist.__all__:
            raise AttributeError(f"TorchBackend has no operation {name!r}")
        return getattr(dist, name)
