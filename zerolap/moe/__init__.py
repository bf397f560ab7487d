"""``deepspeed.moe``: the mixture-of-experts layer (``layer.MoE``, its gates in ``gating``), the
all-to-all that carries tokens to experts spread over ranks (``exchange``), and the parameter
helpers DeepSpeed's scripts import, with expert parallelism's set-up (``utils``).

With ``ep_size`` E above 1 each rank holds ``num_experts / E`` experts of its expert-parallel
group (``zerolap.topology``); the engine reduces and shards them over the ranks holding the same
experts.
"""

from zerolap.moe import exchange, gating, layer, parallel, utils

__all__ = ["exchange", "gating", "layer", "parallel", "utils"]
