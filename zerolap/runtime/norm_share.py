"""Which rank counts which parameter in the global gradient norm.

The norm for clipping is summed over every rank holding a piece of the model (the data-parallel
shards, the tensor group, the pipeline's stages). A parameter held alike by several of them must
be counted once: one replicated across the tensor group (a norm's weight, a row-parallel bias)
is counted by tensor rank 0; one tied across pipeline stages (an embedding shared with the LM
head) by the stage holding the tie's first layer. Split pieces and a stage's own layers count
everywhere.
"""

from __future__ import annotations

import torch

from zerolap.tensor_parallel.layers import is_tensor_parallel
from zerolap.topology import Mesh

__all__ = ["counted_in_norm"]


def counted_in_norm(
    params: list[torch.nn.Parameter], mesh: Mesh, *, copies: frozenset[int] = frozenset()
) -> list[bool]:
    """Per parameter, whether this rank counts its squares. ``copies``: ids of parameters
    that are another stage's copy of a tied weight."""
    first = mesh.tensor_rank == 0
    return [(first or is_tensor_parallel(p)) and id(p) not in copies for p in params]
