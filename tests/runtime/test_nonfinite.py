"""A NaN loss on one rank (the fault injected at one step): the step is skipped on every rank
at every stage and precision (fp16's dynamic scaling aside, which keeps its own behaviour), the
parameters stay what they were, ``skipped_steps`` counts it, rank 0 warns naming the step and
the rank the NaN came from, and training goes on finite. ``nonfinite_gradients`` turns it into a
named error at once (``action: raise``) or after too many skips in a row."""

from __future__ import annotations

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.logs import captured_logs
from tests.zero.models import global_batch, loss_fn, make_model
from zerolap.runtime import NonFiniteGradientError
from zerolap.zero import GatheredParameters

MICRO = 2


def _config(stage: int, precision: str, **nonfinite) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "nonfinite_gradients": nonfinite,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16 static":
        config["fp16"] = {"enabled": True, "loss_scale": 128}
    return config


def _params(engine) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


def train_with_a_nan(stage: int, precision: str, poisoned: tuple[int, ...], **nonfinite):
    """Three steps; at the steps in ``poisoned``, rank 1's loss is NaN. Returns, per step,
    whether the parameters changed, and the log and the skip count (or the error raised)."""
    engine, *_ = zerolap.initialize(
        model=make_model(), config=_config(stage, precision, **nonfinite)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    changed = []
    with captured_logs() as logs:
        try:
            for step in range(3):
                tokens, targets = global_batch(step, MICRO * world)
                mine = slice(rank * MICRO, (rank + 1) * MICRO)
                before = _params(engine)
                loss = loss_fn(engine(tokens[mine]), targets[mine])
                if step in poisoned and rank == 1:
                    loss = loss * float("nan")
                engine.backward(loss)
                engine.step()
                after = _params(engine)
                assert all(torch.isfinite(p).all() for p in after), "a NaN reached a parameter"
                changed.append(
                    any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
                )
        except NonFiniteGradientError as err:
            return {"error": str(err), "changed": changed}
        finally:
            skipped = engine.skipped_steps
            engine.destroy()
    return {"changed": changed, "skipped": skipped, "logs": [m for m in logs if "inf or nan" in m]}


@pytest.mark.parametrize(
    "stage, precision",
    [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "fp16 static")],
)
def test_a_nan_on_one_rank_skips_the_step_everywhere(ranks, stage, precision):
    results = ranks(2).run(train_with_a_nan, stage, precision, (1,), timeout=120)
    for rank, result in enumerate(results):
        assert result["changed"] == [True, False, True], (rank, result)
        assert result["skipped"] == 1, (rank, result)
    assert results[0]["logs"] == [
        "WARNING: step 1: the gradients hold inf or nan (the loss of rank 1 was not finite): "
        "step skipped on every rank (1 skipped so far, 1 in a row)"
    ]
    assert results[1]["logs"] == []  # rank 0 says it once


def test_nonfinite_gradients_can_raise_at_once_or_after_skips_in_a_row(ranks):
    results = ranks(2).run(train_with_a_nan, 2, "fp32", (1,), action="raise", timeout=120)
    for result in results:
        assert result["changed"] == [True]
        assert result["error"] == (
            "step 1: the gradients hold inf or nan (the loss of rank 1 was not finite); "
            "nonfinite_gradients.action is raise"
        )
    results = ranks(2).run(train_with_a_nan, 1, "fp32", (1, 2), max_consecutive_skips=2)
    for result in results:
        assert result["changed"] == [True, False]
        assert "2 steps in a row were skipped" in result["error"]
        assert "nonfinite_gradients.max_consecutive_skips=2" in result["error"]


def train_with_huge_finite_gradients() -> list:
    """Gradients around 1e20 are finite: fp32 sums of their squares overflow, the check must
    not read that as inf (clipping then scales the step down as usual)."""
    engine, *_ = zerolap.initialize(model=make_model(), config=_config(2, "fp32"))
    rank = dist.get_rank()
    tokens, targets = global_batch(0, MICRO * dist.get_world_size())
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    before = _params(engine)
    engine.backward(loss_fn(engine(tokens[mine]), targets[mine]) * 1e20)
    engine.step()
    after = _params(engine)
    result = [engine.skipped_steps, engine.get_global_grad_norm() > 1e19]
    result.append(all(torch.isfinite(p).all() for p in after))
    result.append(any(not torch.equal(a, b) for a, b in zip(after, before, strict=True)))
    engine.destroy()
    return result


def test_huge_but_finite_gradients_are_not_skipped(ranks):
    assert ranks(2).run(train_with_huge_finite_gradients) == [[0, True, True, True]] * 2
