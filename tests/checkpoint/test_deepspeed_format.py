"""Checkpoints written by real DeepSpeed 0.19.8 (``deepspeed_0_19_8/``, made by its
``generate.py``) resumed by zerolap: after ``load_checkpoint`` the next training step must give
DeepSpeed's own next-step loss and parameters, at the stage it was saved at, at another stage
and on another number of ranks; and ``zero_to_fp32`` must rebuild the fp32 weights DeepSpeed
held. DeepSpeed's fused Adam and torch's differ in the last bits, hence the tolerances."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.checkpoint.deepspeed_0_19_8.model import (
    CASES,
    MICRO,
    STEPS,
    TinyNet,
    batch,
    build_model,
    ds_config,
    param_groups,
)
from zerolap.utils import safe_get_full_fp32_param
from zerolap.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

HERE = Path(__file__).resolve().parent / "deepspeed_0_19_8"
TIMEOUT = 90.0


def _expected(case: str) -> dict:
    return torch.load(HERE / case / "expected.pt", weights_only=True)


def resume_and_step(case: str, stage: int) -> dict:
    """Load ``case`` at ``stage`` on this job's ranks and take the next step on the batch the
    DeepSpeed run used (split over however many ranks there are now)."""
    _, saved_world, bf16, two_groups = CASES[case]
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    config = ds_config(stage, world, bf16)
    config["train_micro_batch_size_per_gpu"] = MICRO * saved_world // world
    config["train_batch_size"] = MICRO * saved_world
    engine, *_ = zerolap.initialize(
        model=model, model_parameters=param_groups(model, two_groups), config=config
    )
    path, client_state = engine.load_checkpoint(str(HERE / case / "ckpt"))
    steps_loaded = engine.global_steps
    pieces = [batch(STEPS + 1, r) for r in range(saved_world)]
    per_rank = saved_world // world
    mine = pieces[rank * per_rank : (rank + 1) * per_rank]
    x, y = torch.cat([p[0] for p in mine]), torch.cat([p[1] for p in mine])
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    mean = loss.detach().float().reshape(1)
    dist.all_reduce(mean, op="avg")
    params = {
        n: safe_get_full_fp32_param(p) for n, p in model.named_parameters() if p.requires_grad
    }
    return {
        "loss": mean.item(),
        "params": params,
        "client_state": client_state,
        "steps": (steps_loaded, engine.global_steps),
        "path": path,
    }


def _check(result: dict, case: str, tolerance: float) -> None:
    want = _expected(case)
    assert abs(result["loss"] - want["next_loss"]) < tolerance
    for name, value in want["params_after"].items():
        if value is not None:
            assert (result["params"][name] - value).abs().max().item() < tolerance, name
    assert result["client_state"]["client_key"] == 7
    assert result["steps"] == (STEPS, STEPS + 1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_deepspeed_checkpoint_resumes_at_its_stage(ranks, case):
    stage, world, bf16, _ = CASES[case]
    tolerance = 2e-3 if bf16 else 1e-5
    for result in ranks(world).run(resume_and_step, case, stage, timeout=TIMEOUT):
        _check(result, case, tolerance)


@pytest.mark.parametrize(("case", "stage", "world"), [("s3_ws2", 1, 1), ("s1_ws2", 3, 2)])
def test_a_deepspeed_checkpoint_resumes_at_another_stage_and_size(ranks, case, stage, world):
    for result in ranks(world).run(resume_and_step, case, stage, timeout=TIMEOUT):
        _check(result, case, 1e-5)


@pytest.mark.parametrize("case", ["s1_ws2", "s2_ws2", "s3_ws2", "s3_ws2_2g", "s0_ws2"])
def test_zero_to_fp32_rebuilds_deepspeeds_weights(case):
    state = get_fp32_state_dict_from_zero_checkpoint(HERE / case / "ckpt")
    plain = TinyNet()
    plain.load_state_dict(state, strict=True)  # tied head, frozen parameter and buffer too
    for name, value in _expected(case)["saved_params"].items():
        assert torch.equal(state[name], value), name


def test_deepspeeds_pipeline_layout_is_named_not_misread(tmp_path):
    # DeepSpeed's pipeline engine saves its weights per layer and ``module: None`` in the
    # model states; reading those as a plain engine's failed on the None.
    from zerolap.checkpoint import CheckpointError
    from zerolap.checkpoint.deepspeed_format import read_deepspeed

    torch.save({"module": None, "ds_version": "0.19.8"}, tmp_path / "mp_rank_00_model_states.pt")
    for layer in range(3):
        torch.save({"weight": torch.zeros(2)}, tmp_path / f"layer_{layer:02d}-model_states.pt")
    with pytest.raises(CheckpointError, match="is a DeepSpeed pipeline checkpoint"):
        read_deepspeed(tmp_path)
