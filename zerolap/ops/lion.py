"""DeepSpeed's Lion classes (``deepspeed.ops.lion``): the Lion update (Chen et al. 2023,
"Symbolic Discovery of Optimization Algorithms") written with torch's kernels.

For each element, with gradient g and momentum m (``exp_avg``, zero at first):

    c = beta1 m + (1 - beta1) g
    p = p (1 - lr weight_decay) - lr sign(c)
    m = beta2 m + (1 - beta2) g

DeepSpeed's kernels compute the same, but move an element whose ``c`` is exactly zero by lr
as well (its CUDA kernel by +lr, its CPU kernel by -lr): a parameter that never had a gradient
(an embedding row no batch used) drifts by lr every step. Here ``sign(0) = 0`` leaves it
where it is, as the paper's update does. Only ``exp_avg`` is kept (DeepSpeed's CPU Lion also
allocates an unused ``exp_avg_sq``, a second copy of the parameters' size).
"""

from __future__ import annotations

import torch

from zerolap.ops.adam import check_fp32

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class FusedLion(torch.optim.Optimizer):
    """``deepspeed.ops.lion.FusedLion`` (what a ds_config's ``"type": "Lion"`` builds):
    Lion with decoupled weight decay; ``set_grad_none`` as in ``FusedAdam``."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Lion: lr must be at least 0, got {lr}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Lion: betas must lie in [0, 1), got {tuple(betas)}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})
        self.set_grad_none = set_grad_none
        self._scratches: dict = {}  # (device, dtype) -> scratch for the directions

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, weight_decay = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                grad, momentum = p.grad, state["exp_avg"]
                # One tensor at a time through one reused buffer: torch's foreach ops would
                # allocate the directions of the whole group each step, 3x slower on the CPU
                # (as the engine steps, in cache-sized pieces). lerp(g, m, beta1) is
                # beta1 m + (1 - beta1) g in one pass.
                direction = torch.lerp(grad, momentum, beta1, out=self._scratch(momentum))
                direction.sign_()
                if weight_decay != 0:
                    p.mul_(1 - lr * weight_decay)
                p.add_(direction, alpha=-lr)
                momentum.lerp_(grad, 1 - beta2)
        return loss

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A buffer shaped like ``like`` (same device and dtype), kept between steps; the
        largest tensor's size, not state (it is never saved)."""
        key = (like.device, like.dtype)
        buffer = self._scratches.get(key)
        if buffer is None or buffer.numel() < like.numel():
            buffer = self._scratches[key] = torch.empty(
                like.numel(), device=like.device, dtype=like.dtype
            )
        return buffer[: like.numel()].view(like.shape)


class DeepSpeedCPULion(FusedLion):
    """``deepspeed.ops.lion.DeepSpeedCPULion``: the same update on whatever device the
    parameters are (with optimizer offload, the host). ``fp32_optimizer_states=True`` (the
    default) promises an fp32 momentum, checked as in ``DeepSpeedCPUAdam``."""

    def __init__(
        self,
        model_params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states
        self._dtypes_checked = not fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure=None):
        check_fp32(self, "DeepSpeedCPULion")
        return super().step(closure)
