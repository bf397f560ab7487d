"""The step as it runs on an accelerator: the global norm, clipping and the skip of a
non-finite step stay on the device, so nothing is read back to the host until the step's and
``publish``'s launches are behind (``ZeroOptimizer.confirm``), and that one read decides what
the host then does (the skip count, the schedule, the warning).

These tests run that path on CPU, where it is not taken by itself (nothing to overlap there,
and a CPU float64 norm casts every gradient first), by setting the optimizer's
``on_accelerator``; the GPU run of ``tests/cuda`` takes it as users do. Against the host's path
(CPU's) every step must apply or skip alike, on every rank, with the same parameters to fp32
rounding (the norm is summed in float64 instead of fp32, and clipping multiplies where the host
divides)."""

from __future__ import annotations

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.logs import captured_logs
from tests.zero.models import assert_equal_on_every_rank, loss_fn, make_model, rank_batch
from zerolap.zero import GatheredParameters

MICRO = 2
READS = ("item", "__bool__", "__float__", "__int__", "tolist")  # what reads a tensor's value


def _params(engine) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


class _Reads:
    """Counts the host reads of tensor values (on a GPU, each a sync) while it is on."""

    def __init__(self) -> None:
        self.count, self.on = 0, False
        self._orig = {name: getattr(torch.Tensor, name) for name in READS}
        for name, orig in self._orig.items():
            setattr(torch.Tensor, name, self._counting(orig))

    def _counting(self, orig):
        def read(tensor, *args, **kwargs):
            self.count += self.on
            return orig(tensor, *args, **kwargs)

        return read

    def restore(self) -> None:
        for name, orig in self._orig.items():
            setattr(torch.Tensor, name, orig)


def train(
    stage: int, on_device: bool, poisoned: int | None, scale: float = 1.0, bad_rank: int = 1
) -> dict:
    """Four steps with clipping at 1.0 and a warm-up schedule; at step ``poisoned`` rank
    ``bad_rank``'s loss is NaN. Returns per step: the reads before ``confirm`` and from it on
    (a skipped step's warning reads more), whether it applied, whether the parameters changed;
    then the skips, the learning rate, the norm and the parameters."""
    engine, *_ = zerolap.initialize(
        model=make_model(),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05, "warmup_num_steps": 10},
            },
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        },
    )
    engine.optimizer.on_accelerator = on_device
    reads = _Reads()
    confirm = engine.optimizer.confirm
    seen: list[int] = []

    def counted_confirm():
        seen.append(reads.count)
        return confirm()

    engine.optimizer.confirm = counted_confirm
    steps = []
    try:
        for step in range(4):
            tokens, targets = (t.to(engine.device) for t in rank_batch(step, MICRO))
            before = _params(engine)
            loss = loss_fn(engine(tokens), targets) * scale
            if step == poisoned and dist.get_rank() == bad_rank:
                loss = loss * float("nan")
            engine.backward(loss)
            seen.clear()
            reads.count, reads.on = 0, True
            engine.step()
            reads.on = False
            changed = any(
                not torch.equal(a, b) for a, b in zip(_params(engine), before, strict=True)
            )
            steps.append((seen[0], reads.count - seen[0], engine.was_step_applied(), changed))
    finally:
        reads.restore()
    result = {
        "steps": steps,
        "skipped": engine.skipped_steps,
        "lr": engine.get_lr()[0],
        "norm": engine.get_global_grad_norm(),
        "params": _params(engine),
    }
    engine.destroy()
    return result


def check_same_skip(dev: dict, host: dict, rank: int) -> None:
    """``train``'s device path against its host path, a NaN loss at step 2."""
    # Nothing read before confirm() at any step (the skipped one included): the norm, the clip
    # factor and the skip flag stayed tensors; an applied step read the flag and nothing else.
    assert [s[0] for s in dev["steps"]] == [0] * 4, (rank, dev["steps"])
    assert [s[1] for s in dev["steps"] if s[2]] == [1] * 3, (rank, dev["steps"])
    assert [s[2:] for s in dev["steps"]] == [(True, True), (True, True), (False, False),
                                             (True, True)], (rank, dev["steps"])  # fmt: skip
    assert [s[2:] for s in host["steps"]] == [s[2:] for s in dev["steps"]]
    assert dev["skipped"] == host["skipped"] == 1
    assert dev["lr"] == host["lr"]  # the schedule did not step on the skipped step
    assert dev["norm"] == pytest.approx(host["norm"], rel=1e-5)
    for a, b in zip(dev["params"], host["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_device_decides_the_skip_and_the_host_reads_it_once_after_the_launches(ranks, stage):
    on_device = ranks(2).run(train, stage, True, 2, timeout=120)
    on_host = ranks(2).run(train, stage, False, 2, timeout=120)
    for rank, (dev, host) in enumerate(zip(on_device, on_host, strict=True)):
        check_same_skip(dev, host, rank)


def test_huge_but_finite_gradients_step_on_the_device_path(ranks):
    """Gradients around 1e20: their fp32 squares overflow; summed in float64 they do not, so
    the step applies, clipped, with no retry and no read before confirm()."""
    on_device = ranks(2).run(train, 2, True, None, 1e20, timeout=120)
    on_host = ranks(2).run(train, 2, False, None, 1e20, timeout=120)
    for dev, host in zip(on_device, on_host, strict=True):
        assert [s[:3] for s in dev["steps"]] == [(0, 1, True)] * 4
        assert dev["skipped"] == host["skipped"] == 0
        assert dev["norm"] == pytest.approx(host["norm"], rel=1e-5)
        assert dev["norm"] > 1e19
        for a, b in zip(dev["params"], host["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def nan_gradient_said(on_device: bool) -> list[str]:
    """fp32 stage 2 (its gradients are views of the shard the optimizer reads), clipping on:
    rank 1 backpropagates a finite loss whose gradient for the first parameter is NaN. The
    warning must name the rank whose shard holds that parameter's reduced gradient (rank 1:
    the layout runs in backward's order, so the first parameter is in the last chunk), on the
    device path as on the host's, where clipping by a NaN factor would have made every
    rank's shard NaN."""
    engine, *_ = zerolap.initialize(
        model=make_model(),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
            "zero_optimization": {"stage": 2},
        },
    )
    engine.optimizer.on_accelerator = on_device
    tokens, targets = rank_batch(0, MICRO)
    loss = loss_fn(engine(tokens), targets)
    if dist.get_rank() == 1:  # d/dp of 0 * sqrt(0 * p) is 0 * inf: NaN, the loss staying finite
        first = next(engine.module.parameters())
        loss = loss + 0.0 * torch.sqrt(0.0 * first.sum())
    with captured_logs() as logs:
        engine.backward(loss)
        engine.step()
    skipped = engine.skipped_steps
    engine.destroy()
    return [skipped, *[m for m in logs if "inf or nan" in m]]


def test_a_skipped_step_still_says_where_the_gradients_went_bad(ranks):
    said = "the gradients reduced into rank 1's shard were not finite"
    for on_device in (False, True):
        results = ranks(2).run(nan_gradient_said, on_device, timeout=120)
        assert results[0][0] == results[1][0] == 1
        assert len(results[0]) == 2 and said in results[0][1], (on_device, results[0])


def sgd_after_a_skipped_first_step(on_device: bool) -> list[torch.Tensor]:
    """torch's fused SGD with momentum, the client's optimizer; rank 1's loss NaN at the first
    step. Its fused step, told to skip, would still keep first momentum buffers it never wrote:
    the device path is not taken for it (the host skips), and the next step is clean."""
    model = make_model()
    engine, *_ = zerolap.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True),
        config={"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 1}},
    )
    engine.optimizer.on_accelerator = on_device
    for step in range(2):
        tokens, targets = rank_batch(step, MICRO)
        loss = loss_fn(engine(tokens), targets)
        engine.backward(loss * float("nan") if step == 0 and dist.get_rank() == 1 else loss)
        engine.step()
    params = _params(engine)
    engine.destroy()
    return params


def test_only_adam_skips_on_the_device(ranks):
    on_device = ranks(2).run(sgd_after_a_skipped_first_step, True, timeout=120)
    on_host = ranks(2).run(sgd_after_a_skipped_first_step, False, timeout=120)
    assert all(torch.isfinite(p).all() for params in on_device for p in params)
    assert_equal_on_every_rank(on_device, on_host)
