"""``offload_optimizer.defer_step`` (``zero.step_behind``): at stages 1-2 the swapped sub-groups
step on the ring's thread, each just before the all-gather that first needs it, after ``step()``
has returned. What a user relies on: the values of the step taken inside ``step()``, bit for
bit, whatever a scheduler does to the learning rate after ``step()`` and whoever reads the
parameters or the optimizer state before the next forward; and where the step stays inside
``step()``, a line saying why when the key was set."""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.logs import captured_logs
from tests.zero.models import global_batch, loss_fn, make_model
from zerolap.offload.swap_file import SwapError
from zerolap.zero.optimizer import ZeroOptimizer

MICRO, STEPS = 2, 3


def _config(directory: str, defer: bool | None, stage: int = 2, **zero) -> dict:
    opt = {"device": "nvme", "nvme_path": directory, "buffer_count": 2}
    if defer is not None:
        opt["defer_step"] = defer
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.3,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "sub_group_size": 100,
            "reduce_bucket_size": 200,  # several buckets, several sub-groups each
            "offload_optimizer": opt,
            **zero,
        },
    }


def _batch(step: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(step, MICRO * world)
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    return tokens[mine], targets[mine]


def steps_then_readers(directory: str, defer: bool, hook: bool = False) -> dict:
    """STEPS steps under a scheduler that halves the learning rate every step (stepped by the
    engine right after the optimizer); after each ``step()``, before any training forward,
    the readers a user has: the optimizer's state (iterated) and state dict, the parameters,
    an eval forward. ``hook``: rank 0's client optimizer has a step hook that reads the model
    from the start; rank 1's gets one right after its first ``step()`` returns."""
    engine, optimizer, *_ = zerolap.initialize(
        model=make_model(),
        config=_config(directory, defer),
        lr_scheduler=lambda inner: torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 0.5**s),
    )
    read = []

    def read_the_model(*_):
        read.append(sum(p.detach().sum() for p in engine.module.parameters()))

    if hook and dist.get_rank() == 0:
        optimizer.inner.register_step_post_hook(read_the_model)
    stepped_on = set()  # the threads the optimizer stepped on
    original = ZeroOptimizer._step_runs

    def step_and_note(*args, **kwargs):
        stepped_on.add(threading.current_thread().name.split("_")[0])
        return original(*args, **kwargs)

    ZeroOptimizer._step_runs = step_and_note
    seen = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(STEPS):
                tokens, targets = _batch(step)
                engine.backward(loss_fn(engine(tokens), targets))
                engine.step()
                if hook and dist.get_rank() == 1 and step == 0:
                    optimizer.inner.register_step_post_hook(read_the_model)
                entries = len(list(optimizer.state.items()))
                state = optimizer.state_dict()["inner"]["state"] if step % 2 else None
                params = [p.detach().clone() for p in engine.module.parameters()]
                state = state or optimizer.state_dict()["inner"]["state"]
                engine.eval()
                with torch.no_grad():
                    out = engine(tokens)
                engine.train()
                seen.append((params, state, out, entries))
    finally:
        ZeroOptimizer._step_runs = original
    lrs = [group["lr"] for group in optimizer.param_groups]
    complaints = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    engine.destroy()
    return {"seen": seen, "lrs": lrs, "warnings": complaints, "threads": sorted(stepped_on)}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_steps_behind_give_the_in_step_values_to_every_reader(ranks, tmp_path):
    behind = ranks(2).run(steps_then_readers, str(tmp_path), True)
    inside = ranks(2).run(steps_then_readers, str(tmp_path), False)
    for rank in range(2):
        got, want = behind[rank], inside[rank]
        for step, (g, w) in enumerate(zip(got["seen"], want["seen"], strict=True)):
            assert _same(g[0], w[0]), f"rank {rank} step {step}: parameters differ"
            assert _same(g[1], w[1]), f"rank {rank} step {step}: optimizer state differs"
            assert _same(g[2], w[2]), f"rank {rank} step {step}: eval output differs"
        assert got["lrs"] == want["lrs"] == [0.05 * 0.5**STEPS]
        assert got["warnings"] == want["warnings"] == []
        # Where the swapped sub-groups stepped: the ring's thread, or step()'s own.
        assert got["threads"] == ["zerolap-ring"], got["threads"]
        assert want["threads"] == ["MainThread"], want["threads"]


def test_a_step_hook_keeps_the_step_inside_step_on_its_rank_alone(ranks, tmp_path):
    """The hooks read the model's parameters: run on the ring's thread, one would wait for the
    gathers queued behind it. A rank with a hook steps inside ``step()`` while the other steps
    behind it, with the same collectives (nothing hangs), and a hook registered while the step
    runs behind does not run there."""
    hooked = ranks(2).run(steps_then_readers, str(tmp_path), True, True, timeout=120)
    inside = ranks(2).run(steps_then_readers, str(tmp_path), False)
    assert hooked[0]["threads"] == ["MainThread"]  # hooked from the start
    assert hooked[1]["threads"] == ["MainThread", "zerolap-ring"]  # hooked after step 0
    for rank in range(2):
        assert _same(hooked[rank]["seen"], inside[rank]["seen"])


class PlainSGD(torch.optim.SGD):
    """torch's SGD under another module's name: zerolap cannot know that its ``step()``
    leaves the param groups' entries alone."""


def in_force(directory: str, case: str) -> tuple[bool, list[str]]:
    kwargs = {}
    if case == "stage 1":
        config = _config(directory, None, stage=1)
    elif case == "stage 3":
        config = _config(directory, True, stage=3)
    elif case == "no overlap_param_gather":
        config = _config(directory, True, overlap_param_gather=False)
    elif case == "client optimizer":
        config = _config(directory, True)
        del config["optimizer"]
        kwargs["optimizer"] = lambda params: PlainSGD(params, lr=0.1)
    else:  # the default left as it is: nothing said where it cannot apply
        config = _config(directory, None, stage=3)
    with captured_logs() as messages:
        engine, optimizer, *_ = zerolap.initialize(model=make_model(), config=config, **kwargs)
    tokens, targets = _batch(0)
    engine.backward(loss_fn(engine(tokens), targets))
    engine.step()
    defers = optimizer.defer_step
    engine.destroy()
    return defers, [m for m in messages if "defer_step" in m]


@pytest.mark.parametrize(
    ("case", "defers", "why"),
    [
        ("stage 1", True, None),
        ("stage 3", False, "stage 1 or 2"),
        ("no overlap_param_gather", False, "overlap_param_gather"),
        ("client optimizer", False, "not PlainSGD"),
        ("stage 3 by default", False, None),
    ],
)
def test_where_the_step_stays_inside_step_it_says_why(ranks, tmp_path, case, defers, why):
    (got, notes), (other, other_notes) = ranks(2).run(in_force, str(tmp_path), case)
    assert got == other == defers
    assert other_notes == []  # said once, by rank 0
    if why is None:
        assert notes == []
    else:
        assert len(notes) == 1 and why in notes[0], notes


def fail_then_read(directory: str, reader: str) -> str:
    """The last step's swap file is cut short on rank 0 while that step runs behind
    ``step()``; then one reader, and nothing else."""
    engine, optimizer, *_ = zerolap.initialize(model=make_model(), config=_config(directory, True))
    tokens, targets = _batch(0)
    engine.backward(loss_fn(engine(tokens), targets))
    engine.step()
    optimizer.finish_step()
    swapped = optimizer.tiers[-1].state
    swapped.drain()
    if dist.get_rank() == 0:
        os.truncate(swapped.file.path, 4096)
    engine.backward(loss_fn(engine(tokens), targets))
    engine.step()  # its swapped sub-groups read the file behind step()
    try:
        if reader == "eval forward":
            with torch.no_grad():
                engine(tokens)
        elif reader == "parameters":
            engine.module.state_dict()
        else:
            engine.destroy()
    except SwapError as error:
        return str(error)
    finally:
        if not engine.destroyed:
            with contextlib.suppress(SwapError):
                engine.destroy()
    return "nothing raised"


@pytest.mark.parametrize("reader", ["eval forward", "parameters", "destroy"])
def test_a_failed_last_step_is_raised_by_whatever_comes_next(ranks, tmp_path, reader):
    """Not only by a backward: a run that evaluates, saves the weights or ends after its last
    step learns of it there, on every rank."""
    damaged, other = ranks(2).run(fail_then_read, str(tmp_path), reader, timeout=120)
    assert "cut short" in damaged
    assert "rank 0's swapped optimizer state failed its step" in other
