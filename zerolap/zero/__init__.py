"""``zerolap.zero``: ZeRO's flat buffers, buckets, reducer and sharded optimizer."""

from zerolap.zero.gathered import GatheredParameters

__all__ = ["GatheredParameters"]
