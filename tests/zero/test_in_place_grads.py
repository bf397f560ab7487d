"""Stages 0-2 on an accelerator: autograd accumulates every gradient in the storage's buffer
itself (each ``param.grad`` is its place in stages 0-1's flat buffer, or in stage 2's bucket
buffers), with no hook per parameter during backward (``GradReducer``'s ``in_place``). On CPU
the engine does not choose it (the zeroing and adding it trades for the hooks cost a CPU more
than the hooks); these tests choose it there by patching ``zerolap.accelerator.runs_apart``,
and must then train exactly as the hooks do: bitwise the same parameters at every step, with a
tied weight, a parameter unused in some micro-batches and gradient accumulation, and the same
``param.grad`` a caller sees."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

import zerolap
import zerolap.accelerator
from tests.offload.test_host_offload import apart
from tests.zero.models import assert_equal_on_every_rank, loss_fn, make_model, rank_batch
from zerolap.zero.reducer import GradReducer

MICRO = 2


def _config(stage: int, gas: int, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, **zero},
    }


def train(stage: int, gas: int, in_place: bool, reduce_scatter: bool = True) -> dict:
    """Three steps of ``gas`` micro-batches on every rank (the odd micro-batches leave one
    parameter unused). Returns whether the engine chose in-place gradients, how often the
    per-parameter hook ran, each backward's ``param.grad`` as a caller sees it, and each
    step's parameters."""
    hooks = []
    on_grad = GradReducer._on_grad
    GradReducer._on_grad = lambda self, slot, param: (
        hooks.append(slot) or on_grad(self, slot, param)
    )
    try:
        with _runs_apart(in_place):
            engine, *_ = zerolap.initialize(
                model=make_model().to(torch.bfloat16),
                config=_config(stage, gas, reduce_scatter=reduce_scatter),
            )
        return _train(engine, gas) | {"hooks": len(hooks)}
    finally:
        GradReducer._on_grad = on_grad


@contextlib.contextmanager
def _runs_apart(apart: bool):
    """The engine built as on an accelerator (when ``apart``), in this pooled process only
    while it is built."""
    real = zerolap.accelerator.runs_apart
    if apart:
        zerolap.accelerator.runs_apart = lambda device: True
    try:
        yield
    finally:
        zerolap.accelerator.runs_apart = real


def _train(engine, gas: int) -> dict:
    # The optimizer's accelerator path (tests/zero/test_device_step.py) is left out of the
    # comparison: only where gradients accumulate differs between the two runs.
    engine.optimizer.on_accelerator = False
    chose = engine.reducer.in_place
    grads, params = [], []
    for step in range(3):
        for micro in range(gas):
            tokens, targets = rank_batch(step * gas + micro, MICRO)
            logits = engine(tokens, use_sometimes=micro % 2 == 0)
            engine.backward(loss_fn(logits, targets))
            grads.append([None if p.grad is None else p.grad.clone() for p in engine.parameters()])
            engine.step()
        params.append([p.detach().clone() for p in engine.parameters()])
    engine.destroy()
    return {"chose": chose, "grads": grads, "params": params}


@pytest.mark.parametrize(
    "stage, gas, reduce_scatter",
    [
        (0, 1, True),
        (0, 2, True),
        (1, 1, True),
        (1, 2, True),
        (2, 1, True),
        (2, 2, True),
        (2, 1, False),
    ],
)
def test_in_place_gradients_train_bitwise_as_the_hooks_do(ranks, stage, gas, reduce_scatter):
    in_place = ranks(2).run(train, stage, gas, True, reduce_scatter, timeout=120)
    hooked = ranks(2).run(train, stage, gas, False, reduce_scatter, timeout=120)
    for a, b in zip(in_place, hooked, strict=True):
        assert a["chose"] and not b["chose"]
        assert a["hooks"] == 0 and b["hooks"] > 0  # no per-parameter work during backward
        for grads_a, grads_b in zip(a["grads"], b["grads"], strict=True):
            for ga, gb in zip(grads_a, grads_b, strict=True):
                # Stage 0 shows the gradients (the average at the boundary, this rank's sum
                # between micro-batches); stages 1-2 show none, as DeepSpeed.
                assert (ga is None) == (gb is None) == (stage >= 1)
                if ga is not None:
                    assert torch.equal(ga, gb)
        for params_a, params_b in zip(a["params"], b["params"], strict=True):
            for pa, pb in zip(params_a, params_b, strict=True):
                assert torch.equal(pa, pb)


def chosen(stage: int, top: dict | None = None, **zero) -> bool:
    """Whether the engine chooses in-place gradients (``top``: more top-level keys)."""
    with _runs_apart(True):
        engine, *_ = zerolap.initialize(
            model=make_model().to(torch.bfloat16), config=_config(stage, 1, **zero) | (top or {})
        )
    chose = engine.reducer.in_place
    engine.destroy()
    return chose


def test_in_place_gradients_only_where_nothing_needs_a_hook(ranks):
    """Stage 3 releases its parameters between their uses; ``overlap_comm`` launches buckets
    during backward; ``ignore_unused_parameters: false`` must see which parameter got no
    gradient; an fp32 communication has no place for a bf16 gradient. (Stage 2's memory rule
    is ``test_reducer``'s.)"""
    pool = ranks(2)
    assert pool.run(chosen, 1) == [True, True]
    assert pool.run(chosen, 2) == [True, True]
    assert pool.run(chosen, 3) == [False, False]
    assert pool.run(chosen, 1, overlap_comm=True) == [False, False]
    assert pool.run(chosen, 2, overlap_comm=True) == [False, False]
    assert pool.run(chosen, 0, ignore_unused_parameters=False) == [False, False]
    assert pool.run(chosen, 2, {"communication_data_type": "fp32"}) == [False, False]


def train_with_create_graph(stage: int, in_place: bool) -> list[torch.Tensor]:
    """``loss.backward(create_graph=True)``: autograd then accumulates out of place, so a
    ``param.grad`` is no longer its place in the buffer after backward."""
    with _runs_apart(in_place):
        engine, *_ = zerolap.initialize(model=make_model(), config=_config(stage, 1))
    assert engine.reducer.in_place is in_place
    engine.optimizer.on_accelerator = False
    for step in range(2):
        tokens, targets = rank_batch(step, MICRO)
        loss_fn(engine(tokens), targets).backward(create_graph=True)
        engine.step()
    params = [p.detach().clone() for p in engine.parameters()]
    engine.destroy()
    return params


@pytest.mark.parametrize("stage", [0, 2])
def test_a_gradient_accumulated_out_of_place_still_counts(ranks, stage):
    in_place = ranks(2).run(train_with_create_graph, stage, True, timeout=120)
    hooked = ranks(2).run(train_with_create_graph, stage, False, timeout=120)
    assert_equal_on_every_rank(in_place, hooked)


def train_two_backwards(stage: int, in_place: bool) -> dict:
    """Two backwards before each step (a multi-loss loop), the second leaving one parameter,
    and so a whole bucket, without a gradient: at stages 0-1 the first reduces the buffer, so
    the second is a later round, reduced apart and added; at stage 2 each is reduced into the
    shard (and a bucket the second did not reach reduces zeros). Returns each step's
    ``param.grad`` after the second backward, and the parameters."""
    with _runs_apart(in_place):
        engine, *_ = zerolap.initialize(
            model=make_model().to(torch.bfloat16),
            config=_config(stage, 1, reduce_bucket_size=50),  # a bucket or two per parameter
        )
    assert engine.reducer.in_place is in_place
    engine.optimizer.on_accelerator = False
    grads = []
    for step in range(2):
        tokens, targets = rank_batch(step, MICRO)
        engine.backward(loss_fn(engine(tokens), targets))
        engine.backward(loss_fn(engine(tokens, use_sometimes=False), targets))
        grads.append([None if p.grad is None else p.grad.clone() for p in engine.parameters()])
        engine.step()
    params = [p.detach().clone() for p in engine.parameters()]
    engine.destroy()
    return {"grads": grads, "params": params}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_second_backward_before_the_step_is_a_later_round(ranks, stage):
    in_place = ranks(2).run(train_two_backwards, stage, True, timeout=120)
    hooked = ranks(2).run(train_two_backwards, stage, False, timeout=120)
    for a, b in zip(in_place, hooked, strict=True):
        for grads_a, grads_b in zip(a["grads"], b["grads"], strict=True):
            for ga, gb in zip(grads_a, grads_b, strict=True):
                assert (ga is None) == (gb is None) == (stage >= 1)  # stage 0 shows them
                if ga is not None:
                    assert torch.equal(ga, gb)
    assert_equal_on_every_rank([r["params"] for r in in_place], [r["params"] for r in hooked])


def parked_and_back(park: bool) -> dict:
    """Stage 2 in place: ``offload_states()`` after a step frees the buckets' buffer (nothing
    of this module keeps it: the places are dropped with it), and after ``reload_states()``
    the next backward allocates it again; training goes on as if nothing was parked."""
    with _runs_apart(True), apart():
        engine, *_ = zerolap.initialize(model=make_model().to(torch.bfloat16), config=_config(2, 1))
        engine.optimizer.on_accelerator = False
        freed = None
        for step in range(3):
            tokens, targets = rank_batch(step, MICRO)
            engine.backward(loss_fn(engine(tokens), targets))
            engine.step()
            if park and step == 0:
                buffer = weakref.ref(engine.grads.grad_places(engine.params)[0]._base)
                engine.offload_states()
                gc.collect()
                freed = buffer() is None
                engine.reload_states()
        params = [p.detach().clone() for p in engine.parameters()]
        engine.destroy()
    return {"freed": freed, "params": params}


def test_offload_states_frees_the_in_place_buffer(ranks):
    parked = ranks(2).run(parked_and_back, True, timeout=120)
    straight = ranks(2).run(parked_and_back, False, timeout=120)
    assert [r["freed"] for r in parked] == [True, True]
    assert_equal_on_every_rank([r["params"] for r in parked], [r["params"] for r in straight])
