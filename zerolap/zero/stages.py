"""A ZeRO stage is a choice of components, made once here; nothing downstream tests the stage.

| stage | gradients kept      | bucket reduction                 | optimizer state | reduces      |
|-------|---------------------|----------------------------------|-----------------|--------------|
| 0     | full (FullGradients)| all-reduce                       | full, every rank| at boundary  |
| 1     | full (FullGradients)| reduce-scatter (or all-reduce)   | own shard       | at boundary  |
| 2     | own shard           | reduce-scatter (or all-reduce)   | own shard       | every micro  |
| 3     | own shard           | reduce-scatter (or all-reduce)   | own shard       | every micro  |

Stage 3 also shards the parameters themselves (``ShardedParams`` instead of ``FlatParams``):
each module's parameters are gathered just before it runs and released after (``zero.fetcher``).

Stages 0 and 1 accumulate micro-batches locally and reduce once per step, as DDP with
``no_sync`` does; stage 2 cannot hold the full gradient, so it reduce-scatters every micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StagePlan", "plan_stage"]


@dataclass(frozen=True)
class StagePlan:
    stage: int
    shard_gradients: bool  # ShardGradients instead of FullGradients
    reduce_scatter: bool  # ReduceScatterBuckets instead of AllReduceBuckets
    shard_optimizer: bool  # optimizer state and master weights for the own chunks only
    reduce_every_micro_batch: bool
    shard_params: bool = False  # ShardedParams + ParamFetcher instead of FlatParams


def plan_stage(stage: int, *, reduce_scatter: bool) -> StagePlan:
    if stage == 0:
        return StagePlan(0, False, False, False, False)
    if stage == 1:
        return StagePlan(1, False, reduce_scatter, True, False)
    if stage == 2:
        return StagePlan(2, True, reduce_scatter, True, True)
    if stage == 3:
        return StagePlan(3, True, reduce_scatter, True, True, shard_params=True)
    raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
