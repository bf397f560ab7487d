"""The two lanes of the forward overlap: strict turns at switch points, the caller's grad mode,
errors surfacing after both lanes stop, no nesting; and a split block's argument handling."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerolap.tensor_parallel import lanes
from zerolap.tensor_parallel.overlap import _forward_in_lanes, _ModelBatch, _SplitBlock


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


def test_a_lane_error_surfaces_and_stops_the_other_lane():
    done = []

    def work(index: int) -> None:
        if index == 0:
            raise ValueError("lane 0 broke")
        done.append("before")
        lanes.switch()  # the turn is poisoned: no collective after this one
        done.append("after")

    with pytest.raises(ValueError, match="lane 0 broke"):
        lanes.run_two(work)
    assert done == ["before"]


def test_lanes_do_not_nest_and_switch_outside_is_harmless():
    lanes.switch()  # nothing to switch to
    assert not lanes.in_lanes()
    with pytest.raises(RuntimeError, match="cannot be nested"):
        lanes.run_two(lambda _: lanes.run_two(lambda _: None))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x, mask=None, cache=None, table=None):
        y = self.linear(x)
        if mask is not None:
            y = y * mask.unsqueeze(-1)
        if table is not None:
            y = y + table
        return y, None


def _split(block: nn.Module, name: str = "blocks.0", batch: int | None = None):
    """``block``'s forward as ``split_blocks`` makes it, the model's batch given."""
    seen = _ModelBatch()
    seen.size = batch
    split = _SplitBlock(name, block, seen)
    return lambda *args, **kwargs: _forward_in_lanes(split, block, *args, **kwargs)


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
    got, none_too = _split(block, batch=5)(x, mask, table=table)
    torch.testing.assert_close(got, y, rtol=1e-6, atol=1e-7)
    assert none is None and none_too is None
    got.square().sum().backward()
    torch.testing.assert_close(x.grad, want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(block.linear.weight.grad, want[1], rtol=1e-6, atol=1e-7)
    assert block.unused.weight.grad is None  # no half used it: no gradient, as unsplit


def test_what_cannot_be_split_is_named():
    block = _Block()
    x = torch.randn(4, 3, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"blocks\.3 got a object in its kwargs 'cache'"):
        _split(block, "blocks.3")(x, cache=object())
    with pytest.raises(ValueError, match="needs a gradient besides the hidden states"):
        _split(block, "blocks.3")(x, torch.ones(4, 3, requires_grad=True))
    with pytest.warns(UserWarning, match="micro-batch of 1, which cannot be split"):
        _split(block, "blocks.9")(x[:1])
    with pytest.raises(ValueError, match=r"shape \(4, 3, 4\), whose first dimension is not"):
        _split(block, batch=3)(x)  # sequence first
    with pytest.raises(ValueError, match="runs on meta: the full overlap runs on CPU only"):
        _split(block)(torch.empty(4, 3, 4, device="meta"))
    with torch.autograd.graph.save_on_cpu(), pytest.raises(ValueError, match="saved-tensor hooks"):
        _split(block)(x)


class _Borrowing(nn.Module):
    """Uses a parameter it does not own (one tied from elsewhere, say)."""

    def __init__(self, outside: nn.Parameter) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.outside = [outside]  # not registered: not the block's own

    def forward(self, x):
        return self.linear(x) * self.outside[0]


def test_a_gradient_the_split_would_drop_is_an_error():
    block = _Borrowing(nn.Parameter(torch.ones(4)))
    with pytest.raises(ValueError, match=r"shape \(4,\) that needs a gradient and is neither"):
        _split(block)(torch.randn(4, 3, 4, requires_grad=True))


def test_a_second_backward_is_an_error_and_inputs_written_in_place_work():
    class InPlace(_Block):
        def forward(self, x):
            x.mul_(2)  # writes into its input, as some blocks do
            return self.linear(x)

    block = InPlace()
    x = torch.randn(4, 3, 4, requires_grad=True)
    y = _split(block)(x * 1)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="takes one backward"):
        y.sum().backward()
