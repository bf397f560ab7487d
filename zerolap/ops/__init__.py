"""``deepspeed.ops``' optimizers, as torch's own kernels (zerolap compiles no ops).

``adam.FusedAdam`` and ``adam.DeepSpeedCPUAdam`` are torch's fused Adam/AdamW, and
``adagrad.DeepSpeedCPUAdagrad`` torch's Adagrad, with DeepSpeed's argument names and defaults.
"""

from zerolap.ops import adagrad, adam

__all__ = ["adagrad", "adam"]
