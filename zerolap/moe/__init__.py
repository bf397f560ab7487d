"""``deepspeed.moe``: the mixture-of-experts layer (``layer.MoE``, its gates in ``gating``; the
all-to-all that carries tokens to experts spread over ranks is
``zerolap.comm.differentiable``'s), expert parallelism's set-up and naming (``parallel``), and
the parameter helpers DeepSpeed's scripts import (``utils``).

With ``ep_size`` E above 1 each rank holds ``num_experts / E`` experts of its expert-parallel
group (``zerolap.topology``); the engine reduces and shards them over the ranks holding the same
experts.
"""

from zerolap.moe import gating, layer, parallel, utils

__all__ = ["gating", "layer", "parallel", "utils"]
