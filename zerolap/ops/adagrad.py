"""DeepSpeed's CPU Adagrad as torch's Adagrad."""

from __future__ import annotations

import torch

from zerolap.ops.adam import check_fp32

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``: torch's Adagrad (foreach kernel) with
    DeepSpeed's arguments; ``fp32_optimizer_states`` as in ``DeepSpeedCPUAdam``."""

    def __init__(
        self,
        model_params,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True): Adagrad has no AMSGrad variant")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay, foreach=True)
        self.fp32_optimizer_states = fp32_optimizer_states
        self._dtypes_checked = not fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure=None):
        check_fp32(self, "DeepSpeedCPUAdagrad")
        return super().step(closure)
