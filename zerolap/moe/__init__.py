"""``deepspeed.moe``: the mixture-of-experts layer (``layer.MoE``, its gates in ``gating``) and
the parameter-group helpers DeepSpeed's scripts import (``utils``).

Every rank holds every expert (expert-parallel size 1). Experts split over ranks would need an
all-to-all per layer, which zerolap does not have: ``MoE(ep_size > 1)`` is refused when the
layer is built, and so is an expert parameter marked with a larger size at ``initialize``
(``utils.check_expert_params``).
"""

from zerolap.moe import gating, layer, utils

__all__ = ["gating", "layer", "utils"]
