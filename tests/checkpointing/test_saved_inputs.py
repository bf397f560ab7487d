"""How checkpoint inputs are kept: shards over 2 gloo ranks (1/2 of each input per rank, exact
gradients), CPU copies, contiguous slots."""

from __future__ import annotations

import pytest
import torch

import zerolap.comm as dist
from tests.checkpointing.blocks import (
    Block,
    assert_same,
    fresh_state,
    gradients,
    record_kept,
)
from zerolap import checkpointing
from zerolap.checkpointing.saved_inputs import ContiguousSlots, own_shard


@pytest.fixture(autouse=True)
def unconfigured():
    with fresh_state():
        yield


def _plain(block, *args):
    return block(*args)


def _reentrant(block, *args):
    return checkpointing.checkpoint(block, *args)


def _non_reentrant(block, *args):
    return checkpointing.non_reentrant_checkpoint(block, *args)


@pytest.mark.parametrize(("numel", "world_size"), [(8, 2), (15, 2), (5, 4), (3, 3)])
def test_shards_cover_the_tensor_once_with_zero_padding(numel, world_size):
    flat = torch.arange(1.0, numel + 1)
    shards = [own_shard(flat, rank, world_size) for rank in range(world_size)]
    assert {shard.numel() for shard in shards} == {-(-numel // world_size)}
    joined = torch.cat(shards)
    assert torch.equal(joined[:numel], flat) and not joined[numel:].any()


def test_slots_run_out_and_sizes_must_match():
    slots = ContiguousSlots(2)
    first = slots.copy_in(torch.ones(3), slot=slots.take(), position=0)
    second = slots.copy_in(torch.full((3,), 2.0), slot=slots.take(), position=0)
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert torch.equal(slots.buffers[0], torch.tensor([1.0, 1, 1, 2, 2, 2]))
    with pytest.raises(RuntimeError, match="number_checkpoints is 2, but more checkpointed"):
        slots.take()
    slots.release()
    slots.copy_in(torch.ones(3), slot=slots.take(), position=0)
    with pytest.raises(
        ValueError, match=r"keeps 4 elements of torch\.float32, earlier calls' kept"
    ):
        slots.copy_in(torch.ones(4), slot=slots.take(), position=0)


def _three_layers(run, blocks, x, bias, scale):
    out = x
    for block in blocks:
        out, aux, label = run(block, out, bias, scale)
    return out, aux, label


def test_contiguous_slots_hold_every_call_and_free_at_backward():
    checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=3)
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Block() for _ in range(3)])
    x, bias = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    expected = gradients(lambda b, *a: _three_layers(_plain, b, *a), blocks, x, bias)
    with record_kept() as kept:
        got = gradients(lambda b, *a: _three_layers(_reentrant, b, *a), blocks, x, bias)
    assert_same(expected, got)
    buffers = {item.data.untyped_storage().data_ptr() for _, item in kept}
    assert len(kept) == 6 and len(buffers) == 2  # x and bias positions, 3 slots each
    assert checkpointing._STATE.store.slots.buffers == []  # released by the backward


def test_reset_frees_the_slots_of_forwards_without_backward():
    checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=1)
    x = torch.ones(3, requires_grad=True)
    checkpointing.checkpoint(torch.sin, x)
    with pytest.raises(RuntimeError, match="number_checkpoints is 1"):
        checkpointing.checkpoint(torch.sin, x)
    checkpointing.reset()
    checkpointing.checkpoint(torch.sin, x).sum().backward()
    with torch.no_grad():  # nothing saved, no slot taken
        checkpointing.checkpoint(torch.sin, x)
    checkpointing.checkpoint(torch.sin, x)


def test_cpu_checkpointing_keeps_cpu_inputs_as_they_are():
    checkpointing.configure(None, checkpoint_in_cpu=True)
    torch.manual_seed(0)
    block, x, bias = Block(), torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    with record_kept() as kept:
        got = gradients(_reentrant, block, x, bias)
    assert_same(gradients(_plain, block, x, bias), got)
    for tensor, item in kept:
        assert item.data.data_ptr() == tensor.data_ptr()  # not copied


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_checkpointing_moves_cuda_inputs_to_the_cpu():
    checkpointing.configure(None, checkpoint_in_cpu=True)
    torch.manual_seed(0)
    block = Block().cuda()
    x, bias = torch.randn(4, 8, device="cuda", requires_grad=True), torch.randn(4, 8).cuda()
    with record_kept() as kept:
        got = gradients(_reentrant, block, x, bias)
    assert_same(gradients(_plain, block, x, bias), got)
    assert [item.data.device.type for _, item in kept] == ["cpu", "cpu"]


class FakeMpu:
    """Megatron's model-parallel unit over ``group``."""

    def __init__(self, group) -> None:
        self.group = group

    def get_model_parallel_group(self):
        return self.group

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.group)

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.group)


def check_partitioned_inputs(run_name: str, contiguous: bool) -> list[tuple[int, int]]:
    """On every rank: the same block and inputs (model-parallel ranks see the same
    activations); checkpointed gradients equal plain ones and each rank keeps its half."""
    run = {"reentrant": _reentrant, "non_reentrant": _non_reentrant}[run_name]
    with fresh_state():
        group = dist.new_group([0, 1])
        checkpointing.configure(
            FakeMpu(group),
            partition_activations=True,
            contiguous_checkpointing=contiguous,
            num_checkpoints=1 if contiguous else None,
        )
        torch.manual_seed(0)
        block = Block(width=5)
        x, bias = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5)  # 15: padded to 16
        expected = gradients(_plain, block, x, bias)
        with record_kept() as kept:
            got = gradients(run, block, x, bias)
        assert_same(expected, got)
        rank = dist.get_rank(group)
        for tensor, item in kept:
            assert item.sharded
            assert torch.equal(item.data, own_shard(tensor.detach().reshape(-1), rank, 2))
        return [(tensor.numel(), item.data.numel()) for tensor, item in kept]


@pytest.mark.parametrize(
    ("run_name", "contiguous"),
    [("reentrant", False), ("non_reentrant", False), ("reentrant", True)],
)
def test_partition_activations_keeps_half_of_each_input_per_rank(ranks, run_name, contiguous):
    sizes = ranks(2).run(check_partitioned_inputs, run_name, contiguous)
    assert sizes == [[(15, 8), (15, 8)]] * 2  # x and bias, on each rank
