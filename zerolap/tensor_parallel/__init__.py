"""Tensor parallelism (seed 002): layers whose matrices are split over a tensor-parallel group.

*What* it computes lives in ``layers`` (column/row-parallel linears, the vocab-parallel
embedding) and ``cross_entropy``; *how it talks* in ``mappings`` (one collective per autograd
Function); ``plan`` turns a dense model into a split one. Which ranks form the tensor group is
``zerolap.topology``'s business.
"""

from zerolap.tensor_parallel.cross_entropy import (
    VocabParallelCrossEntropy,
    vocab_parallel_cross_entropy,
)
from zerolap.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Split,
    VocabParallelEmbedding,
    is_tensor_parallel,
)
from zerolap.tensor_parallel.mappings import (
    copy_to_region,
    gather_from_region,
    reduce_from_region,
    scatter_to_region,
)
from zerolap.tensor_parallel.plan import Rule, TPPlan, auto_plan, parallelize, preset_plan

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "Rule",
    "Split",
    "TPPlan",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "auto_plan",
    "copy_to_region",
    "gather_from_region",
    "is_tensor_parallel",
    "parallelize",
    "preset_plan",
    "reduce_from_region",
    "scatter_to_region",
    "vocab_parallel_cross_entropy",
]
