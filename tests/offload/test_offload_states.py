"""``engine.offload_states()`` / ``reload_states()`` (DeepSpeed's API, as RLHF frameworks call it
around generation). No accelerator here, so the ranks treat the CPU as one apart from the host
(``test_host_offload.apart``) and the states really leave their storage: a parked kind's memory
is gone from ``memory_breakdown()``, the engine refuses by name what needs it, and after
``reload_states()`` training goes on bit for bit as if nothing had moved."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

import zerolap
from tests.logs import captured_logs
from tests.offload.test_host_offload import apart
from tests.offload.test_offload_training import _config, _params, _train, differences
from tests.pipe import models
from tests.pipe.test_engine import _config as pipe_config
from tests.zero.models import global_batch, loss_fn, make_model
from zerolap.offload.states import (
    OffloadStateTypeEnum,
    ParkedGuard,
    ParkedStates,
    StatesParkedError,
)

BEFORE, AFTER = 2, 2  # steps before the states are parked, and after they are back
CPU = {"device": "cpu"}
VARIANTS = [  # (stage, dtype, offload_optimizer, offload_param, stage 3's persistence)
    *((stage, dtype, None, None, 0) for stage, dtype in [(0, None), (1, "bf16"), (2, None)]),
    *((stage, dtype, None, None, 0) for stage, dtype in [(2, "bf16"), (3, None), (3, "bf16")]),
    (3, "bf16", None, None, 200),  # the norms' units kept whole on every rank, parked too
    (2, "bf16", {"device": "cpu", "ratio": 0.5}, None, 0),  # half the state on the host already
    (3, "bf16", CPU, CPU, 0),  # only the gathered units and the gradients' buckets to park
]


def _straight(config) -> tuple[list[torch.Tensor], dict]:
    with apart():  # the same plan as the parked run's, offload blocks included
        engine, optimizer, *_ = zerolap.initialize(model=make_model(), config=config)
    _train(engine, range(BEFORE + AFTER))
    out = _params(engine), optimizer.state_dict()["inner"]["state"]
    engine.destroy()
    return out


def _refusal(call) -> str:
    try:
        call()
    except StatesParkedError as error:
        return str(error)
    return "not refused"


def _forward_backward(engine):
    tokens, targets = (t.to(engine.device) for t in global_batch(0, 4))
    engine.backward(loss_fn(engine(tokens[:2]).float(), targets[:2]))


def _plain_backward(engine):
    """torch's own ``loss.backward()``, which DeepSpeed clients may call instead."""
    tokens, targets = (t.to(engine.device) for t in global_batch(0, 4))
    loss_fn(engine(tokens[:2]).float(), targets[:2]).backward()


def check_all_parked() -> list[str]:
    """Every kind parked between steps: nothing of the model state left where training runs,
    all of it counted in host memory; forward, backward, step and a checkpoint refused; after
    the reload the same run as one that never parked."""
    failures = []
    for stage, dtype, opt, param, persist in VARIANTS:
        name = f"stage {stage} {dtype or 'fp32'} offload {opt} {param} persistence {persist}"
        config = _config(stage, dtype=dtype, opt=opt, param=param)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = persist
        want, want_state = _straight(config)
        with apart():
            engine, optimizer, *_ = zerolap.initialize(model=make_model(), config=config)
            _train(engine, range(BEFORE))
            engine.empty_partition_cache()  # offload_states releases gathered units too
            before = engine.memory_breakdown()
            engine.offload_states()
            parked = engine.memory_breakdown()
            left = [
                t.untyped_storage().nbytes()
                for ts in optimizer.device_states().values()
                for t in ts
            ]
            tokens = global_batch(0, 4)[0][:2]
            refusals = [
                _refusal(lambda e=engine, t=tokens: e(t)),
                _refusal(engine.step),
                _refusal(lambda e=engine: e.save_checkpoint("/nonexistent")),
            ]
            engine.reload_states()
            back = engine.memory_breakdown()
            _train(engine, range(BEFORE, BEFORE + AFTER))
            got, got_state = _params(engine), optimizer.state_dict()["inner"]["state"]
            engine.destroy()
        failures += differences(name, (got, got_state), (want, want_state))
        if any(left):
            failures.append(f"{name}: storages still holding memory: {left}")
        if parked.total_bytes or parked.bucket_buffer_bytes:
            failures.append(f"{name}: still held where training runs: {parked}")
        if parked.host_bytes < before.total_bytes:
            failures.append(f"{name}: {parked.host_bytes} bytes parked of {before.total_bytes}")
        # The reductions' buckets were freed, not parked: the next backward allocates them.
        if back != dataclasses.replace(before, bucket_buffer_bytes=0):
            failures.append(f"{name}: after the reload {back}, before {before}")
        if "engine.forward() needs lp_params" not in refusals[0]:
            failures.append(f"{name}: forward: {refusals[0]}")
        for what, said in zip(("step", "save_checkpoint"), refusals[1:], strict=True):
            kinds = "contiguous_grad_buffer, hp_params, lp_grads, lp_params, optim_states"
            if f"engine.{what}() needs {kinds}" not in said:
                failures.append(f"{name}: {what}: {said}")
    return failures


def test_parked_states_come_back_bit_for_bit(ranks):
    assert ranks(2).run(check_all_parked, timeout=300) == [[], []]


def check_as_openrlhf_parks() -> list[str]:
    """OpenRLHF's sleep: the optimizer's states, master values and gradients parked through
    ``engine.optimizer.offload_states`` with DeepSpeed's enums, the parameters kept for
    generation; forward under no_grad runs, backward and step are refused; reloaded, the run
    is the unparked one."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    kinds = [
        OffloadStateTypeEnum.optim_states,
        OffloadStateTypeEnum.contiguous_grad_buffer,
        OffloadStateTypeEnum.hp_params,
        OffloadStateTypeEnum.lp_grads,
    ]
    failures = []
    for stage in (2, 3):
        config = _config(stage, dtype="bf16")
        want, want_state = _straight(config)
        with apart():
            engine, optimizer, *_ = zerolap.initialize(model=make_model(), config=config)
            _train(engine, range(BEFORE))
            before = engine.memory_breakdown()
            engine.optimizer.offload_states(
                include=kinds, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True
            )
            engine.optimizer.offload_states(include=kinds)  # again: nothing more to move
            parked = engine.memory_breakdown()
            store = engine.param_store
            gathered = [  # stage 3: offload_states released the units gathered for the next step
                unit
                for unit, status in enumerate(getattr(store, "status", []))
                if not store.persistent[unit] and status.name != "SHARDED"
            ]
            with torch.no_grad():
                generated = engine(global_batch(0, 4)[0][:2].to(engine.device))
            backward = _refusal(lambda e=engine: _forward_backward(e))
            plain = _refusal(lambda e=engine: _plain_backward(e))
            engine.reload_states(True, include=[OffloadStateTypeEnum.optim_states])
            step = _refusal(engine.step)
            engine.reload_states(False)
            _train(engine, range(BEFORE, BEFORE + AFTER))
            got, got_state = _params(engine), optimizer.state_dict()["inner"]["state"]
            engine.destroy()
        name = f"stage {stage}"
        failures += differences(name, (got, got_state), (want, want_state))
        if parked.params_bytes > before.params_bytes or gathered:
            failures.append(f"{name}: parameters moved, or units {gathered} still gathered")
        if parked.master_bytes or parked.optimizer_state_bytes or parked.grads_bytes:
            failures.append(f"{name}: left where training runs: {parked}")
        if not torch.isfinite(generated).all():
            failures.append(f"{name}: forward under no_grad gave {generated}")
        if not backward.startswith("engine.backward() needs lp_grads, which offload_states()"):
            failures.append(f"{name}: backward: {backward}")
        if not plain.startswith("engine.backward() needs lp_grads"):
            failures.append(f"{name}: loss.backward(): {plain}")
        if not step.startswith("engine.step() needs contiguous_grad_buffer, hp_params, lp_grads"):
            failures.append(f"{name}: step after reloading optim_states only: {step}")
    return failures


def test_openrlhf_parks_all_but_the_parameters(ranks):
    assert ranks(2).run(check_as_openrlhf_parks, timeout=200) == [[], []]


def check_in_host_memory_already() -> dict:
    """A CPU-only host: the states already are in host memory; nothing moves, once said."""
    engine, *_ = zerolap.initialize(model=make_model(), config=_config(2))
    _train(engine, range(1))
    before = engine.memory_breakdown()
    with captured_logs() as logs:
        engine.offload_states()
        engine.offload_states()
        engine.reload_states()
    _train(engine, range(1, 2))
    out = {
        "same": engine.memory_breakdown() == before or "trained on",
        "logs": [line for line in logs if "offload_states" in line],
        "parked": sorted(engine.optimizer.parked.kinds),
    }
    engine.destroy()
    return out


def test_on_a_cpu_only_host_nothing_moves_and_it_says_so_once(ranks):
    for result in ranks(2).run(check_in_host_memory_already, timeout=90):
        assert result["parked"] == []
        assert len(result["logs"]) == 1
        assert "training runs in host memory here" in result["logs"][0]


def check_refusals() -> list[str]:
    engine, *_ = zerolap.initialize(model=make_model(), config=_config(1))
    out = []
    for device in ("nvme", "tape"):
        try:
            engine.offload_states(device=device)
            out.append(f"{device}: accepted")
        except ValueError as error:
            out.append(str(error))
    with apart():
        try:
            engine.offload_states(include=["optim_states", "activations"])
        except ValueError as error:
            out.append(str(error))
        with captured_logs() as logs:
            engine.offload_states(device="none")
        out += logs
        out.append(sorted(engine.optimizer.parked.kinds))
    engine.destroy()
    return out


def test_bad_arguments_are_refused_by_name(ranks):
    nvme, tape, unknown, none, parked = ranks(1).run(check_refusals, timeout=60)[0]
    assert "device 'nvme' is not supported" in nvme
    assert "'tape'" in tape
    assert "unknown state type 'activations'" in unknown and "lp_params" in unknown
    assert none.startswith("WARNING: offload_states: device 'none'")
    assert parked == []  # the unknown kind refused the call before anything moved


def device_memory_parked() -> dict:
    """On a GPU: the device memory ``offload_states`` gives back and ``reload_states`` takes
    again, against the model state the engine counts (``tests/cuda``)."""
    engine, *_ = zerolap.initialize(model=make_model(), config=_config(2, dtype="bf16"))
    _train(engine, range(1))
    held = engine.memory_breakdown()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine.offload_states()
    parked = torch.cuda.memory_allocated()
    engine.reload_states()
    back = torch.cuda.memory_allocated()
    engine.destroy()
    return {
        "model state": held.total_bytes,  # parked and brought back
        "buckets": held.bucket_buffer_bytes,  # freed, allocated again by the next backward
        "freed": before - parked,
        "taken back": back - parked,
    }


def pipeline_parked_between_batches() -> dict:
    """A two-stage pipeline parks everything after a batch: train_batch and eval_batch are
    refused by name; reloaded, the next batches equal those of a pipeline that never parked."""
    runs = {}
    for park in (False, True):
        with apart():
            engine, *_ = zerolap.initialize(model=models.pipeline(2), config=pipe_config(1, 2))
            batches = [models.micro_batches(step, 2, 1, 0) for step in range(3)]
            losses = [engine.train_batch(iter(batches[0])).item()]
            refused = []
            if park:
                engine.offload_states()
                refused = [
                    _refusal(lambda e=engine, b=batches[1]: e.train_batch(iter(b))),
                    _refusal(lambda e=engine, b=batches[1]: e.eval_batch(iter(b))),
                ]
                engine.reload_states()
            losses += [engine.train_batch(iter(b)).item() for b in batches[1:]]
            params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
            engine.destroy()
        runs[park] = {"losses": losses, "params": params, "refused": refused}
    return runs


def test_a_pipeline_parks_between_batches(ranks):
    for result in ranks(2).run(pipeline_parked_between_batches, timeout=120):
        straight, parked = result[False], result[True]
        assert parked["losses"] == straight["losses"]
        assert all(torch.equal(parked["params"][n], v) for n, v in straight["params"].items())
        step, forward = parked["refused"]
        assert "engine.step() needs" in step and "engine.forward() needs lp_params" in forward


def check_other_entries() -> dict:
    """With the parameters parked, the model's own entries are refused by name (generation
    calls its forward directly; a checkpoint reads its state_dict; stage 3 gathers), so are
    DeepSpeed's safe_get helpers; parking inside GatheredParameters is refused; destroy()
    brings the states back and hands the model over whole."""
    out = {}
    for stage in (2, 3):
        with apart():
            model = make_model()
            engine, *_ = zerolap.initialize(model=model, config=_config(stage, dtype="bf16"))
            _train(engine, range(1))
            params = list(model.parameters())
            with zerolap.zero.GatheredParameters(params):
                values = [p.detach().float().clone() for p in params]
                # Stage 3 holds the units gathered for the block (below it holds nothing).
                inside = _refusal(engine.offload_states) if stage == 3 else None
            engine.offload_states()
            tokens = global_batch(0, 4)[0][:2]
            refused = {
                "module": _refusal(lambda m=model, t=tokens: m(t)),
                "submodule": _refusal(lambda m=model, t=tokens: m.embed(t)),
                "state_dict": _refusal(model.state_dict),
                "load_state_dict": _refusal(lambda m=model: m.hidden.load_state_dict({})),
                "safe_get": _refusal(lambda p=params[0]: zerolap.utils.safe_get_full_fp32_param(p)),
            }
            if stage == 3:
                refused["gathered"] = _refusal(
                    lambda p=params: zerolap.zero.GatheredParameters(p).__enter__()
                )
            optimizer = engine.optimizer
            engine.destroy()  # parked: the parameters brought back first
            whole = [p.detach().float() for p in model.parameters()]
            model(tokens)  # handed over: no hook of the engine's left
            listeners = len(optimizer.parked.listeners)
        out[stage] = {
            "inside": inside,
            "refused": refused,
            "whole": all(torch.equal(a, b) for a, b in zip(whole, values, strict=True)),
            "listeners": listeners,
        }
    return out


def test_the_models_own_entries_are_refused_while_parked(ranks):
    for result in ranks(2).run(check_other_entries, timeout=120):
        for stage, found in result.items():
            if stage == 3:
                assert found["inside"].startswith("offload_states() inside GatheredParameters")
            assert found["whole"] and found["listeners"] == 0, stage
            refused = found["refused"]
            assert refused["module"].startswith("the model's forward needs lp_params"), stage
            assert refused["submodule"].startswith("'embed''s forward needs lp_params"), stage
            assert refused["load_state_dict"].startswith("'hidden''s load_state_dict() needs")
            assert refused["state_dict"].startswith("the model's state_dict() needs lp_params")
            assert refused["safe_get"].startswith("safe_get_full_fp32_param() needs "), stage
            if stage == 3:
                assert refused["gathered"].startswith("GatheredParameters needs lp_params")


class _NoMemory:
    """A storage that cannot get its memory back (the GPU full of the inference engine)."""

    def resize_(self, nbytes: int) -> None:
        raise torch.OutOfMemoryError("no memory for the reload")


def test_a_reload_that_runs_out_of_memory_leaves_the_rest_parked():
    kind = OffloadStateTypeEnum.lp_params
    first, second = torch.arange(6.0), torch.arange(4.0)
    parked = ParkedStates()
    parked.park({kind: [first, second]}, [kind], pin_memory=False, non_blocking=False)
    assert first.untyped_storage().nbytes() == second.untyped_storage().nbytes() == 0
    host = parked._parked[kind][1][1]
    parked._parked[kind][1] = (_NoMemory(), host)
    with pytest.raises(torch.OutOfMemoryError):
        parked.unpark(None, non_blocking=False)
    assert torch.equal(first, torch.arange(6.0))  # restored before the failure
    assert parked.kinds == {kind} and parked.parked_bytes() == {kind: 16}
    with pytest.raises(StatesParkedError, match=r"engine.step\(\) needs lp_params"):
        parked.require("engine.step()")


class _RootOwned(torch.nn.Module):
    """A parameter of the model itself (a ViT's position embedding) and one of a child."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = torch.nn.Parameter(torch.randn(8))
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x + self.offset)


def check_engine_let_go() -> dict:
    """Stage 3 with a parameter of the model itself: the refusal comes before the gather. An
    engine dropped while parked, whose reload fails (no device memory), still takes its hooks
    off: the model is handed over, its values left empty and a warning says so."""
    torch.manual_seed(0)
    model = _RootOwned()
    config = _config(3)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    with apart():
        engine, optimizer, *_ = zerolap.initialize(model=model, config=config)
        engine.backward(model(torch.randn(2, 8)).square().mean())
        engine.step()
        engine.offload_states()
        first = _refusal(lambda: model(torch.randn(2, 8)))
        parked = optimizer.parked

        def no_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("no memory for the reload")

        parked.unpark = no_memory
        destroy = "not raised"
        try:
            engine.destroy()  # nothing let go: it may be called again once memory is free
        except torch.OutOfMemoryError as error:
            destroy = str(error)
        still = sorted(parked.kinds)
        with captured_logs() as logs:
            del engine, optimizer
            gc.collect()  # the finalizer lets go of the model all the same
    return {
        "first": first,
        "destroy": destroy,
        "still": still,
        "logs": [line for line in logs if "could not be brought back" in line],
        "parked": sorted(parked.kinds),
        "hooks": sum(len(m._forward_pre_hooks) for m in model.modules()),
    }


def test_a_stage3_root_parameter_and_an_engine_let_go_while_parked(ranks):
    for result in ranks(2).run(check_engine_let_go, timeout=60):
        assert result["first"].startswith("the model's forward needs lp_params"), result
        assert result["destroy"] == "no memory for the reload"
        assert "lp_params" in result["still"]
        assert len(result["logs"]) == 1 and "no memory for the reload" in result["logs"][0]
        assert result["parked"] == [] and result["hooks"] == 0


def test_a_park_that_fails_part_way_guards_what_it_parked(monkeypatch):
    module = torch.nn.Linear(4, 4)
    parked = ParkedStates()
    guard = ParkedGuard(parked, module, store=None)
    real, calls = torch.empty, []

    def second_fails(*args, **kwargs):
        calls.append(args)
        if len(calls) == 3:  # the weight and the bias parked, then no host memory
            raise RuntimeError("no pinned memory left")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", second_fails)
    states = {
        OffloadStateTypeEnum.lp_params: [module.weight, module.bias],
        OffloadStateTypeEnum.hp_params: [torch.zeros(4)],
    }
    with pytest.raises(RuntimeError, match="no pinned memory left"):
        parked.park(states, list(states), pin_memory=False, non_blocking=False)
    monkeypatch.undo()
    assert parked.kinds == {OffloadStateTypeEnum.lp_params}
    with pytest.raises(StatesParkedError, match="the model's forward needs lp_params"):
        module(torch.ones(4))
    parked.unpark(None, non_blocking=False)
    module(torch.ones(4))  # back, and the guard off
    guard.remove()
    assert parked.listeners == []
