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
from tests.checkpoint.deepspeed_0_19_8 import moe_model, pipe_model
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


def resume_and_step(case: str, stage: int, folder=None, tag=None, universal=False) -> dict:
    """Load ``case`` (from ``folder`` if given; ``tag``; ``universal``: with ds_config's
    ``checkpoint.load_universal``) at ``stage`` on this job's ranks and take the next step on
    the batch the DeepSpeed run used (split over however many ranks there are now)."""
    _, saved_world, bf16, two_groups = CASES[case]
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    config = ds_config(stage, world, bf16)
    config["train_micro_batch_size_per_gpu"] = MICRO * saved_world // world
    config["train_batch_size"] = MICRO * saved_world
    config["checkpoint"] = {"load_universal": universal}
    engine, *_ = zerolap.initialize(
        model=model, model_parameters=param_groups(model, two_groups), config=config
    )
    path, client_state = engine.load_checkpoint(str(folder or HERE / case / "ckpt"), tag)
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


def resume_pipeline(case: str, stages: int, zero_stage: int, folder=None, **load) -> dict:
    """Load pipeline ``case`` (from ``folder`` if given) as ``stages`` stages over this job's
    ranks and train the next batch on the micro-batches the DeepSpeed run used (each
    data-parallel rank now takes those of the saved ranks it stands for). A CheckpointError
    comes back as its message."""
    import zerolap.pipe as pipe
    from zerolap.checkpoint import CheckpointError

    _, _, saved_dp, client = pipe_model.CASES[case]
    dp = dist.get_world_size() // stages
    model = pipe_model.build_model(pipe, stages)
    config = pipe_model.ds_config(zero_stage, saved_dp, client)
    config["gradient_accumulation_steps"] = pipe_model.MICRO_BATCHES * saved_dp // dp
    engine, *_ = zerolap.initialize(
        model=model,
        model_parameters=model.parameters(),
        optimizer=pipe_model.client_optimizer(model) if client else None,
        config=config,
    )
    try:
        _, client_state = engine.load_checkpoint(str(folder or HERE / case / "ckpt"), **load)
    except CheckpointError as err:
        return {"error": str(err)}
    steps_loaded = engine.global_steps
    per = saved_dp // dp
    first = engine.grid.get_data_parallel_rank() * per
    data = [
        pipe_model.micro_batch(STEPS + 1, m, d)
        for d in range(first, first + per)
        for m in range(pipe_model.MICRO_BATCHES)
    ]
    loss = engine.train_batch(iter(data)).item()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(
        every, {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    )
    params = {n: v for found in every for n, v in found.items()}
    return {
        "loss": loss,
        "params": params,
        "client_state": client_state,
        "steps": (steps_loaded, engine.global_steps),
    }


def _check_pipeline(result: dict, case: str) -> None:
    want = torch.load(HERE / case / "expected.pt", weights_only=True)
    assert abs(result["loss"] - want["next_loss"]) < 1e-5
    assert set(result["params"]) == set(want["params_after"])
    for name, value in want["params_after"].items():
        assert (result["params"][name] - value).abs().max().item() < 1e-5, name
    assert result["client_state"]["client_key"] == 7
    assert result["steps"] == (STEPS, STEPS + 1)


@pytest.mark.parametrize(
    ("case", "world", "stages", "zero_stage"),
    [
        ("pipe_s0_p2", 2, 2, 0),  # as saved: each stage's optimizer named by its layers
        ("pipe_s0_p2", 1, 1, 0),  # one process: both stages' entries, tied head once
        ("pipe_s1_p2_d2", 4, 2, 1),  # as saved: 2 stages x 2 data-parallel, ZeRO-1
        ("pipe_s1_p2_d2", 2, 1, 1),  # ZeRO-1 shards of both stages, into one stage on 2 ranks
        ("pipe_s1_p2_d2", 4, 4, 0),  # 4 stages, without ZeRO
    ],
)
def test_a_deepspeed_pipeline_checkpoint_resumes(ranks, case, world, stages, zero_stage):
    for result in ranks(world).run(resume_pipeline, case, stages, zero_stage, timeout=TIMEOUT):
        _check_pipeline(result, case)


def _copy(case: str, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(HERE / case / "ckpt", tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_megatrons_layer_file_names_load(ranks, tmp_path):
    # Megatron-DeepSpeed's topology names a model axis even of size 1.
    ckpt = _copy("pipe_s0_p2", tmp_path)
    for path in (ckpt / "global_step3").glob("layer_*"):
        path.rename(path.with_name(path.name.replace("-model_states", "-model_00-model_states")))
    for result in ranks(2).run(resume_pipeline, "pipe_s0_p2", 2, 0, ckpt, timeout=TIMEOUT):
        _check_pipeline(result, "pipe_s0_p2")


def test_a_pipeline_stage_whose_optimizer_cannot_be_named_is_refused(ranks, tmp_path):
    # Stage 1's client had split its parameters into two groups, and this one does not: its
    # Adam state cannot be told apart, so loading it is refused on every rank (rank 0's stage
    # is named) rather than leaving stage 1's parameters with fresh state.
    ckpt = _copy("pipe_s0_p2", tmp_path)
    path = ckpt / "global_step3" / "mp_rank_01_model_states.pt"
    states = torch.load(path, weights_only=False)
    group = states["optimizer"]["param_groups"][0]
    states["optimizer"]["param_groups"] = [
        {**group, "params": group["params"][:2]},
        {**group, "params": group["params"][2:]},
    ]
    torch.save(states, path)
    results = ranks(2).run(resume_pipeline, "pipe_s0_p2", 2, 0, ckpt, timeout=TIMEOUT)
    for result in results:
        assert result["error"].startswith("rank 1: the optimizer state of ['4.fc.bias'")
        assert "cannot be named: mp_rank_00_model_states.pt (pipeline stage 0" in result["error"]
        assert (
            "mp_rank_01_model_states.pt (pipeline stage 1: its entries fit no cut"
            in (result["error"])
        )
    results = ranks(2).run(
        resume_pipeline, "pipe_s0_p2", 2, 0, ckpt, load_optimizer_states=False, timeout=TIMEOUT
    )
    want = torch.load(HERE / "pipe_s0_p2" / "expected.pt", weights_only=True)
    for result in results:  # the weights alone: the next loss is DeepSpeed's
        assert abs(result["loss"] - want["next_loss"]) < 1e-5


def test_a_pipeline_checkpoint_missing_a_stage_is_refused(tmp_path):
    from zerolap.checkpoint import CheckpointError
    from zerolap.checkpoint.deepspeed_format import read_deepspeed

    ckpt = _copy("pipe_s1_p2_d2", tmp_path) / "global_step3"
    (ckpt / "mp_rank_01_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="2 stages needs mp_rank_00 to mp_rank_01"):
        read_deepspeed(ckpt)
    source = HERE / "pipe_s1_p2_d2" / "ckpt" / "global_step3" / "mp_rank_01_model_states.pt"
    (ckpt / "mp_rank_01_model_states.pt").write_bytes(source.read_bytes())
    (ckpt / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"stage 1 .* has 1 optimizer files for 2"):
        read_deepspeed(ckpt)


@pytest.mark.parametrize("case", sorted(pipe_model.CASES))
def test_zero_to_fp32_names_a_pipeline_checkpoints_weights_by_layer(case):
    # Without the model, nothing says layer 0 is the tied embedding.
    state = get_fp32_state_dict_from_zero_checkpoint(HERE / case / "ckpt")
    saved = torch.load(HERE / case / "expected.pt", weights_only=True)["saved_params"]
    by_index = {n.replace("tied_modules.embed.", "0."): v for n, v in saved.items()}
    assert set(state) == {*by_index, "4.scale"}
    for name, value in by_index.items():
        assert torch.equal(state[name], value), name


def test_deepspeeds_pipeline_layout_with_tensor_parallel_pieces_is_named(tmp_path):
    from zerolap.checkpoint import CheckpointError
    from zerolap.checkpoint.deepspeed_format import read_deepspeed

    torch.save({"module": None, "ds_version": "0.19.8"}, tmp_path / "mp_rank_00_model_states.pt")
    for layer in range(3):
        path = tmp_path / f"layer_{layer:02d}-model_01-model_states.pt"
        torch.save({"weight": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match="pipeline checkpoint with tensor parallelism"):
        read_deepspeed(tmp_path)


def test_a_stage0_optimizer_layout_not_read_is_listed_unnamed(tmp_path):
    # DeepSpeed's unfused fp16 optimizer keeps an fp32 copy per parameter: not read, so its
    # file is listed and load_checkpoint refuses to step on without that state.
    from zerolap.checkpoint.deepspeed_format import LoadingModel, read_deepspeed

    ckpt = _copy("s0_ws2", tmp_path) / "global_step3"
    path = ckpt / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)
    states["optimizer"] = {"optimizer_state_dict": states["optimizer"], "fp32_groups": [[]]}
    torch.save(states, path)
    saved, shards = read_deepspeed(ckpt, LoadingModel(client_groups=[[("fc1.weight", True)]]))
    assert shards[0]["runs"] == []
    assert saved["unnamed"] == [
        "mp_rank_00_model_states.pt (an optimizer layout not read: DeepSpeed's unfused fp16 "
        "optimizer, an fp32 copy per parameter)"
    ]


def resume_moe(case: str, ep_size: int) -> dict:
    """Load the mixture-of-experts ``case`` with the experts spread over ``ep_size`` ranks here
    and take the next step on DeepSpeed's micro-batches (several per rank, accumulated, when
    there are fewer ranks now: each routed as DeepSpeed routed it)."""
    from zerolap.moe.layer import MoE
    from zerolap.moe.parallel import global_expert_names

    stage, saved_world = moe_model.CASES[case]
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = saved_world // world
    model = moe_model.MoENet(MoE, ep_size)
    config = moe_model.ds_config(stage) | {"gradient_accumulation_steps": micro}
    engine, *_ = zerolap.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.load_checkpoint(str(HERE / case / "ckpt"))
    total = torch.zeros(1)
    for part in range(micro):
        loss = engine(*moe_model.batch(moe_model.STEPS + 1, rank * micro + part))
        engine.backward(loss)
        engine.step()
        total += loss.detach()
    dist.all_reduce(total, op="avg")
    names = global_expert_names(model)
    params = {names.get(n, n): safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    return {"loss": total.item() / micro, "params": params}


@pytest.mark.parametrize(
    ("case", "world", "ep_size"),
    [("moe_s0_ep2", 2, 2), ("moe_s0_ep2", 2, 1), ("moe_s2_w4_ep2", 2, 2)],
)
def test_a_deepspeed_moe_checkpoint_resumes(ranks, case, world, ep_size):
    want = _expected(case)
    for result in ranks(world).run(resume_moe, case, ep_size, timeout=TIMEOUT):
        assert abs(result["loss"] - want["next_loss"]) < 1e-5
        assert result["params"].keys() <= want["params_after"].keys()
        for name, value in result["params"].items():
            assert (value - want["params_after"][name]).abs().max().item() < 1e-5, name


@pytest.mark.parametrize("case", sorted(moe_model.CASES))
def test_zero_to_fp32_rebuilds_a_deepspeed_moe_checkpoints_weights(case):
    from zerolap.moe.layer import MoE

    state = get_fp32_state_dict_from_zero_checkpoint(HERE / case / "ckpt")
    moe_model.MoENet(MoE, 1).load_state_dict(state, strict=True)  # every expert, one process
    for name, value in _expected(case)["saved_params"].items():
        assert torch.equal(state[name], value), name
