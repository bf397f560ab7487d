"""zerolap: ZeRO-sharded data-parallel training for PyTorch, DeepSpeed-compatible.

``import zerolap as deepspeed`` gives the names a DeepSpeed training script uses.
"""

from zerolap import comm
from zerolap.comm import init_distributed

__version__ = "0.1.0"

__all__ = ["__version__", "comm", "init_distributed"]
