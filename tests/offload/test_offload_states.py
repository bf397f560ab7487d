"""``engine.offload_states()`` / ``reload_states()`` (DeepSpeed's API, as RLHF frameworks call it
around generation). No accelerator here, so the ranks treat the CPU as one apart from the host
(``test_host_offload.apart``) and the states really leave their storage: a parked kind's memory
is gone from ``memory_breakdown()``, the engine refuses by name what needs it, and after
``reload_states()`` training goes on bit for bit as if nothing had moved."""

from __future__ import annotations

import torch

import zerolap
from tests.logs import captured_logs
from tests.offload.test_host_offload import apart
from tests.offload.test_offload_training import _config, _params, _train, differences
from tests.pipe import models
from tests.pipe.test_engine import _config as pipe_config
from tests.zero.models import global_batch, loss_fn, make_model
from zerolap.offload.states import StatesParkedError

BEFORE, AFTER = 2, 2  # steps before the states are parked, and after they are back
CPU = {"device": "cpu"}
VARIANTS = [  # (stage, dtype, offload_optimizer, offload_param)
    *((stage, dtype, None, None) for stage, dtype in [(0, None), (1, "bf16"), (2, None)]),
    *((stage, dtype, None, None) for stage, dtype in [(2, "bf16"), (3, None), (3, "bf16")]),
    (2, "bf16", {"device": "cpu", "ratio": 0.5}, None),  # half the state on the host already
    (3, "bf16", CPU, CPU),  # only the gathered units and the gradients' buckets to park
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


def check_all_parked() -> list[str]:
    """Every kind parked between steps: nothing of the model state left where training runs,
    all of it counted in host memory; forward, backward, step and a checkpoint refused; after
    the reload the same run as one that never parked."""
    failures = []
    for stage, dtype, opt, param in VARIANTS:
        name = f"stage {stage} {dtype or 'fp32'} offload {opt} {param}"
        config = _config(stage, dtype=dtype, opt=opt, param=param)
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
        if back != before:
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
            engine.empty_partition_cache()
            before = engine.memory_breakdown()
            engine.optimizer.offload_states(
                include=kinds, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True
            )
            parked = engine.memory_breakdown()
            with torch.no_grad():
                generated = engine(global_batch(0, 4)[0][:2].to(engine.device))
            backward = _refusal(lambda e=engine: _forward_backward(e))
            engine.reload_states()
            _train(engine, range(BEFORE, BEFORE + AFTER))
            got, got_state = _params(engine), optimizer.state_dict()["inner"]["state"]
            engine.destroy()
        name = f"stage {stage}"
        failures += differences(name, (got, got_state), (want, want_state))
        if parked.params_bytes != before.params_bytes:
            failures.append(f"{name}: parameters moved: {parked} of {before}")
        if parked.master_bytes or parked.optimizer_state_bytes or parked.grads_bytes:
            failures.append(f"{name}: left where training runs: {parked}")
        if not torch.isfinite(generated).all():
            failures.append(f"{name}: forward under no_grad gave {generated}")
        if "engine.backward() needs contiguous_grad_buffer, lp_grads" not in backward:
            failures.append(f"{name}: backward: {backward}")
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
        "state": held.total_bytes + held.bucket_buffer_bytes,
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
