"""Stages 1-2 leave the parameter all-gather in flight after step() (``zero.in_flight``): the
results are bitwise those of waiting at the end of the step, and whatever reads parameters
between step() and the next forward sees the updated values."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.zero.models import global_batch, loss_fn, make_model
from zerolap.zero.in_flight import InFlightParameter

MICRO = 2


def _engine(stage: int, defer: bool, *, bucket: int = 200):
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "reduce_bucket_size": bucket,
            "overlap_param_gather": defer,
        },
    }
    engine, *_ = zerolap.initialize(model=make_model(), config=config)
    return engine


def _step(engine, step: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(step, MICRO * world)
    lo = rank * MICRO
    loss = loss_fn(
        engine(tokens[lo : lo + MICRO], use_sometimes=step % 2 == 0), targets[lo : lo + MICRO]
    )
    engine.backward(loss)
    engine.step()
    return loss.item()


def _values(engine) -> list[torch.Tensor]:
    engine.wait_in_flight()
    return [p.detach().clone() for p in engine.module.parameters()]


def check_bitwise(stage: int) -> list[str]:
    """Losses and parameters of every step equal, bit for bit, with and without deferring."""
    deferred, waited = _engine(stage, True), _engine(stage, False)
    assert deferred.param_store.defer and not waited.param_store.defer
    failures = []
    for step in range(4):
        a, b = _step(deferred, step), _step(waited, step)
        if a != b:
            failures.append(f"step {step}: loss {a!r} != {b!r}")
        assert deferred.param_store.in_flight, "the gathers were waited in step()"
    for x, y in zip(_values(deferred), _values(waited), strict=True):
        if not torch.equal(x, y):
            failures.append(f"parameters differ by {(x - y).abs().max().item():.3e}")
    return failures


@pytest.mark.parametrize("stage", [1, 2])
def test_bitwise_equal_to_waiting_in_step(ranks, stage):
    assert ranks(2).run(check_bitwise, stage, timeout=120) == [[], []]


def check_compiled() -> list[str]:
    """Under ``engine.compile`` the hooks run inside the compiled forward (dynamo breaks the
    graph at their waits): results stay bitwise those of waiting in step()."""
    deferred, waited = _engine(1, True), _engine(1, False)
    for engine in (deferred, waited):
        engine.compile(backend="eager")
    failures = []
    for step in range(3):
        a, b = _step(deferred, step), _step(waited, step)
        if a != b:
            failures.append(f"step {step}: loss {a!r} != {b!r}")
    for x, y in zip(_values(deferred), _values(waited), strict=True):
        if not torch.equal(x, y):
            failures.append(f"parameters differ by {(x - y).abs().max().item():.3e}")
    return failures


def test_compiled_forward_waits_too(ranks):
    assert ranks(2).run(check_compiled, timeout=120) == [[], []]


def _read(read: str, engine, path: str, step: int) -> list[torch.Tensor]:
    """The parameters as ``read`` sees them."""
    params = list(engine.module.parameters())
    if read == "data":  # an EMA update or a reference model's sync reads .data
        return [p.data.clone() for p in params]
    if read == "ops":
        return [p * 1.0 for p in params]
    if read == "state_dict":
        return [t.clone() for t in engine.module.state_dict().values()]
    if read == "gathered":
        with zerolap.zero.GatheredParameters(params):
            return [torch.Tensor.clone(p) for p in params]
    if read == "eval":
        engine.eval()
        with torch.no_grad():
            out = engine(global_batch(99, MICRO)[0])
        engine.train()
        return [out]
    assert read == "checkpoint"
    engine.save_checkpoint(path, tag=f"step{step}")
    state = torch.load(f"{path}/step{step}/mp_rank_00_model_states.pt", weights_only=False)
    return [t.clone() for t in state["module"].values()]


def check_reads_after_step(read: str, path: str) -> list[str]:
    """Right after step(), ``read`` sees what an engine that waited in step() holds."""
    deferred, waited = _engine(1, True), _engine(1, False)
    failures = []
    for step in range(2):
        _step(deferred, step)
        _step(waited, step)
        # Metadata and gradients are read without waiting (nn.Module.zero_grad does).
        deferred.module.zero_grad()
        _ = [(p.shape, p.dtype, p.requires_grad, p.grad) for p in deferred.module.parameters()]
        if not deferred.param_store.in_flight:
            failures.append("reading metadata waited for the gathers")
        got = _read(read, deferred, f"{path}/deferred", step)
        want = _read(read, waited, f"{path}/waited", step)
        if any(type(p) is InFlightParameter for p in deferred.module.parameters()):
            failures.append(f"{read}: parameters still marked in flight after the read")
        for x, y in zip(got, want, strict=True):
            if not torch.equal(x, y):
                failures.append(f"{read} after step {step}: off by {(x - y).abs().max():.3e}")
    return failures


@pytest.mark.parametrize("read", ["data", "ops", "state_dict", "gathered", "eval", "checkpoint"])
def test_reads_between_step_and_forward_see_the_update(ranks, tmp_path, read):
    assert ranks(2).run(check_reads_after_step, read, str(tmp_path), timeout=120) == [[], []]


def check_each_bucket_waited_by_its_first_user() -> list[str]:
    """A forward through the embedding alone waits for the embedding's bucket, not the rest."""
    engine = _engine(1, True, bucket=100)
    _step(engine, 0)
    store = engine.param_store
    embed = engine.module.embed.weight
    others = [p for n, p in engine.module.named_parameters() if not n.startswith(("embed", "out"))]
    failures = []
    engine.module.embed(torch.zeros(1, dtype=torch.long))
    if type(embed) is InFlightParameter:
        failures.append("the embedding's forward did not wait for its bucket")
    if not all(type(p) is InFlightParameter for p in others):
        failures.append("the embedding's forward waited for other buckets too")
    if not store.in_flight:
        failures.append("nothing left in flight")
    store.settle()
    return failures


def test_each_bucket_waited_by_its_first_user(ranks):
    assert ranks(2).run(check_each_bucket_waited_by_its_first_user, timeout=60) == [[], []]


def check_deepcopy_in_flight() -> list[str]:
    """A copy of the model taken right after step() (a "best model" snapshot) holds the
    updated values in plain parameters, is its own model (its forward waits for nothing of the
    original's), and a new engine defers its own gathers."""
    import copy

    deferred, waited = _engine(2, True), _engine(2, False)
    _step(deferred, 0)
    _step(waited, 0)
    snapshot = copy.deepcopy(deferred.module)
    failures = []
    for got, want in zip(snapshot.parameters(), waited.module.parameters(), strict=True):
        if type(got) is not torch.nn.Parameter:
            failures.append(f"the copy's parameter is a {type(got).__name__}")
        if not torch.equal(got.detach(), want.detach()):
            failures.append("the copy holds stale values")
    _step(deferred, 1)
    snapshot(global_batch(0, MICRO)[0])
    if not all(type(p) is InFlightParameter for p in deferred.module.parameters()):
        failures.append("the copy's forward waited for the original's gathers")
    copied, *_ = zerolap.initialize(model=snapshot, config=deferred.config)
    if not copied.param_store.defer:
        failures.append("an engine on the copy does not defer its gathers")
    deferred.wait_in_flight()
    return failures


def test_deepcopy_right_after_step(ranks):
    assert ranks(2).run(check_deepcopy_in_flight, timeout=60) == [[], []]


class _Broken:
    def wait(self) -> None:
        raise dist.CommError("injected: the gather failed")


def check_failed_gathers_keep_parameters_guarded() -> list[str]:
    """A gather whose wait raised, or that a failing step() never launched, leaves its
    parameters guarded: every later read raises again instead of using stale chunks."""
    from zerolap.zero import flat_params

    engine = _engine(1, True, bucket=100)
    store = engine.param_store
    failures = []

    def reads_raise(what: str) -> None:
        for attempt in range(2):
            try:
                _ = [p * 1.0 for p in engine.module.parameters()]
                failures.append(f"{what}: read {attempt} used the parameters")
            except dist.CommError:
                pass

    _step(engine, 0)
    index = next(iter(store._in_flight))
    real = store._in_flight[index]
    store._in_flight[index] = _Broken()
    reads_raise("a failed wait")
    store._in_flight[index] = real  # the gather did arrive: the next wait succeeds
    engine.wait_in_flight()
    if any(type(p) is InFlightParameter for p in engine.module.parameters()):
        failures.append("parameters still marked in flight after every gather arrived")

    launch, launched = flat_params.all_gather_bucket, []

    def fails_second(*args, **kwargs):
        if launched:
            raise dist.CommError("injected: the launch failed")
        launched.append(True)
        return launch(*args, **kwargs)

    flat_params.all_gather_bucket = fails_second
    try:
        _step(engine, 1)
        failures.append("step() did not raise")
    except dist.CommError:
        pass
    finally:
        flat_params.all_gather_bucket = launch
    reads_raise("a launch that failed")
    return failures


def test_failed_gathers_keep_parameters_guarded(ranks):
    assert ranks(2).run(check_failed_gathers_keep_parameters_guarded, timeout=60) == [[], []]


class _Slow:
    """A gather that takes a while to arrive, so that two threads wait for it at once."""

    def __init__(self, real) -> None:
        self.real = real

    def wait(self) -> None:
        time.sleep(0.2)
        self.real.wait()


def check_two_threads_wait_for_one_bucket() -> list[str]:
    """A thread snapshotting the parameters (logging, an async checkpoint) while the training
    thread's next forward waits for the same bucket: both see the update, neither fails."""
    deferred, waited = _engine(2, True, bucket=100), _engine(2, False, bucket=100)
    for engine in (deferred, waited):
        _step(engine, 0)
    updated = _values(waited)
    store = deferred.param_store
    for index in list(store._in_flight):
        store._in_flight[index] = _Slow(store._in_flight[index])
    snapshot, errors = {}, []

    def read() -> None:
        try:
            snapshot.update(
                (name, p.detach().clone()) for name, p in deferred.module.named_parameters()
            )
        except Exception as error:
            errors.append(f"the reading thread: {error!r}")

    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(1, MICRO * world)
    mine = slice(rank * MICRO, rank * MICRO + MICRO)
    thread = threading.Thread(target=read)
    thread.start()
    try:  # the forward waits for the buckets while the reader does
        loss = loss_fn(deferred(tokens[mine], use_sometimes=False), targets[mine])
    except Exception as error:
        errors.append(f"the training thread: {error!r}")
    thread.join()  # before the step changes what the reader copies
    losses = []
    if not errors:
        deferred.backward(loss)
        deferred.step()
        losses = [loss.item(), _step(waited, 1)]
    failures = list(errors)
    if losses and losses[0] != losses[1]:
        failures.append(f"losses {losses}")
    expected = dict(zip((n for n, _ in deferred.module.named_parameters()), updated, strict=True))
    if not errors and not all(torch.equal(snapshot[k], v) for k, v in expected.items()):
        failures.append("the snapshot missed the update")
    return failures


def test_two_threads_waiting_for_one_bucket(ranks):
    assert ranks(2).run(check_two_threads_wait_for_one_bucket, timeout=60) == [[], []]
