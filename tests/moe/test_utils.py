"""``deepspeed.moe.utils`` on zerolap: expert parameters (marked as DeepSpeed's MoE layer marks
them) split into optimizer groups of their own, trained by the engine exactly as one process
trains the same groups; the expert-parallel size read from DeepSpeed's mark."""

from __future__ import annotations

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.zero.models import global_batch, loss_fn, make_model
from zerolap.moe.parallel import expert_parallel_size
from zerolap.moe.utils import (
    configure_moe_param_groups,
    is_moe_param,
    is_moe_param_group,
    split_params_into_different_moe_groups_for_optimizer,
)
from zerolap.zero import GatheredParameters

TIMEOUT = 90.0
MICRO = 2


def _experts(model: torch.nn.Module, ep_size: int = 1) -> torch.nn.Module:
    """``hidden`` and ``sometimes`` marked as experts of two expert groups."""
    for module, group in ((model.hidden, 1), (model.sometimes, 2)):
        for param in module.parameters():
            param.allreduce = False
            param.group_name = f"ep_size_{ep_size}" if group == 1 else f"ep_size_{ep_size}_b"
    return model


def _groups(model: torch.nn.Module) -> list[dict]:
    groups = [{"params": list(model.parameters()), "name": "dense", "weight_decay": 0.01}]
    return split_params_into_different_moe_groups_for_optimizer(groups)


def test_expert_parameters_move_into_groups_of_their_own():
    model = _experts(make_model())
    groups = _groups(model)
    assert [(g["name"], g.get("moe", False)) for g in groups] == [
        ("dense", False),
        ("ep_size_1", True),
        ("ep_size_1_b", True),
    ]
    assert all(g["weight_decay"] == 0.01 for g in groups)  # copied from the parent group
    assert [len(g["params"]) for g in groups] == [3, 2, 2]  # embed (tied), norm x2; each Linear
    assert not any(is_moe_param(p) for p in groups[0]["params"])
    assert [is_moe_param_group(g) for g in groups] == [False, True, True]


def test_expert_groups_are_split_at_max_group_size():
    model = _experts(make_model())
    groups = [{"params": list(model.parameters()), "name": "dense"}]
    groups = split_params_into_different_moe_groups_for_optimizer(groups, max_group_size=24 * 24)
    sizes = [[p.numel() for p in g["params"]] for g in groups if g["name"] == "ep_size_1"]
    assert sizes == [[24 * 24], [24]]  # the weight fills a group; the bias starts the next


def test_groups_without_experts_come_back_as_a_list():
    model = make_model()
    group = {"params": list(model.parameters()), "name": "dense"}
    assert split_params_into_different_moe_groups_for_optimizer((group,)) == [group]
    assert configure_moe_param_groups(list(model.parameters()))[0]["name"] == "dense-params"
    with pytest.raises(ValueError, match="param groups must be"):
        split_params_into_different_moe_groups_for_optimizer(iter([group]))


def test_the_expert_parallel_size_is_read_from_the_mark():
    model = _experts(make_model(), ep_size=2)
    assert expert_parallel_size(model.hidden.weight) == 2
    assert expert_parallel_size(model.sometimes.weight) == 1  # "ep_size_2_b": not DeepSpeed's
    assert expert_parallel_size(model.out.weight) == 1  # not an expert


def _reference(steps: int, world: int) -> list[torch.Tensor]:
    model = _experts(make_model())
    optimizer = torch.optim.AdamW(_groups(model), lr=0.05)
    for step in range(steps):
        tokens, targets = global_batch(step, MICRO * world)
        optimizer.zero_grad()
        loss_fn(model(tokens), targets).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def check_moe_groups(stage: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
    }
    refused = None
    if stage == 3:
        try:
            zerolap.initialize(model=_experts(make_model(), ep_size=2), config=config)
        except NotImplementedError as error:
            refused = str(error)
    model = _experts(make_model())
    engine, optimizer, *_ = zerolap.initialize(
        model=model, model_parameters=_groups(model), config=config
    )
    for step in range(3):
        tokens, targets = global_batch(step, MICRO * world)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(loss_fn(engine(tokens[mine]), targets[mine]))
        engine.step()
    params = list(model.parameters())
    with GatheredParameters(params):
        trained = [p.detach().clone() for p in params]
    diff = max(
        (a - b).abs().max().item() for a, b in zip(trained, _reference(3, world), strict=True)
    )
    return {
        "refused": refused,
        "groups": [(g["name"], g.get("moe", False)) for g in optimizer.param_groups],
        "diff": diff,
    }


@pytest.mark.parametrize("stage", [1, 3])
def test_expert_groups_train_as_one_process(ranks, stage):
    for result in ranks(2).run(check_moe_groups, stage, timeout=TIMEOUT):
        if stage == 3:
            assert "MoE ep_size=2 with ZeRO stage 3" in result["refused"]
        assert result["groups"] == [("dense", False), ("ep_size_1", True), ("ep_size_1_b", True)]
        assert result["diff"] < 1e-5


def config_groups() -> list:
    """A ds_config optimizer over a model with experts: DeepSpeed's groups (the experts in a
    group of their own), whether the client passed parameters or named groups."""
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
    }
    seen = []
    for given in ("params", "groups"):
        model = _experts(make_model())
        passed = (
            list(model.parameters())
            if given == "params"
            else [{"params": list(model.parameters()), "name": "mine"}]
        )
        engine, optimizer, *_ = zerolap.initialize(
            model=model, model_parameters=passed, config=config
        )
        seen.append([(g["name"], g.get("moe", False)) for g in optimizer.param_groups])
        engine.destroy()
    return seen


def test_a_ds_config_optimizer_puts_experts_in_groups_of_their_own(ranks):
    for seen in ranks(1).run(config_groups, timeout=TIMEOUT):
        assert seen == [
            [("dense-params", False), ("ep_size_1", True), ("ep_size_1_b", True)],
            [("mine", False), ("ep_size_1", True), ("ep_size_1_b", True)],
        ]
