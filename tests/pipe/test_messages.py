"""What crosses between stages: tuples mixing float activations, integer tensors and tensors
that need no gradient (only the float ones that require grad send gradients back), a shape
change named on the sending stage, and ``dynamic_shape`` letting shapes change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerolap
from tests.multiproc import run_on_ranks
from tests.pipe import models
from tests.pipe.test_engine import _config
from zerolap.pipe import PipeError, PipelineModule, PipelineShapeError


class Start(nn.Module):
    """Embeds; passes on the tokens (int64) and a float mask that needs no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(models.VOCAB, models.WIDTH)

    def forward(self, tokens):
        mask = (tokens % 3 != 0).float().unsqueeze(-1)
        return self.embed(tokens), tokens, mask


class Mix(nn.Module):
    """Uses all three inputs; returns them in the same shape."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(models.WIDTH, models.WIDTH)
        self.bias = nn.Embedding(models.VOCAB, models.WIDTH)

    def forward(self, inputs):
        x, tokens, mask = inputs
        return x + torch.tanh(self.linear(x)) * mask + self.bias(tokens), tokens, mask


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(models.WIDTH, models.VOCAB)

    def forward(self, inputs):
        return self.out(inputs[0])


def _module(stages: int, **kwargs) -> PipelineModule:
    from zerolap.pipe import LayerSpec

    layers = [LayerSpec(Start), *(LayerSpec(Mix) for _ in range(3)), LayerSpec(Head)]
    return PipelineModule(
        layers,
        num_stages=stages,
        loss_fn=models.loss_fn,
        seed_layers=True,
        partition_method="uniform",
        **kwargs,
    )


def train_tuples(stages: int, steps: int = 3):
    module = _module(stages)
    engine, *_ = zerolap.initialize(model=module, config=_config(0, 4, clip=0.0))
    losses = [
        engine.train_batch(iter(models.micro_batches(step, 4, 1, 0))).item()
        for step in range(steps)
    ]
    return losses, {n: p.detach().clone() for n, p in module.named_parameters()}


def test_tuples_with_integer_and_gradient_free_tensors_cross_stages(ranks):
    results = ranks(4).run(train_tuples, 4)
    reference = ranks(1).run(train_tuples, 1)[0]
    merged = {}
    for losses, params in results:
        assert losses == pytest.approx(reference[0], rel=1e-6)
        merged.update(params)
    assert set(merged) == set(reference[1])
    for name, value in reference[1].items():
        torch.testing.assert_close(merged[name], value, rtol=1e-6, atol=1e-7, msg=name)


def change_shape(dynamic: bool):
    engine, *_ = zerolap.initialize(
        model=_module(2, dynamic_shape=dynamic), config=_config(0, 2, clip=0.0)
    )
    short = [(t[:, :3], y[:, :3]) for t, y in models.micro_batches(1, 2, 1, 0)]
    engine.train_batch(iter(models.micro_batches(0, 2, 1, 0)))
    try:
        return engine.train_batch(iter(short)).item()
    except (PipelineShapeError, PipeError) as error:
        return f"{type(error).__name__}: {error}"


def test_a_changed_shape_is_named_unless_dynamic(ranks):
    answers = ranks(2).run(change_shape, True)
    assert all(isinstance(a, float) for a in answers)
    # Fresh processes: the sending stage stops at the error (a script exits), and the stage
    # waiting for its activations names it instead of waiting out the timeout.
    sender, receiver = run_on_ranks(change_shape, 2, False, timeout=60)
    assert sender.startswith("PipelineShapeError: pipeline stage 0: the outputs of micro-batch 0")
    assert (
        "are ((2, 3, 16) float32, (2, 3) int64, (2, 3, 1) float32) but were ((2, 6, 16)" in sender
    )
    assert "dynamic_shape=True" in sender
    assert receiver.startswith("PipeError: pipeline stage 1 (rank 1) waiting for the activations")
