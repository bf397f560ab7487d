"""The two lanes of the forward overlap: strict turns at switch points, the caller's grad mode,
errors surfacing after both lanes stop, no nesting; and a split block's argument handling."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerolap.tensor_parallel import lanes
from zerolap.tensor_parallel.overlap import _forward_in_lanes


def test_lanes_take_turns_at_switch_points():
    order = []

    def work(index: int) -> int:
        for step in range(3 if index == 0 else 2):
            order.append((index, step))
            lanes.switch()
        return index * 10

    assert lanes.run_two(work) == (0, 10)
    # Lane 1 finishes first; lane 0 then runs on without handing over.
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]


def test_lanes_keep_the_callers_grad_mode():
    with torch.no_grad():
        assert lanes.run_two(lambda _: torch.is_grad_enabled()) == (False, False)
    assert lanes.run_two(lambda _: torch.is_grad_enabled()) == (True, True)


def test_a_lane_error_surfaces_after_both_lanes_stop():
    done = []

    def work(index: int) -> None:
        if index == 0:
            raise ValueError("lane 0 broke")
        lanes.switch()
        done.append(index)

    with pytest.raises(ValueError, match="lane 0 broke"):
        lanes.run_two(work)
    assert done == [1]


def test_lanes_do_not_nest_and_switch_outside_is_harmless():
    lanes.switch()  # nothing to switch to
    assert not lanes.in_lanes()
    with pytest.raises(RuntimeError, match="cannot be nested"):
        lanes.run_two(lambda _: lanes.run_two(lambda _: None))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, mask=None, cache=None, table=None):
        y = self.linear(x)
        if mask is not None:
            y = y * mask.unsqueeze(-1)
        if table is not None:
            y = y + table
        return y, None


def test_a_split_block_equals_the_whole_one():
    """Per-sample arguments split, shared ones whole, tuple outputs with Nones rebuilt, and
    parameter gradients summed over the halves once."""
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(5, 3, 4, requires_grad=True)
    mask = (torch.rand(5, 3) > 0.3).float()
    table = torch.randn(3, 4)  # shared by every sample
    y, none = block(x, mask, table=table)
    y.square().sum().backward()
    want = (x.grad.clone(), block.linear.weight.grad.clone())
    x.grad = block.linear.weight.grad = None
    got, none_too = _forward_in_lanes("blocks.0", block, x, mask, table=table)
    torch.testing.assert_close(got, y, rtol=1e-6, atol=1e-7)
    assert none is None and none_too is None
    got.square().sum().backward()
    torch.testing.assert_close(x.grad, want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(block.linear.weight.grad, want[1], rtol=1e-6, atol=1e-7)


def test_what_cannot_be_split_is_named():
    block = _Block()
    x = torch.randn(4, 3, 4, requires_grad=True)
    with pytest.raises(
        ValueError, match=r"blocks\.3 got a object in its kwargs 'cache'.*use_cache"
    ):
        _forward_in_lanes("blocks.3", block, x, cache=object())
    with pytest.raises(ValueError, match="needs a gradient besides the hidden states"):
        _forward_in_lanes("blocks.3", block, x, torch.ones(4, 3, requires_grad=True))
    with pytest.warns(UserWarning, match="micro-batch of 1, which cannot be split"):
        _forward_in_lanes("blocks.9", block, x[:1])
