"""torch's flat-tensor collectives under whichever names this torch has.

torch 2.13 renamed them (the old names warn); older releases have only the old names.
"""

from __future__ import annotations

import torch.distributed as torch_dist

__all__ = ["all_gather_flat", "reduce_scatter_flat"]

all_gather_flat = getattr(torch_dist, "all_gather_single", None) or (
    torch_dist.all_gather_into_tensor
)
reduce_scatter_flat = getattr(torch_dist, "reduce_scatter_single", None) or (
    torch_dist.reduce_scatter_tensor
)
