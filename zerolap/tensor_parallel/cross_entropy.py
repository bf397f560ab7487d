"""Cross-entropy over logits whose vocabulary is split over the tensor group: the logits are
never gathered (at a 50k vocabulary they are the largest activation of a language model).

For each token, with rank t holding logits ``z[:, V_t]``:

    m   = max over ranks of max(z[V_t])             all-reduce (max), N floats
    s   = sum over ranks of sum(exp(z[V_t] - m))    \\ one all-reduce (sum) of 2N floats
    z_y = the target's logit, from the rank holding it  /
    loss = log(s) - (z_y - m)

and the gradient is ``softmax(z)[V_t] - onehot(y)[V_t]``, computed locally from what forward
kept. Tokens equal to ``ignore_index`` count for nothing; the loss is their mean over the rest,
as ``torch.nn.functional.cross_entropy`` gives (so nan, with zero gradients, when every token is
ignored).
"""

from __future__ import annotations

import torch
from torch import nn

import zerolap.comm as dist
from zerolap.comm import ReduceOp
from zerolap.tensor_parallel.mappings import FORWARD, all_reduce_now

__all__ = ["VocabParallelCrossEntropy", "vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        rows = logits.shape[-1]
        start = dist.get_rank(group) * rows
        ctx.dtype = logits.dtype
        logits = logits.float()
        top = logits.max(dim=-1).values
        all_reduce_now(top, group, name=FORWARD, op=ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        valid = targets != ignore_index
        outside = (targets < start) | (targets >= start + rows) | ~valid
        local = (targets - start).masked_fill(outside, 0)
        exp = shifted.exp()
        sums = torch.stack(
            [exp.sum(dim=-1), shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * ~outside]
        )
        all_reduce_now(sums, group, name=FORWARD)
        total, target_logit = sums
        count = valid.sum()
        losses = (total.log() - target_logit) * valid
        exp.div_(total.unsqueeze(-1))  # softmax over the whole vocabulary, this rank's columns
        ctx.save_for_backward(exp, local, outside, valid, count)
        return losses.sum() / count  # nan when every token is ignored, as torch gives

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside, valid, count = ctx.saved_tensors
        grad_logits = softmax.clone()
        hit = (~outside).to(softmax.dtype)
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        scale = grad * valid.to(softmax.dtype) / count.clamp(min=1)
        grad_logits.mul_(scale.unsqueeze(-1))
        return grad_logits.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group, *, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy of ``targets`` (N,) under ``logits`` (N, V/T), this rank's columns of
    the vocabulary (rank t holds columns ``t*V/T .. (t+1)*V/T``); returns an fp32 scalar equal
    on every rank of ``group``. The logits' gradient has their dtype."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            "vocab_parallel_cross_entropy: logits must be (N, V/T) and targets (N,), got "
            f"{tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    return _VocabParallelCrossEntropy.apply(logits, targets, group, ignore_index)


class VocabParallelCrossEntropy(nn.Module):
    """``nn.CrossEntropyLoss`` (mean) for vocabulary-split logits; swapped in for a model's
    criterion when its LM head is split over the vocabulary."""

    def __init__(self, group, *, ignore_index: int = -100) -> None:
        super().__init__()
        self.group = group
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            logits, targets, self.group, ignore_index=self.ignore_index
        )
