"""Shared fixtures: rank pools reused by every multi-rank test of a session."""

from __future__ import annotations

import pytest

from tests.multiproc import RankPool


@pytest.fixture(scope="session")
def ranks():
    """``ranks(n)``: a ``RankPool`` of n gloo processes, started once per session and size."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
