"""The pure parts of zerolap.pipe: the layer split, the 1F1B schedule (deadlock-free, bubble as
the theory says), the metadata encoding, and the (pipe, data, tensor) mesh arithmetic."""

from __future__ import annotations

import itertools

import pytest
import torch

from zerolap.pipe.p2p import TensorMeta, _decode, _encode
from zerolap.pipe.partition import balanced_bounds, layer_weights
from zerolap.pipe.schedule import (
    Op,
    Step,
    forward_only,
    one_f_one_b,
    schedule,
    simulate,
    theoretical_bubble,
)
from zerolap.pipe.weight_grad import DeferredWeights
from zerolap.topology import ParallelDims


@pytest.mark.parametrize(
    ("weights", "stages", "bounds"),
    [
        ([1, 1, 1, 1], 2, [0, 2, 4]),
        ([5, 1, 1, 1, 1, 1], 2, [0, 1, 6]),
        ([0, 3, 3, 3, 3, 0, 1], 2, [0, 3, 7]),
        ([1, 1, 1], 3, [0, 1, 2, 3]),
        ([10, 0, 0, 0], 4, [0, 1, 2, 3, 4]),
        ([2, 2, 2, 2, 2, 2, 2, 2], 4, [0, 2, 4, 6, 8]),
        ([1] * 13, 4, [0, 4, 7, 10, 13]),  # as even as the heaviest allows, not 4, 4, 4, 1
        ([0, 0, *[1] * 13, 0, 0], 4, [0, 6, 9, 12, 17]),
        ([0, 0, *[1] * 13, 0, 0], 2, [0, 9, 17]),
    ],
)
def test_balanced_bounds(weights, stages, bounds):
    assert balanced_bounds(weights, stages) == bounds


def test_balanced_bounds_minimises_the_heaviest_stage():
    weights = [7, 3, 9, 1, 1, 8, 2, 6, 4, 5]
    bounds = balanced_bounds(weights, 3)
    heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
    best = min(
        max(sum(weights[:i]), sum(weights[i:j]), sum(weights[j:]))
        for i in range(1, len(weights))
        for j in range(i + 1, len(weights))
    )
    assert heaviest == best


def test_partition_methods():
    names = ["Embed", "Block", "Block", "LayerNorm", "function"]
    counts = [100, 50, 50, 2, 0]
    assert layer_weights("parameters", param_counts=counts, type_names=names) == counts
    assert layer_weights("uniform", param_counts=counts, type_names=names) == [1] * 5
    assert layer_weights("type:block", param_counts=counts, type_names=names) == [0, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="no layer's name matches"):
        layer_weights("type:attention", param_counts=counts, type_names=names)
    with pytest.raises(ValueError, match="partition_method='best'"):
        layer_weights("best", param_counts=counts, type_names=names)


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 4), (2, 8), (4, 4), (4, 8), (3, 7)])
def test_one_f_one_b_runs_every_micro_batch_and_reaches_the_theoretical_bubble(
    stages, micro_batches
):
    schedules = [
        one_f_one_b(stages=stages, stage=s, micro_batches=micro_batches) for s in range(stages)
    ]
    for steps in schedules:
        forwards = [s.micro_batch for s in steps if s.op is Op.FORWARD]
        backwards = [s.micro_batch for s in steps if s.op is Op.BACKWARD]
        assert forwards == backwards == list(range(micro_batches))
    for stage, steps in enumerate(schedules):  # never more in flight than p - s
        alive = peak = 0
        for step in steps:
            alive += 1 if step.op is Op.FORWARD else -1
            peak = max(peak, alive)
        assert peak == min(stages - stage, micro_batches)
    for busy, span in simulate(schedules, forward_s=1.0, backward_s=2.0):
        assert 1 - busy / span == pytest.approx(
            theoretical_bubble(stages=stages, micro_batches=micro_batches)
        )


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 4), (2, 8), (4, 4), (4, 8), (3, 7)])
def test_zero_bubble_h1_reaches_its_theoretical_bubble(stages, micro_batches):
    """ZB-H1: 1F1B's forwards and backwards in 1F1B's order (the same messages), every
    micro-batch's weight step after its backward, at most p micro-batches held on any stage
    (activations or a weight step's inputs, 1F1B's peak), and with equal forward,
    input-gradient and weight steps the bubble (p - 1) / (3 m + p - 1), a third of 1F1B's
    for m >> p."""
    schedules = [
        schedule(stages=stages, stage=s, micro_batches=micro_batches, kind="zb-h1")
        for s in range(stages)
    ]
    for stage, steps in enumerate(schedules):
        plain = one_f_one_b(stages=stages, stage=stage, micro_batches=micro_batches)
        assert [s for s in steps if s.op is not Op.WEIGHT] == plain
        weights = [s.micro_batch for s in steps if s.op is Op.WEIGHT]
        assert weights == list(range(micro_batches))
        held = peak = 0
        for i, step in enumerate(steps):
            if step.op is Op.WEIGHT:
                assert Step(Op.BACKWARD, step.micro_batch) in steps[:i]
            held += {Op.FORWARD: 1, Op.BACKWARD: 0, Op.WEIGHT: -1}[step.op]
            peak = max(peak, held)
        assert peak <= min(stages, micro_batches)
    bubble = theoretical_bubble(stages=stages, micro_batches=micro_batches, kind="zb-h1")
    assert bubble < theoretical_bubble(stages=stages, micro_batches=micro_batches)
    for busy, span in simulate(schedules, forward_s=1.0, backward_s=1.0, weight_s=1.0):
        assert 1 - busy / span == pytest.approx(bubble)


def test_deferred_weights_equal_autograd_and_arrive_last_layer_first():
    """The split backward in one process: the input-gradient pass and the weight step together
    give every parameter autograd's gradient (a weight shared by two layers, a frozen weight
    with a trainable bias, a layer called by keyword), and the weight step hands them over last
    layer first, each once."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4) for _ in range(4)]
    layers[3].weight = layers[2].weight
    layers[1].weight.requires_grad_(False)

    def run(x):
        h = layers[1](torch.tanh(layers[0](x)))
        return layers[3](input=torch.tanh(layers[2](h)))

    x = torch.randn(3, 4, requires_grad=True)
    run(x).square().sum().backward()
    params = {id(p): p for layer in layers for p in layer.parameters() if p.requires_grad}
    expected = {key: p.grad.clone() for key, p in params.items()}
    for p in params.values():
        p.grad = None
    deferred = DeferredWeights(layers, {})
    arrived = []
    for key, p in params.items():
        p.register_post_accumulate_grad_hook(lambda p, key=key: arrived.append(key))
    deferred.record(0)
    y = run(x).square().sum()
    deferred.stop((y,))
    torch.autograd.backward([y], inputs=[x, *deferred.extra_inputs(0)])
    assert arrived == []  # nothing of the deferred layers in the input-gradient pass
    deferred.accumulate(0)
    assert arrived == list(reversed(params))  # params: forward order, each once
    for key, p in params.items():
        torch.testing.assert_close(p.grad, expected[key], rtol=1e-6, atol=1e-7)


def test_simulate_names_a_deadlock():
    wrong = [
        one_f_one_b(stages=2, stage=0, micro_batches=2),
        list(reversed(one_f_one_b(stages=2, stage=1, micro_batches=2))),
    ]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(wrong)


def test_metadata_round_trip():
    metas = (
        TensorMeta((2, 6, 16), torch.float32, True),
        TensorMeta((2, 6), torch.int64, False),
        TensorMeta((), torch.bfloat16, False),
    )
    for bare in (False, True):  # one tensor and a one-element tuple arrive as sent
        assert _decode(_encode(metas[:1], bare).tolist()) == (metas[:1], bare)
    assert _decode(_encode(metas, False).tolist()) == (metas, False)


def test_type_partition_matches_module_classes_and_function_names():
    from torch import nn

    from zerolap.pipe.module import LayerSpec, _type_name

    def scale_fn(x):
        return 2 * x

    names = [_type_name(x) for x in (LayerSpec(nn.Linear, 2, 2), nn.ReLU(), scale_fn, print)]
    assert names == ["Linear", "ReLU", "scale_fn", "print"]
    weights = layer_weights("type:SCALE", param_counts=[0] * 4, type_names=names)
    assert weights == [0, 0, 1, 0]  # DeepSpeed's search: case-insensitive, functions by name


def test_mesh_puts_stages_outermost_and_tensor_ranks_consecutive():
    dims = ParallelDims(8, tensor=2, pipe=2)
    assert dims.data == 2
    assert dims.coordinates(5) == (1, 0, 1)
    assert dims.rank_of(1, 0, 1) == 5
    assert dims.tensor_ranks(1, pipe_rank=1) == [6, 7]
    assert dims.data_ranks(0, pipe_rank=1) == [4, 6]
    assert dims.pipe_ranks(1, 1) == [3, 7]
    assert dims.model_ranks(0) == [0, 1, 4, 5]
    with pytest.raises(ValueError, match=r"3 pipeline stages x tensor_parallel\.autotp_size=2"):
        ParallelDims(8, tensor=2, pipe=3)


@pytest.mark.parametrize(
    ("stages", "micro_batches", "chunks"), [(2, 4, 2), (2, 8, 2), (4, 8, 2), (4, 8, 3), (3, 6, 4)]
)
def test_interleaved_bubble_shrinks_as_the_theory_says(stages, micro_batches, chunks):
    """Interleaved 1F1B: every (chunk, micro-batch) once each way, deadlock-free, and the
    bubble (p - 1) / (v m + p - 1): smaller than 1F1B's by about v."""
    schedules = [
        schedule(stages=stages, stage=s, micro_batches=micro_batches, chunks=chunks)
        for s in range(stages)
    ]
    everything = {(c, m) for c in range(chunks) for m in range(micro_batches)}
    for steps in schedules:
        assert {(s.chunk, s.micro_batch) for s in steps if s.op is Op.FORWARD} == everything
        assert {(s.chunk, s.micro_batch) for s in steps if s.op is Op.BACKWARD} == everything
    bubble = theoretical_bubble(stages=stages, micro_batches=micro_batches, chunks=chunks)
    assert bubble < theoretical_bubble(stages=stages, micro_batches=micro_batches)
    for busy, span in simulate(schedules, forward_s=1.0, backward_s=2.0, chunks=chunks):
        assert 1 - busy / span == pytest.approx(bubble)
    evaluation = [
        forward_only(stages=stages, micro_batches=micro_batches, chunks=chunks)
        for _ in range(stages)
    ]
    simulate(evaluation, chunks=chunks)  # forward only: no deadlock either


def test_interleaving_needs_micro_batches_in_groups_of_the_stages():
    with pytest.raises(ValueError, match="not a multiple"):
        schedule(stages=4, stage=0, micro_batches=6, chunks=2)


def test_process_topology_answers_as_deepspeeds():
    """Values DeepSpeed 0.19.8's own topology classes give for the same calls."""
    from zerolap.topology import (
        PipeDataParallelTopology,
        PipeModelDataParallelTopology,
        ProcessTopology,
        parallel_dims,
    )

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=3, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"] and topo.world_size() == 12
    assert tuple(topo.get_coord(7)) == (1, 0, 1) and topo.get_coord(7).model == 1
    assert topo.get_rank(pipe=1, data=1, model=2) == 11
    assert topo.get_axis_comm_lists("pipe") == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]
    assert topo.get_axis_comm_lists("data") == [[0, 3], [1, 4], [2, 5], [6, 9], [7, 10], [8, 11]]
    assert topo.get_axis_comm_lists("model") == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert [topo.get_rank_repr(r) for r in (0, 4, 11)] == ["model_00", "model_01", "model_02"]
    assert topo.filter_match(pipe=0, data=1) == [3, 4, 5]
    assert topo.get_axis_list("model", 1) == [1, 4, 7, 10]
    assert parallel_dims(topo) == ParallelDims(12, tensor=3, pipe=2)
    flat = PipeDataParallelTopology(num_pp=3, num_dp=2)
    assert flat.get_dim("model") == 0 and flat.get_axis_comm_lists("model") == []
    assert flat.get_axis_comm_lists("pipe") == [[0, 2, 4], [1, 3, 5]]
    assert ParallelDims(6, pipe=3).topology().get_axis_comm_lists("data") == [
        [0, 1],
        [2, 3],
        [4, 5],
    ]
    with pytest.raises(ValueError, match="get_rank\\(\\) takes a coordinate on every axis"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="axes \\['data', 'pipe'\\]: zerolap lays ranks out"):
        parallel_dims(ProcessTopology(["data", "pipe"], [2, 2]))
