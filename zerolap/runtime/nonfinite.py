"""A step whose gradients are not finite: skipped on every rank, counted, said, and after too
many in a row an error (``nonfinite_gradients``; fp16's dynamic loss scaling is the loss
scaler's business instead).

The optimizer finds it for free: the global gradient norm, agreed over the ranks for clipping,
is inf or nan. Which rank it came from costs one small all-gather, only on such a step: each rank
says whether its own losses since the last step were finite (the source, before the reduction
spread the values to every rank's shard) and whether its own gradient shard is.
"""

from __future__ import annotations

import torch

import zerolap.comm as dist
from zerolap.config.nonfinite import NonFiniteConfig
from zerolap.utils.logging import logger

__all__ = ["NonFiniteGradientError", "NonFiniteGuard"]


class NonFiniteGradientError(RuntimeError):
    """Gradients with inf or nan, when ``nonfinite_gradients`` says to stop."""


class NonFiniteGuard:
    def __init__(self, config: NonFiniteConfig) -> None:
        self.config = config
        self.consecutive = 0
        self._losses_finite: torch.Tensor | None = None  # this rank's, since the last step

    def observe_loss(self, loss: torch.Tensor) -> None:
        """A loss this rank backpropagates (kept on its device: no host sync)."""
        finite = torch.isfinite(loss.detach()).all()
        seen = self._losses_finite
        self._losses_finite = finite if seen is None else seen & finite

    def applied(self) -> None:
        self.consecutive = 0
        self._losses_finite = None

    def reset(self) -> None:
        """Gradients forgotten (``zero_grad``) or replaced (a loaded checkpoint)."""
        self.applied()

    def skipped(
        self, step: int, shard_finite: bool, total_skipped: int
    ) -> NonFiniteGradientError | None:
        """The optimizer skipped ``step`` for non-finite gradients (every rank calls this):
        say where they came from and warn; returns the error to raise once the engine has
        finished the step's bookkeeping, when ``nonfinite_gradients`` says to stop."""
        self.consecutive += 1
        losses_finite = self._losses_finite is None or bool(self._losses_finite)
        self._losses_finite = None
        flags = torch.tensor(
            [losses_finite, shard_finite], dtype=torch.float32, device=dist.buffer_device()
        )
        gathered = dist.all_gather(flags)
        by_loss = [rank for rank, f in enumerate(gathered) if f[0] == 0]
        by_shard = [rank for rank, f in enumerate(gathered) if f[1] == 0]
        if by_loss:
            origin = f"the loss of rank {by_loss[0]} was not finite"
            if len(by_loss) > 1:
                origin += f" (and of ranks {by_loss[1:]})"
        elif by_shard:
            origin = f"the gradients reduced into rank {by_shard[0]}'s shard were not finite"
        else:  # the losses were not given to engine.backward, and the shards are finite
            origin = "the global gradient norm was not finite"
        message = f"step {step}: the gradients hold inf or nan ({origin})"
        if self.config.action == "raise":
            return NonFiniteGradientError(f"{message}; nonfinite_gradients.action is raise")
        if self.consecutive >= self.config.max_consecutive_skips:
            return NonFiniteGradientError(
                f"{message}; {self.consecutive} steps in a row were skipped "
                f"(nonfinite_gradients.max_consecutive_skips={self.config.max_consecutive_skips})"
            )
        if dist.get_rank() == 0:
            logger.warning(
                f"{message}: step skipped on every rank ({total_skipped} skipped so far, "
                f"{self.consecutive} in a row)"
            )
        return None
