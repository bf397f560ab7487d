"""zerolap: ZeRO-sharded data-parallel training for PyTorch, DeepSpeed-compatible.

``import zerolap as deepspeed`` gives the names a DeepSpeed training script uses:
``initialize``, ``init_distributed``, ``add_config_arguments``, ``comm``, ``zero`` and
``checkpointing``.
"""

from zerolap import checkpointing, comm, zero
from zerolap.comm import init_distributed
from zerolap.config import add_config_arguments
from zerolap.runtime.engine import ZerolapEngine
from zerolap.runtime.initialize import initialize

__version__ = "0.2.0"

DeepSpeedEngine = ZerolapEngine  # the name DeepSpeed scripts use in isinstance checks

__all__ = [
    "DeepSpeedEngine",
    "ZerolapEngine",
    "__version__",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "init_distributed",
    "initialize",
    "zero",
]
