"""``zerolap.zero``: ZeRO's flat buffers, buckets, reducer, sharded optimizer, and stage 3's
sharded parameters (``Init``, ``GatheredParameters``, external parameters, leaf modules)."""

from zerolap.zero import partition_parameters
from zerolap.zero.external import register_external_parameter, unregister_external_parameter
from zerolap.zero.gathered import GatheredParameters
from zerolap.zero.init import Init
from zerolap.zero.status import ParamStatus, ZeroParamStatus

__all__ = [
    "GatheredParameters",
    "Init",
    "ParamStatus",
    "ZeroParamStatus",
    "partition_parameters",
    "register_external_parameter",
    "unregister_external_parameter",
]
