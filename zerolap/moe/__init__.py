"""``deepspeed.moe``: the parameter-group helpers DeepSpeed's scripts import (``moe.utils``).
zerolap has no mixture-of-experts layer and no expert parallelism; an expert parameter with an
expert-parallel size above 1 is refused at ``initialize`` (``moe.utils.check_expert_params``)."""

from zerolap.moe import utils

__all__ = ["utils"]
