"""Expert parallelism: ``MoE(ep_size > 1)`` spreads the experts over ranks. The spread layer
computes what one layer holding every expert does and moves the formula's bytes; a model with
two MoE layers trains at ZeRO stages 0-2 as one process with every expert does (each rank's
micro-batch routed as that rank routes it), within the memory formula; its checkpoint resumes
at another expert-parallel size and consolidates to the model with every expert; an expert may
be frozen where it is held; and what zerolap does not run is refused by name."""

from __future__ import annotations

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.moe.test_layer import GAS, MICRO, Expert, MoEModel, _batch, _groups, _reference
from zerolap.checkpoint.consolidate import get_fp32_state_dict
from zerolap.comm.logger import COMMS_LOGGER
from zerolap.moe.gating import capacity
from zerolap.moe.layer import MoE
from zerolap.moe.parallel import global_expert_names, set_up_expert_parallelism
from zerolap.topology import build_mesh
from zerolap.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint

TIMEOUT = 120.0


def _layer(ep_size: int, k: int, drop: bool, first: int = 0) -> MoE:
    """A layer of 4 experts of width 8 whose capacity drops no token (``drop`` or not); its
    experts are global experts ``first, first + 1, ...``, each with weights of its own."""
    torch.manual_seed(0)
    layer = MoE(
        8, Expert(8), 4, ep_size, k=k, capacity_factor=4.0, drop_tokens=drop, use_rts=False,
        top2_2nd_expert_sampling=False,
    )  # fmt: skip
    for local, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
        torch.manual_seed(100 + first + local)
        for param in expert.parameters():
            param.data = torch.randn_like(param)
    return layer


def _tokens(rank: int) -> torch.Tensor:
    # Sizes differ between ranks: each routes its own, and capacity is agreed over the group.
    return torch.randn(3 + rank, 5, 8, generator=torch.Generator().manual_seed(rank))


def exchange(k: int, drop: bool) -> float:
    """The spread layer's output, input gradient and expert gradients against one layer with
    every expert run on each rank's tokens (an expert's gradient sums every rank's tokens):
    the largest difference relative to the tensor's largest element."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def apart(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max()).item()

    layer = _layer(world, k, drop, first=rank * (4 // world))
    set_up_expert_parallelism(layer, build_mesh(), stage=0)
    tokens = _tokens(rank).requires_grad_()
    dist.configure(enabled=True, prof_all=True)
    COMMS_LOGGER.reset()
    out, _, _ = layer(tokens)
    (out * out).sum().backward()
    exchanged = [r for r in COMMS_LOGGER.records if r.op == "all_to_all_single"]
    dist.configure(enabled=False)
    # Two all-to-alls forward, two backward, each of the [experts, capacity, width] buffers,
    # capacity the largest over the ranks (the busiest expert's count, or the capacity of the
    # rank with the most tokens); a rank keeps its own block, so (ranks - 1) / ranks of each
    # goes on the wire.
    if drop:
        room = torch.tensor([capacity(tokens.shape[0] * 5, 4, k * 4.0, 4)])
    else:
        room = layer.deepspeed_moe.exp_counts.max().reshape(1)
    dist.all_reduce(room, op=dist.ReduceOp.MAX)
    buffer_bytes = 4 * int(room) * 8 * 4
    assert [r.message_bytes for r in exchanged] == [buffer_bytes] * 4
    assert [r.wire_bytes for r in exchanged] == [buffer_bytes * (world - 1) // world] * 4
    worst = 0.0
    whole = _layer(1, k, drop)
    for r in range(world):
        theirs = _tokens(r).requires_grad_()
        expected, _, _ = whole(theirs)
        (expected * expected).sum().backward()
        if r == rank:
            worst = max(worst, apart(out, expected), apart(tokens.grad, theirs.grad))
    held = layer.deepspeed_moe.experts.deepspeed_experts
    everyone = whole.deepspeed_moe.experts.deepspeed_experts
    for local, expert in enumerate(held):
        mine = everyone[rank * (4 // world) + local]
        for a, b in zip(expert.parameters(), mine.parameters(), strict=True):
            worst = max(worst, apart(a.grad, b.grad))
    return worst


@pytest.mark.parametrize(("k", "drop"), [(1, False), (2, False), (1, True), (2, True)])
def test_a_spread_layer_computes_what_one_layer_with_every_expert_does(ranks, k, drop):
    for difference in ranks(2).run(exchange, k, drop, timeout=TIMEOUT):
        assert difference < 1e-5


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
        "zero_allow_untested_optimizer": True,
    }


def _train(engine, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        tokens, targets = _batch(step, MICRO * GAS * world)
        for micro in range(GAS):
            part = micro * world + rank
            mine = slice(part * MICRO, (part + 1) * MICRO)
            engine.backward(engine(tokens[mine], targets[mine]))
            engine.step()


def _difference(model, steps: int) -> float:
    """Largest relative difference of ``model``'s parameters (experts by their global names)
    from the one-process reference after ``steps`` steps."""
    reference = MoEModel()
    trained = _reference(steps, dist.get_world_size())
    for param, value in zip(reference.parameters(), trained, strict=True):
        param.data = value
    expected = reference.state_dict()
    names = global_expert_names(model)
    worst = 0.0
    for key, value in model.state_dict().items():
        want = expected[names.get(key, key)]
        worst = max(worst, ((value - want).abs().max() / want.abs().max()).item())
    return worst


def train_spread(stage: int, ep_size: int) -> dict:
    model = MoEModel(ep_size)
    optimizer = torch.optim.AdamW(_groups(model), lr=0.02)
    engine, *_ = zerolap.initialize(model=model, optimizer=optimizer, config=_config(stage))
    _train(engine, range(3))
    local = model.moe1.deepspeed_moe.experts.deepspeed_experts
    memory = engine.memory_breakdown()
    return {
        "memory": memory.total_bytes / memory.expected_bytes,
        "difference": _difference(model, 3),
        "local_experts": len(local),
        "first": model.moe1.deepspeed_moe.experts.first_expert,
        "norm": engine.get_global_grad_norm(),
    }


@pytest.mark.parametrize(
    ("stage", "world", "ep_size"), [(0, 2, 2), (1, 2, 2), (2, 2, 2), (2, 4, 2)]
)
def test_experts_spread_over_ranks_train_as_one_process(ranks, stage, world, ep_size):
    results = ranks(world).run(train_spread, stage, ep_size, timeout=TIMEOUT)
    for rank, result in enumerate(results):
        assert result["difference"] < 1e-5, (rank, result)
        # Experts sharded over world / ep_size ranks, the rest over all (padding aside).
        assert result["memory"] == pytest.approx(1.0, abs=0.02), (rank, result)
        assert result["local_experts"] == 4 // ep_size
        assert result["first"] == rank % ep_size * (4 // ep_size)
    assert len({r["norm"] for r in results}) == 1  # one global norm, the same everywhere


def resume_at_another_size(tmp: str, stage: int, saved: int, loaded: int) -> tuple[float, float]:
    """Two steps at expert-parallel size ``saved``, saved; resumed at size ``loaded`` (ZeRO 1),
    one more step: equal to three uninterrupted steps of the reference. And the checkpoint
    consolidated: the state dict of the model with every expert in one process, after two."""
    model = MoEModel(saved)
    engine, *_ = zerolap.initialize(
        model=model,
        optimizer=torch.optim.AdamW(_groups(model), lr=0.02),
        config=_config(stage),
    )
    _train(engine, range(2))
    engine.save_checkpoint(tmp, tag="two")
    engine.save_16bit_model(tmp, "whole.pt")  # rank 0 writes every expert, by global index
    whole = MoEModel(1)
    whole.load_state_dict(get_fp32_state_dict(tmp, "two"), strict=True)
    reference = _reference(2, dist.get_world_size())
    consolidated = max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(whole.parameters(), reference, strict=True)
    )
    if dist.get_rank() == 0:
        written = MoEModel(1)
        written.load_state_dict(torch.load(f"{tmp}/whole.pt", weights_only=True), strict=True)
        for a, b in zip(written.parameters(), whole.parameters(), strict=True):
            consolidated = max(consolidated, (a - b).abs().max().item())
    # Into a model spread over ranks, each rank takes its own experts.
    spread = MoEModel(2)
    set_up_expert_parallelism(spread, build_mesh(), stage=0)
    load_state_dict_from_zero_checkpoint(spread, tmp, "two")
    names = global_expert_names(spread)
    expected = whole.state_dict()
    for key, value in spread.state_dict().items():
        consolidated = max(consolidated, (value - expected[names.get(key, key)]).abs().max().item())
    model = MoEModel(loaded)
    engine, *_ = zerolap.initialize(
        model=model, optimizer=torch.optim.AdamW(_groups(model), lr=0.02), config=_config(1)
    )
    engine.load_checkpoint(tmp, tag="two")
    _train(engine, range(2, 3))
    return _difference(model, 3), consolidated


@pytest.mark.parametrize(("stage", "saved", "loaded"), [(0, 2, 1), (2, 2, 1), (2, 1, 2)])
def test_a_checkpoint_resumes_at_another_expert_parallel_size(
    ranks, tmp_path, stage, saved, loaded
):
    for resumed, consolidated in ranks(2).run(
        resume_at_another_size, str(tmp_path), stage, saved, loaded, timeout=TIMEOUT
    ):
        assert resumed < 1e-5
        assert consolidated < 1e-6


def refusals() -> list[str]:
    said = []
    unmarked = MoEModel(2)
    unmarked.moe2.deepspeed_moe.experts.deepspeed_experts[1].up.bias.group_name = None
    for model, stage in ((MoEModel(2), 3), (unmarked, 0)):
        try:
            set_up_expert_parallelism(model, build_mesh(), stage=stage)
        except (NotImplementedError, ValueError) as err:
            said.append(str(err))
    try:
        build_mesh().expert_groups(3)
    except ValueError as err:
        said.append(str(err))
    return said


def test_what_expert_parallelism_does_not_run_is_refused_by_name(ranks):
    for said in ranks(2).run(refusals, timeout=TIMEOUT):
        assert "MoE ep_size=2 with ZeRO stage 3" in said[0]
        assert (
            "expert parameter moe2.deepspeed_moe.experts.deepspeed_experts.1.up.bias of a MoE "
            "layer with ep_size=2 is marked group_name=None"
        ) in said[1]
        assert "MoE ep_size=3 does not divide the data-parallel size 2" in said[2]


def freeze_one_expert() -> tuple[str, bool]:
    """Global expert 2 of the first layer frozen: local expert 0 of the ranks at place 1 of
    their expert-parallel group. Frozen on rank 1 alone (rank 3 holds the same experts), the
    job is refused; frozen on both, it trains with that expert unchanged."""
    rank = dist.get_rank()

    def build(frozen_on: set[int]):
        model = MoEModel(2)
        expert = model.moe1.deepspeed_moe.experts.deepspeed_experts[0]
        if rank in frozen_on:
            expert.requires_grad_(False)
        return model, expert

    said = ""
    try:
        model, _ = build({1})
        zerolap.initialize(
            model=model, optimizer=torch.optim.AdamW(_groups(model)), config=_config(2)
        )
    except zerolap.config.ConfigError as err:
        said = str(err)
    model, expert = build({1, 3})
    before = [p.detach().clone() for p in expert.parameters()]
    engine, *_ = zerolap.initialize(
        model=model, optimizer=torch.optim.AdamW(_groups(model), lr=0.02), config=_config(2)
    )
    _train(engine, range(2))
    kept = all(torch.equal(a, b) for a, b in zip(before, expert.parameters(), strict=True))
    return said, kept


def test_an_expert_frozen_where_it_is_held_trains_and_a_mismatch_is_named(ranks):
    for rank, (said, kept) in enumerate(ranks(4).run(freeze_one_expert, timeout=TIMEOUT)):
        assert (
            "the experts differ at parameter moe1.deepspeed_moe.experts.deepspeed_experts.0.up."
            "weight: rank 1 has shape (16, 8) float32 (frozen), rank 3, which holds the same "
            "experts, has shape (16, 8) float32"
        ) in said
        assert kept == (rank in (1, 3))  # the others train their expert 0 (global 0)
