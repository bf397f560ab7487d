"""The engine as DeepSpeed's clients drive it (the Hugging Face Trainer, Accelerate, TRL):
engines without an optimizer, frozen models, the accumulation boundary decided from outside,
``backward(scale_wrt_gas=False)``, ``engine.config`` as the dict, ``destroy()``, a second
``initialize`` on the same model, the optimizer's DeepSpeed attributes, and per-parameter
access to sharded state (``safe_get_full_*``). Each result is checked against one process
doing the same arithmetic."""

from __future__ import annotations

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.logs import captured_logs
from tests.zero.models import global_batch, loss_fn, make_model
from zerolap.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
)
from zerolap.zero import GatheredParameters, ZeroParamStatus

TIMEOUT = 90.0
MICRO = 2
LR = 0.05


def _config(stage: int, *, optimizer: bool = True, gas: int = 1, **extra) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,  # the one-process references do not clip
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }
    if optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}
    return config


def _whole(params) -> list[torch.Tensor]:
    params = list(params)
    with GatheredParameters(params):
        return [p.detach().clone() for p in params]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


# -- engines without an optimizer ------------------------------------------------------------


def check_inference_engine(stage: int) -> dict:
    rank = dist.get_rank()
    model = make_model(seed=rank)  # every rank different: rank 0's weights must win
    model.norm.requires_grad_(False)
    engine, optimizer, loader, scheduler = zerolap.initialize(
        model=model, config=_config(stage, optimizer=False)
    )
    tokens, _ = global_batch(0, 4)
    with torch.no_grad():
        out = engine(tokens)
    reference = make_model(seed=0)
    params = list(engine.module.parameters())
    result = {
        "none": (optimizer, loader, scheduler, engine.optimizer) == (None, None, None, None),
        "out": (out - reference(tokens)).abs().max().item(),
        "values": _max_diff(_whole(params), reference.parameters()),
    }
    if stage == 3:
        result["sharded"] = all(
            p.numel() == 0
            and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
            and p.ds_numel == q.numel()
            and tuple(p.ds_shape) == tuple(q.shape)
            for p, q in zip(params, reference.parameters(), strict=True)
        )
        result["own"] = [p.ds_tensor.numel() for p in params]  # this rank's elements of each
        result["ids"] = len({p.ds_id for p in params}) == len(params)
        result["frozen_sharded"] = all(p.numel() == 0 for p in engine.module.norm.parameters())
    for name, call in (("backward", lambda: engine.backward(out.sum())), ("step", engine.step)):
        with pytest.raises(RuntimeError, match=rf"engine.{name}\(\) needs an optimizer"):
            call()
    return result


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_an_engine_without_optimizer_runs_forward_only(ranks, stage):
    results = ranks(2).run(check_inference_engine, stage, timeout=TIMEOUT)
    for result in results:
        assert result["none"]
        assert result["out"] == 0.0 and result["values"] == 0.0
        if stage == 3:
            assert result["sharded"] and result["ids"] and result["frozen_sharded"]
    if stage == 3:  # the ranks' ds_tensor pieces add up to each whole parameter
        numels = [p.numel() for p in make_model().parameters()]
        assert [a + b for a, b in zip(results[0]["own"], results[1]["own"], strict=True)] == numels


def check_frozen_model_with_optimizer_config(stage: int) -> dict:
    model = make_model().requires_grad_(False)
    with captured_logs() as logs:
        _, optimizer, _, _ = zerolap.initialize(model=model, config=_config(stage))
    return {
        "optimizer": optimizer,
        "logs": logs,
        "sharded": [p.numel() for p in model.parameters()],
    }


def test_a_frozen_model_gets_an_inference_engine(ranks):
    for result in ranks(2).run(check_frozen_model_with_optimizer_config, 3, timeout=TIMEOUT):
        assert result["optimizer"] is None
        assert any("no trainable parameter" in line for line in result["logs"])
        assert result["sharded"] == [0] * len(result["sharded"])


def reference_partly_frozen(steps: int, world: int) -> list[torch.Tensor]:
    model = make_model()
    model.embed.requires_grad_(False)  # tied to the output layer: frozen too
    model.norm.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.01)
    for step in range(steps):
        tokens, targets = global_batch(step, MICRO * world)
        opt.zero_grad()
        loss_fn(model(tokens), targets).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def check_partly_frozen_stage3(steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    model.embed.requires_grad_(False)
    model.norm.requires_grad_(False)
    config = _config(3)
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 0  # exact counts below
    live_in_backward = []
    # By the time the first Linear's gradient arrives, the output layer (the frozen tied
    # embedding) and the frozen norm have run their backward: their units must be gone.
    model.hidden.weight.register_post_accumulate_grad_hook(
        lambda p: live_in_backward.append(engine.param_store.live_numel())
    )
    engine, *_ = zerolap.initialize(model=model, config=config)
    dist.configure(enabled=True)
    dist.reset_log()
    for step in range(steps):
        tokens, targets = global_batch(step, MICRO * world)
        mine = slice(rank * MICRO, rank * MICRO + MICRO)
        engine.backward(loss_fn(engine(tokens[mine]), targets[mine]))
        engine.step()
    records = dist.COMMS_LOGGER.records
    reduced = sum(r.message_bytes for r in records if "reduce_scatter" in r.op)
    dist.configure(enabled=False)
    trainable = sum(p.ds_numel for p in model.parameters() if p.requires_grad)
    return {
        "params": _whole(model.parameters()),
        "live": live_in_backward,
        "hidden": model.hidden.weight.ds_numel + model.hidden.bias.ds_numel,
        "reduced_per_step": reduced / steps,
        "trainable_bytes": trainable * 4,
    }


def test_frozen_parameters_are_sharded_released_and_never_reduced_at_stage_3(ranks):
    steps = 3
    reference = reference_partly_frozen(steps, world=2)
    for result in ranks(2).run(check_partly_frozen_stage3, steps, timeout=TIMEOUT):
        assert _max_diff(result["params"], reference) < 1e-5
        assert result["live"] == [result["hidden"]] * steps
        # Only trainable units are reduce-scattered (each padded to a multiple of 2).
        assert result["trainable_bytes"] <= result["reduced_per_step"]
        assert result["reduced_per_step"] <= result["trainable_bytes"] + 4 * 2 * 8


# -- accumulation driven from outside --------------------------------------------------------


def _train(stage: int, *, external: bool, pre_divided: bool, steps: int = 2, gas: int = 2):
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = zerolap.initialize(model=make_model(), config=_config(stage, gas=gas))
    dist.configure(enabled=True)
    dist.reset_log()
    returned = []
    for step in range(steps):
        tokens, targets = global_batch(step, MICRO * gas * world)
        for micro in range(gas):
            lo = (micro * world + rank) * MICRO
            loss = loss_fn(engine(tokens[lo : lo + MICRO]), targets[lo : lo + MICRO])
            boundary = micro == gas - 1
            if external:  # Accelerate's order: boundary first, step() at the boundary only
                engine.set_gradient_accumulation_boundary(is_boundary=boundary)
            if pre_divided:  # the Trainer divides the loss itself
                back = engine.backward(loss / gas, scale_wrt_gas=False)
            else:
                back = engine.backward(loss)
            returned.append(abs(back.item() - loss.item() / gas))  # DeepSpeed returns loss / gas
            if boundary or not external:
                engine.step()
    collectives = len(dist.COMMS_LOGGER.records)
    dist.configure(enabled=False)
    return {
        "params": _whole(engine.module.parameters()),
        "steps": engine.global_steps,
        "collectives": collectives,
        "returned": returned,
    }


def check_external_boundary(stage: int) -> dict:
    counted = _train(stage, external=False, pre_divided=False)
    accelerate = _train(stage, external=True, pre_divided=False)
    trainer = _train(stage, external=True, pre_divided=True)
    return {"counted": counted, "accelerate": accelerate, "trainer": trainer}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_boundary_can_be_decided_from_outside(ranks, stage):
    for result in ranks(2).run(check_external_boundary, stage, timeout=TIMEOUT):
        counted = result["counted"]
        for other in (result["accelerate"], result["trainer"]):
            assert _max_diff(other["params"], counted["params"]) < 1e-6
            assert other["steps"] == counted["steps"] == 2
            assert other["collectives"] == counted["collectives"]  # no extra reduction
        for run in result.values():
            assert max(run["returned"]) < 1e-6


def check_boundary_decides_reduction() -> int:
    """Stage 0 reduces only at the boundary the client names, whatever the counter says."""
    engine, *_ = zerolap.initialize(model=make_model(), config=_config(0, gas=4))
    tokens, targets = global_batch(0, MICRO)
    dist.configure(enabled=True)
    dist.reset_log()
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(loss_fn(engine(tokens), targets))
    quiet = len(dist.COMMS_LOGGER.records)
    engine.set_gradient_accumulation_boundary(True)  # the counter would say micro-step 2 of 4
    engine.backward(loss_fn(engine(tokens), targets))
    engine.step()
    reduced = len(dist.COMMS_LOGGER.records)
    dist.configure(enabled=False)
    return quiet, reduced, engine.global_steps


def test_stage_0_reduces_exactly_at_the_boundary_it_is_told(ranks):
    for quiet, reduced, steps in ranks(2).run(check_boundary_decides_reduction, timeout=TIMEOUT):
        assert quiet == 0 and reduced > 0 and steps == 1


# -- engine.config, device, precision, optimizer attributes ------------------------------------


def check_accessors() -> dict:
    config = _config(2, bf16={"enabled": True}, steps_per_print=float("inf"))
    model = make_model()
    engine, optimizer, *_ = zerolap.initialize(model=model, config_params=config)
    return {
        "same_dict": engine.config is config,
        "stage": engine.config["zero_optimization"]["stage"],
        "get": engine.config.get("fp16", {}).get("enabled", False),
        "device": str(engine.device),
        "bf16": (engine.bfloat16_enabled(), engine.fp16_enabled()),
        "dtype": {p.dtype for p in model.parameters()},
        "overflow": optimizer.overflow,
        "scales": (optimizer.cur_scale, optimizer.loss_scale),
        "isinstance": isinstance(engine, zerolap.DeepSpeedEngine),
        "optimizer_name": engine.optimizer_name(),
        "dp_group": engine.data_parallel_group is dist.get_world_group(),
    }


def test_engine_accessors_as_clients_read_them(ranks):
    for result in ranks(2).run(check_accessors, timeout=TIMEOUT):
        assert result["same_dict"] and result["stage"] == 2 and result["get"] is False
        assert result["device"] == "cpu" and result["bf16"] == (True, False)
        assert result["dtype"] == {torch.bfloat16}  # initialize cast the model
        assert result["overflow"] is False and result["scales"] == (1.0, 1.0)
        assert result["isinstance"] and result["dp_group"]
        assert result["optimizer_name"] == "adamw"  # built from the ds_config: its type


def check_client_optimizer_name() -> str:
    model = make_model()
    engine, *_ = zerolap.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=_config(1)
    )
    return engine.optimizer_name()


def test_optimizer_name_of_a_client_optimizer_is_its_class(ranks):
    assert ranks(2).run(check_client_optimizer_name, timeout=TIMEOUT) == ["SGD", "SGD"]


def check_throughput_timer(enabled: bool) -> dict:
    config = _config(1, steps_per_print=2, timers={"throughput": {"enabled": enabled}})
    engine, *_ = zerolap.initialize(model=make_model(), config=config)
    timer = engine.tput_timer
    with captured_logs() as logs:
        for _epoch in range(2):
            for step in range(3):
                tokens, targets = global_batch(step, MICRO)
                engine.backward(loss_fn(engine(tokens), targets))
                engine.step()
            counts = (timer.epoch_count, timer.micro_step_count, timer.global_step_count)
            timer.update_epoch_count()
    return {
        "counts": counts,
        "after_epoch": (timer.epoch_count, timer.micro_step_count),
        "rate": timer.avg_samples_per_sec(),
        "batch": timer.batch_size,
        "reports": [line for line in logs if "RunningAvgSamplesPerSec" in line],
    }


def test_the_throughput_timer_counts_micro_and_optimizer_steps_and_reports(ranks):
    first, second = ranks(2).run(check_throughput_timer, True, timeout=TIMEOUT)
    for result in (first, second):
        assert result["counts"] == (1, 3, 6) and result["after_epoch"] == (2, 0)
        assert result["batch"] == 2 * MICRO and 0 < result["rate"] < float("inf")
    # Steps 1-2 are not timed; rank 0 reports at steps 4 and 6 (every steps_per_print).
    assert [r.split("/", 2)[2].split(",")[0] for r in first["reports"]] == [
        "global_step=4",
        "global_step=6",
    ]
    assert second["reports"] == []


def test_a_disabled_throughput_timer_counts_nothing(ranks):
    for result in ranks(2).run(check_throughput_timer, False, timeout=TIMEOUT):
        assert result["counts"] == (1, 0, 0) and result["rate"] == float("-inf")
        assert result["reports"] == []


def check_fp16_overflow_flag() -> list[bool]:
    config = _config(2, fp16={"enabled": True, "initial_scale_power": 4})
    engine, optimizer, *_ = zerolap.initialize(model=make_model(), config=config)
    flags = []
    for poison in (False, True, False):
        tokens, targets = global_batch(0, MICRO)
        loss = loss_fn(engine(tokens), targets)
        engine.backward(loss * (float("inf") if poison else 1.0))
        engine.step()
        flags.append(optimizer.overflow)
    return flags


def test_optimizer_overflow_reports_a_skipped_fp16_step(ranks):
    assert ranks(2).run(check_fp16_overflow_flag, timeout=TIMEOUT) == [[False, True, False]] * 2


def check_optimizer_state_dict(stage: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()

    def trained(steps: int):
        engine, optimizer, *_ = zerolap.initialize(model=make_model(), config=_config(stage))
        for step in range(steps):
            tokens, targets = global_batch(step, MICRO * world)
            mine = slice(rank * MICRO, rank * MICRO + MICRO)
            engine.backward(loss_fn(engine(tokens[mine]), targets[mine]))
            engine.step()
        return engine, optimizer

    _, first = trained(2)
    saved = first.state_dict()
    _, second = trained(1)
    second.load_state_dict(saved)
    same = all(
        torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
        for a, b in zip(first.state.values(), second.state.values(), strict=True)
    )
    saved["runs"] = saved["runs"][1:]
    with pytest.raises(ValueError, match="saved for another layout"):
        second.load_state_dict(saved)
    return same


def test_optimizer_state_dict_round_trip(ranks):
    assert ranks(2).run(check_optimizer_state_dict, 2, timeout=TIMEOUT) == [True, True]


# -- destroy and a second initialize ------------------------------------------------------------


def _hooks_on(model: torch.nn.Module) -> int:
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
        for m in model.modules()
    ) + sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


def check_destroy(stage: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    engine, *_ = zerolap.initialize(model=model, config=_config(stage))
    tokens, targets = global_batch(0, MICRO * world)
    mine = slice(rank * MICRO, rank * MICRO + MICRO)
    engine.backward(loss_fn(engine(tokens[mine]), targets[mine]))
    engine.step()
    trained = _whole(model.parameters())
    engine.destroy()
    hooks = _hooks_on(model)
    # The bare model trains as a plain one: every .grad filled by autograd.
    loss_fn(model(tokens[mine]), targets[mine]).backward()
    return {
        "hooks": hooks,
        "whole": all(p.numel() > 0 and not hasattr(p, "ds_status") for p in model.parameters()),
        "values": _max_diff([p.detach() for p in model.parameters()], trained),
        "grads": all(p.grad is not None for p in model.parameters()),
        "dropped": engine.optimizer is None and engine.param_store is None,
    }


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_destroy_gives_the_model_back(ranks, stage):
    for result in ranks(2).run(check_destroy, stage, timeout=TIMEOUT):
        assert result["hooks"] == 0 and result["whole"] and result["grads"]
        assert result["values"] == 0.0 and result["dropped"]


def check_dropped_engine(stage: int) -> dict:
    """Engines dropped without destroy(), three times over one model: each dies with its
    last reference (gc collects nothing: no cycle through the model's hooks keeps it), its
    hooks come off, and the model trains on, bare or under a new engine."""
    import gc
    import weakref

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * MICRO, rank * MICRO + MICRO)
    model = make_model()
    warm_up, *_ = zerolap.initialize(model=make_model(), config=_config(stage))
    warm_up.backward(loss_fn(warm_up(global_batch(0, MICRO)[0]), global_batch(0, MICRO)[1]))
    warm_up.step()  # torch imports lazily; the frames of an import stay in cycles until gc
    warm_up.destroy()
    gc.collect()
    gc.disable()  # a leak must show without the cycle collector's help
    try:
        alive = []
        for step in range(3):
            engine, *_ = zerolap.initialize(model=model, config=_config(stage))
            tokens, targets = global_batch(step, MICRO * world)
            engine.backward(loss_fn(engine(tokens[mine]), targets[mine]))
            engine.step()
            # (stage 3's parameter store holds the model's shards: it lives on with them)
            parts = [engine, engine.optimizer, engine.reducer, engine.grads]
            refs = [weakref.ref(part) for part in parts]
            store = weakref.ref(engine.param_store)
            del engine, parts, _
            alive.append(sum(ref() is not None for ref in refs))
    finally:
        gc.enable()
    result = {"alive": alive, "hooks": _hooks_on(model)}
    if stage == 3:
        # Left sharded, as zero.Init leaves a model; GatheredParameters reads it.
        result["sharded"] = all(p.numel() == 0 for p in model.parameters())
    trained = _whole(model.parameters())
    if stage == 3:
        engine, *_ = zerolap.initialize(model=model, config=_config(stage, optimizer=False))
        engine.destroy()  # gathers the model whole again
        del engine, _
    result["store"] = store() is not None
    tokens, targets = global_batch(3, MICRO * world)
    loss_fn(model(tokens[mine]), targets[mine]).backward()
    result["grads"] = all(p.grad is not None for p in model.parameters())
    result["values"] = _max_diff([p.detach() for p in model.parameters()], trained)
    return result


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_an_engine_dropped_without_destroy_lets_go_of_the_model(ranks, stage):
    for result in ranks(2).run(check_dropped_engine, stage, timeout=TIMEOUT):
        assert result["alive"] == [0, 0, 0]
        assert result["hooks"] == 0 and result["grads"] and result["values"] == 0.0
        assert result.get("sharded", True) and not result["store"]


def check_second_initialize() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    first, *_ = zerolap.initialize(model=model, config=_config(3, optimizer=False))
    with torch.no_grad():
        first(global_batch(0, MICRO)[0])  # used for inference first, as TRL's DPO does
    with captured_logs() as logs:
        engine, *_ = zerolap.initialize(model=model, config=_config(3))
    for step in range(2):
        tokens, targets = global_batch(step, MICRO * world)
        mine = slice(rank * MICRO, rank * MICRO + MICRO)
        engine.backward(loss_fn(engine(tokens[mine]), targets[mine]))
        engine.step()
    return {"destroyed": first.destroyed, "logs": logs, "params": _whole(model.parameters())}


def reference_trained(steps: int, world: int) -> list[torch.Tensor]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step in range(steps):
        tokens, targets = global_batch(step, MICRO * world)
        opt.zero_grad(set_to_none=False)
        loss_fn(model(tokens), targets).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_initialize_twice_on_one_model_destroys_the_first_engine(ranks):
    reference = reference_trained(2, world=2)
    for result in ranks(2).run(check_second_initialize, timeout=TIMEOUT):
        assert result["destroyed"]
        assert any("destroying that one" in line for line in result["logs"])
        assert _max_diff(result["params"], reference) < 1e-5


# -- safe_get_full_* ------------------------------------------------------------------------------


def reference_state(world: int) -> dict:
    """One process, one AdamW step on the global batch, then a second backward."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    tokens, targets = global_batch(0, MICRO * world)
    loss_fn(model(tokens), targets).backward()
    opt.step()
    opt.zero_grad()
    tokens, targets = global_batch(1, MICRO * world)
    loss_fn(model(tokens), targets).backward()
    names = [n for n, _ in model.named_parameters()]
    return {
        "params": dict(zip(names, (p.detach().clone() for p in model.parameters()), strict=True)),
        "grads": dict(zip(names, (p.grad.clone() for p in model.parameters()), strict=True)),
        "exp_avg": {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()},
    }


def check_safe_get(stage: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    engine, *_ = zerolap.initialize(model=model, config=_config(stage))
    for step in range(2):
        tokens, targets = global_batch(step, MICRO * world)
        mine = slice(rank * MICRO, rank * MICRO + MICRO)
        engine.backward(loss_fn(engine(tokens[mine]), targets[mine]))
        if step == 0:
            engine.step()
    named = list(model.named_parameters())
    got = {
        "params": {n: safe_get_full_fp32_param(p) for n, p in named},
        "grads": {n: safe_get_full_grad(p) for n, p in named},
        "exp_avg": {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in named},
    }
    target = named[1][1]  # embed's tied weight is 0; take the hidden Linear's
    safe_set_full_fp32_param(
        target, torch.full(target.ds_shape if stage == 3 else target.shape, 0.5)
    )
    got["set"] = bool((_whole([target])[0] == 0.5).all())
    got["set_fp32"] = bool((safe_get_full_fp32_param(target) == 0.5).all())
    return got


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_get_full_values_equal_one_process(ranks, stage):
    reference = reference_state(world=2)
    for result in ranks(2).run(check_safe_get, stage, timeout=TIMEOUT):
        for kind in ("params", "grads", "exp_avg"):
            for name, want in reference[kind].items():
                got = result[kind][name]
                assert got is not None and got.shape == want.shape, (kind, name)
                assert (got - want).abs().max().item() < 1e-5, (kind, name)
        assert result["set"] and result["set_fp32"]


# -- DeepSpeed 0.19.8's defaults and keys in force ----------------------------------------------


def check_bf16_overflow(check: bool) -> dict:
    config = _config(2, bf16={"enabled": True, "check_grad_overflow": check})
    engine, *_ = zerolap.initialize(model=make_model(), config=config)
    tokens, targets = global_batch(0, MICRO)
    before = _whole(engine.module.parameters())
    loss = loss_fn(engine(tokens), targets)
    engine.backward(loss * float("nan") if dist.get_rank() == 1 else loss)  # one rank poisoned
    engine.step()
    after = _whole(engine.module.parameters())
    return {
        "skipped": engine.skipped_steps,
        "unchanged": _max_diff(after, before) == 0.0,
        "finite": all(torch.isfinite(p).all() for p in after),
    }


def test_bf16_skips_a_step_whose_gradients_are_not_finite_on_any_rank(ranks):
    for result in ranks(2).run(check_bf16_overflow, True, timeout=TIMEOUT):
        assert result == {"skipped": 1, "unchanged": True, "finite": True}
    for result in ranks(2).run(check_bf16_overflow, False, timeout=TIMEOUT):
        assert result["skipped"] == 0 and not result["finite"]  # what the check prevents


def check_default_clipping() -> list[float]:
    config = _config(0)
    del config["gradient_clipping"]  # DeepSpeed 0.19.8 clips at 1.0 unless told otherwise
    config["optimizer"] = {"type": "SGD", "params": {"lr": 1.0}}
    engine, *_ = zerolap.initialize(model=make_model(), config=config)
    tokens, targets = global_batch(0, MICRO)
    before = _whole(engine.module.parameters())
    engine.backward(loss_fn(engine(tokens), targets) * 100.0)
    engine.step()
    after = _whole(engine.module.parameters())
    moved = torch.cat([(a - b).reshape(-1) for a, b in zip(after, before, strict=True)])
    return [engine.get_global_grad_norm(), moved.norm().item()]


def test_gradients_are_clipped_at_1_by_default(ranks):
    for norm, moved in ranks(2).run(check_default_clipping, timeout=TIMEOUT):
        assert norm > 10 and moved == pytest.approx(1.0, rel=1e-4)  # SGD, lr 1: the clipped norm


# -- torch's backward ------------------------------------------------------------------------


class TwoHeads(torch.nn.Module):
    """Two outputs, both in the loss: a torch-style backward reaches the engine's outputs twice."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.extra = torch.nn.Linear(13, 1)

    def forward(self, tokens: torch.Tensor):
        logits = self.body(tokens)
        return logits, self.extra(logits).mean()


def check_torch_style_backward(stage: int, gas: int, fp16: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for style in ("engine", "torch"):
        config = _config(stage, gas=gas)
        if fp16:
            config["fp16"] = {"enabled": True, "loss_scale": 64.0}
        torch.manual_seed(0)
        engine, *_ = zerolap.initialize(model=TwoHeads(), config=config)
        for step in range(2):
            tokens, targets = global_batch(step, MICRO * gas * world)
            for micro in range(gas):
                lo = (micro * world + rank) * MICRO
                logits, extra = engine(tokens[lo : lo + MICRO])
                extra *= 1.0  # in place on an output, as the Trainer scales its loss
                loss = loss_fn(logits.float(), targets[lo : lo + MICRO]) + extra.float()
                if style == "engine":
                    engine.backward(loss)
                else:
                    loss.backward()  # torch's way, as DeepSpeed also accepts
                engine.step()
        results[style] = _whole(engine.module.parameters())
    return {"diff": _max_diff(results["engine"], results["torch"]), "steps": engine.global_steps}


def check_manual_scale() -> dict:
    """fp16 gradients (still carrying the loss scale at stage 0) after each way of
    backpropagating DeepSpeed accepts."""
    grads = {}
    for style in ("engine", "scale", "plain"):
        config = _config(0, fp16={"enabled": True, "loss_scale": 64.0})
        torch.manual_seed(0)
        engine, *_ = zerolap.initialize(model=make_model(), config=config)
        tokens, targets = global_batch(0, MICRO)
        loss = loss_fn(engine(tokens).float(), targets)
        if style == "engine":
            engine.backward(loss)
        elif style == "scale":
            engine.scale(loss).backward()
        else:
            loss.backward()
        grads[style] = [p.grad.float().clone() for p in engine.module.parameters()]
    return {
        "scale": _max_diff(grads["engine"], grads["scale"]),
        "plain": _max_diff(grads["engine"], grads["plain"]),
        "norm": sum(g.norm().item() for g in grads["engine"]),
    }


def test_engine_scale_applies_the_loss_scale_once(ranks):
    for result in ranks(2).run(check_manual_scale, timeout=TIMEOUT):
        assert result["norm"] > 1.0  # scaled by 64: a second scaling would show
        assert result["scale"] == 0.0
        # scaled where the gradient enters the fp16 outputs rather than at the loss: rounding
        assert result["plain"] < 1e-3 * result["norm"]


@pytest.mark.parametrize(
    ("stage", "gas", "fp16"),
    [(0, 1, False), (1, 2, False), (2, 2, False), (3, 2, False), (2, 1, True)],
)
def test_a_plain_loss_backward_trains_as_engine_backward(ranks, stage, gas, fp16):
    for result in ranks(2).run(check_torch_style_backward, stage, gas, fp16, timeout=TIMEOUT):
        assert result["diff"] < 1e-6 and result["steps"] == 2
