"""``zerolap.zero``: ZeRO's flat buffers, buckets, reducer, sharded optimizer, and stage 3's
sharded parameters (``Init``, ``GatheredParameters``)."""

from zerolap.zero.gathered import GatheredParameters
from zerolap.zero.init import Init
from zerolap.zero.status import ParamStatus

__all__ = ["GatheredParameters", "Init", "ParamStatus"]
