"""A block to checkpoint, and how to run it with and without checkpointing for a comparison."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zerolap import checkpointing
from zerolap.checkpointing.saved_inputs import InputStore, Kept


class Block(torch.nn.Module):
    """Dropout from the default generator and from the tracker's model-parallel state; returns
    several outputs, one of them not a tensor."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(width, 2 * width)
        self.outer = torch.nn.Linear(2 * width, width)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, scale: float) -> tuple:
        hidden = self.dropout(torch.relu(self.inner(x)))
        with checkpointing.get_cuda_rng_tracker().fork():
            hidden = self.dropout(hidden)
        out = self.outer(hidden) * scale + bias
        return out, hidden.sum(dim=-1), "label"


def gradients(run: Callable[..., Any], block: Block, x: torch.Tensor, bias: torch.Tensor):
    """Seed, run ``run(block, x, bias, 3.0)`` (its outputs go through ``checkpoint`` or not),
    advance every generator between forward and backward, backward, and return the outputs and
    the gradients of x and of every parameter."""
    checkpointing.model_parallel_cuda_manual_seed(1234)
    x = x.detach().requires_grad_(x.requires_grad)
    block.zero_grad(set_to_none=True)
    out, aux, label = run(block, x, bias, 3.0)
    assert label == "label"
    torch.rand(5)  # draws the recompute must not see
    with checkpointing.get_cuda_rng_tracker().fork():
        torch.rand(5)
    (out.square().sum() + aux.sum()).backward()
    grads = {name: param.grad.clone() for name, param in block.named_parameters()}
    grads["x"] = x.grad
    return (out.detach(), aux.detach()), grads


def assert_same(expected, actual) -> None:
    (out, aux), grads = expected
    (out_ckpt, aux_ckpt), grads_ckpt = actual
    assert torch.equal(out, out_ckpt) and torch.equal(aux, aux_ckpt)
    assert grads.keys() == grads_ckpt.keys()
    for name, grad in grads.items():
        if grad is None:
            assert grads_ckpt[name] is None, name
        else:
            assert torch.equal(grad, grads_ckpt[name]), name


@contextlib.contextmanager
def record_kept() -> Iterator[list[tuple[torch.Tensor, Kept]]]:
    """Record every (input, what the store kept of it) inside the block."""
    kept: list[tuple[torch.Tensor, Kept]] = []
    keep = InputStore.keep

    def recording(self, tensor, **where):
        result = keep(self, tensor, **where)
        kept.append((tensor, result))
        return result

    InputStore.keep = recording
    try:
        yield kept
    finally:
        InputStore.keep = keep


@contextlib.contextmanager
def fresh_state() -> Iterator[None]:
    """Checkpointing unconfigured and the tracker empty inside the block, as before it after."""
    state, states = checkpointing._STATE, checkpointing.get_cuda_rng_tracker().get_states()
    checkpointing._STATE = checkpointing._Checkpointing()
    try:
        yield
    finally:
        checkpointing._STATE = state
        checkpointing.get_cuda_rng_tracker().reset()
        checkpointing.get_cuda_rng_tracker().set_states(states)
