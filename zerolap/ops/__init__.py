"""``deepspeed.ops``' optimizers, as torch's own kernels (zerolap compiles no ops).

``adam.FusedAdam`` and ``adam.DeepSpeedCPUAdam`` are torch's fused Adam/AdamW,
``adagrad.DeepSpeedCPUAdagrad`` torch's Adagrad, and ``lion.FusedLion`` /
``lion.DeepSpeedCPULion`` Lion on torch's foreach kernels, with DeepSpeed's argument names and
defaults.
"""

from zerolap.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
