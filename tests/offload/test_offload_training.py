"""Training with ``offload_optimizer`` / ``offload_param`` on nvme gives the parameters of the
same run without offload, bit for bit in fp32 and in bf16/fp16 (the same operations on the same
values, only stored elsewhere), at stages 1-3 with accumulation and clipping; checkpoints carry
the swapped state across world sizes and stages; a damaged swap file or a bad ``nvme_path`` is
a named error."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.logs import captured_logs
from tests.zero.models import global_batch, loss_fn, make_model
from zerolap.config import ConfigError
from zerolap.offload.swap_file import SwapError

MICRO, GAS, STEPS = 2, 2, 3


def _config(stage, *, dtype=None, opt=None, param=None, sub_group=100, micro=MICRO, gas=GAS):
    zero = {
        "stage": stage,
        "sub_group_size": sub_group,
        "reduce_bucket_size": 200,
        "stage3_param_persistence_threshold": 0,
    }
    if opt is not None:
        zero["offload_optimizer"] = opt
    if param is not None:
        zero["offload_param"] = param
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.3,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }
    if dtype is not None:
        config[dtype] = {"enabled": True}
    return config


def _train(engine, steps: range, micro: int = MICRO, gas: int = GAS) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        # The same samples at any world size, on the engine's device.
        tokens, targets = (t.to(engine.device) for t in global_batch(step, MICRO * GAS * 2))
        per_rank = len(tokens) // world
        for m in range(gas):
            lo = rank * per_rank + m * micro
            logits = engine(tokens[lo : lo + micro], use_sometimes=step % 2 == 0)
            engine.backward(loss_fn(logits.float(), targets[lo : lo + micro]))
            engine.step()


def _params(engine) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    with zerolap.zero.GatheredParameters(params):
        return [p.detach().float().cpu().clone() for p in params]


def _run(config) -> tuple[list[torch.Tensor], dict, object, int, bool]:
    """Parameters, optimizer state, memory breakdown, how many swapped parameter chunks were
    read on the swap's I/O thread for a gather, and whether the swapped sub-groups stepped
    behind ``step()`` (offload_optimizer.defer_step)."""
    engine, optimizer, *_ = zerolap.initialize(model=make_model(), config=config)
    _train(engine, range(STEPS))
    out = _params(engine), optimizer.state_dict()["inner"]["state"], engine.memory_breakdown()
    swap = getattr(engine.param_store, "swap", None)
    hits = swap.staged_reads if swap is not None else 0
    defers = optimizer.defer_step
    engine.destroy()
    return (*out, hits, defers)


def _mine(directory: str) -> list[str]:
    return [n for n in os.listdir(directory) if f"rank{dist.get_rank()}-" in n]


def differences(name: str, got, want, rtol: float = 0.0, state_rtol=None) -> list[str]:
    """What differs between two runs' (parameters, optimizer state): bit for bit, or with
    ``rtol`` by more than that share of the wanted tensor's largest magnitude (steps taken by
    another device's kernels); ``state_rtol`` gives some state fields their own."""

    def gap(a, b) -> float | None:
        """None when bit for bit equal, else the largest difference as a share of ``b``'s
        largest magnitude (infinite for another shape or dtype, or a NaN on either side)."""
        a, b = torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()
        if a.shape != b.shape or a.dtype != b.dtype:
            return math.inf
        if torch.equal(a, b) or a.numel() == 0:
            return None
        a, b = a.double(), b.double()
        share = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
        return share if math.isfinite(share) else math.inf

    out = []
    if any((gap(g, w) or 0.0) > rtol for g, w in zip(got[0], want[0], strict=True)):
        out.append(f"{name}: parameters differ by {_close(got[0], want[0])}")
    for k, entry in want[1].items():
        for key, value in entry.items():
            share = gap(got[1][k][key], value)
            if share is not None and share > (state_rtol or {}).get(key, rtol):
                out.append(f"{name}: state {k}.{key} differs by {share:.3g} of its largest")
    return out


VARIANTS = [
    # (stage, dtype, offload_optimizer extras, offload_param at stage 3)
    (1, None, {}, False),
    (2, None, {}, False),
    (2, None, {"defer_step": False}, False),
    (3, None, {}, True),
    (3, None, {}, False),
    (2, None, {"ratio": 0.5, "pipeline_read": False, "pipeline_write": False}, False),
    (3, None, {"ratio": 0.4, "buffer_count": 1}, True),
    (1, "fp16", {}, False),
    (2, "bf16", {}, False),
    (3, "bf16", {}, True),
]


def check_parity(directory: str) -> list[str]:
    failures = []
    for stage, dtype, extra, with_param in VARIANTS:
        want, want_state, plain, *_ = _run(_config(stage, dtype=dtype))
        opt = {"device": "nvme", "nvme_path": directory, "buffer_count": 2, **extra}
        param = None
        if with_param:  # 2 buffers for 4 swapped chunks: every use reads one back from disk
            param = {"device": "nvme", "nvme_path": directory, "max_in_cpu": 0, "buffer_count": 2}
        got, got_state, memory, hits, defers = _run(
            _config(stage, dtype=dtype, opt=opt, param=param)
        )
        name = f"stage {stage} {dtype or 'fp32'} {extra} param={with_param}"
        if defers != (stage < 3 and extra.get("defer_step", True)):
            failures.append(f"{name}: defer_step in force is {defers}")
        failures += differences(name, (got, got_state), (want, want_state))
        if _mine(directory):
            failures.append(f"{name}: swap files left: {_mine(directory)}")
        # What left memory is on disk: resident + swapped covers the in-memory run's state.
        if memory.swapped_bytes <= 0 or memory.swap_buffer_bytes <= 0:
            failures.append(f"{name}: nothing reported swapped ({memory})")
        if extra.get("ratio", 1.0) == 1.0:
            moved = plain.optimizer_state_bytes - memory.optimizer_state_bytes
            if moved < 0.95 * plain.optimizer_state_bytes:
                failures.append(f"{name}: only {moved} of {plain.optimizer_state_bytes} moved")
        if with_param and memory.params_bytes >= plain.params_bytes:
            failures.append(f"{name}: parameter shard still resident ({memory.params_bytes})")
        if with_param and hits == 0:
            failures.append(f"{name}: no parameter chunk was read off the gathering thread")
    return failures


def test_offloaded_runs_equal_in_memory_runs_bitwise(ranks, tmp_path):
    failures = ranks(2).run(check_parity, str(tmp_path), timeout=400)
    assert failures == [[], []], failures
    assert os.listdir(tmp_path) == []


class GroupStepAdam(torch.optim.Optimizer):
    """An Adam-like optimizer that counts steps in its param group, as apex's FusedAdam does
    (``group["step"]``, created by the first step), for its bias correction."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg"].mul_(0.9).add_(p.grad, alpha=0.1)
                correction = 1 - 0.9 ** group["step"]
                p.add_(state["exp_avg"], alpha=-group["lr"] / correction)


def group_counted_steps(directory: str) -> list[str]:
    """The optimizer is called once per swapped sub-group (and per tier), and once more by the
    probe that finds its state fields; a count kept in its param group must still say STEPS."""
    results = []
    for offload in (None, {"device": "nvme", "nvme_path": directory, "buffer_count": 2}):
        config = _config(2, opt=offload)
        del config["optimizer"]
        engine, optimizer, *_ = zerolap.initialize(
            model=make_model(), optimizer=lambda params: GroupStepAdam(params), config=config
        )
        _train(engine, range(STEPS))
        results.append((_params(engine), [g["step"] for g in optimizer.param_groups]))
        engine.destroy()
    (want, want_steps), (got, got_steps) = results
    failures = differences("group-counting optimizer", (got, {}), (want, {}))
    if got_steps != want_steps or want_steps != [STEPS]:
        failures.append(f"group step counts {got_steps} with nvme, {want_steps} without")
    return failures


def test_an_optimizer_counting_in_its_param_group_steps_once_per_step(ranks, tmp_path):
    failures = ranks(2).run(group_counted_steps, str(tmp_path), timeout=120)
    assert failures == [[], []], failures


def stateless_steps(directory: str) -> list[str]:
    """SGD without momentum keeps no per-element state: its swap file holds nothing (and used
    to fail to allocate its zero bytes)."""
    results = []
    for offload in (None, {"device": "nvme", "nvme_path": directory}):
        config = _config(2, opt=offload)
        del config["optimizer"]
        engine, *_ = zerolap.initialize(
            model=make_model(),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            config=config,
        )
        _train(engine, range(STEPS))
        results.append((_params(engine), {}))
        engine.destroy()
    return differences("SGD without state", results[1], results[0])


def test_an_optimizer_without_state_steps_with_nvme(ranks, tmp_path):
    assert ranks(2).run(stateless_steps, str(tmp_path)) == [[], []]


# -- checkpoints --------------------------------------------------------------------------------


def save_and_continue(directory: str, ckpt: str, offload: bool) -> list[torch.Tensor]:
    """Stage 3 on 2 ranks (with both offloads, or none): 2 steps, save, a third step."""
    opt = {"device": "nvme", "nvme_path": directory} if offload else None
    param = {"device": "nvme", "nvme_path": directory, "max_in_cpu": 0} if offload else None
    engine, *_ = zerolap.initialize(
        model=make_model(), config=_config(3, opt=opt, param=param, sub_group=50)
    )
    return two_saved_then_one(engine, ckpt)


def two_saved_then_one(engine, ckpt: str, micro: int = MICRO) -> list[torch.Tensor]:
    """2 steps, saved as tag "two", a third step: the parameters (the engine is destroyed)."""
    _train(engine, range(2), micro=micro)
    engine.save_checkpoint(ckpt, tag="two")
    _train(engine, range(2, 3), micro=micro)
    out = _params(engine)
    engine.destroy()
    return out


def third_step_from(engine, ckpt: str, micro: int) -> list[torch.Tensor]:
    """Tag "two" loaded, the third step taken: the parameters (the engine is destroyed)."""
    engine.load_checkpoint(ckpt, tag="two")
    _train(engine, range(2, 3), micro=micro)
    out = _params(engine)
    engine.destroy()
    return out


def resume(directory: str, ckpt: str, stage: int, offload: bool) -> list[torch.Tensor]:
    """Load ``ckpt`` at this world size and ``stage`` (offload on or off) and take the third
    step, with the same samples split over this world's ranks."""
    world = dist.get_world_size()
    micro = MICRO * 2 // world
    opt = {"device": "nvme", "nvme_path": directory, "buffer_count": 1} if offload else None
    param = {"device": "nvme", "nvme_path": directory, "max_in_cpu": 0} if offload else None
    config = _config(stage, opt=opt, param=param if stage == 3 else None, micro=micro)
    engine, *_ = zerolap.initialize(model=make_model(seed=5), config=config)
    return third_step_from(engine, ckpt, micro)


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def test_checkpoint_with_offload_resumes_elsewhere_without_it(ranks, tmp_path):
    ckpt, swap = str(tmp_path / "ckpt"), str(tmp_path)
    want = ranks(2).run(save_and_continue, swap, ckpt, True)[0]
    # One process, stage 1, no offload: the swapped state came along in the checkpoint.
    got = ranks(1).run(resume, swap, ckpt, 1, False)[0]
    assert _close(got, want) < 1e-5
    # Two processes, stage 3 with offload again (state loaded into fresh swap files).
    got = ranks(2).run(resume, swap, ckpt, 3, True)[0]
    assert _close(got, want) < 1e-6
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_checkpoint_without_offload_resumes_with_it(ranks, tmp_path):
    ckpt, swap = str(tmp_path / "ckpt"), str(tmp_path)
    want = ranks(2).run(save_and_continue, swap, ckpt, False)[0]
    got = ranks(1).run(resume, swap, ckpt, 3, True)[0]
    assert _close(got, want) < 1e-5


# -- faults ---------------------------------------------------------------------------------------


def damage_then_step(directory: str, how: str, defer: bool, only_rank: int | None = None) -> str:
    """``only_rank``: the file of that rank alone is damaged. ``defer``: the swapped sub-groups
    step behind ``step()`` (offload_optimizer.defer_step), so the failure is agreed and raised
    one call later, by the next backward; without it, by the step that meets the damage."""
    opt = {"device": "nvme", "nvme_path": directory, "buffer_count": 1, "defer_step": defer}
    engine, *_ = zerolap.initialize(model=make_model(), config=_config(2, opt=opt))
    assert engine.optimizer.defer_step == defer
    _train(engine, range(1))
    engine.optimizer.finish_step()  # the swapped sub-groups stepped behind step()
    swapped = engine.optimizer.tiers[-1].state
    swapped.drain()  # the last write-back is done
    path = swapped.file.path
    if only_rank is not None and dist.get_rank() != only_rank:
        pass
    elif how == "cut":
        os.truncate(path, 4096)
    else:
        with open(path, "r+b") as f:
            f.seek(4096 + 10)
            f.write(b"\xff\xff\xff\xff")
    messages = []
    first = 2 if defer else 1  # the step whose call raises first
    for step in range(1, 4):  # later attempts are refused too: the state is not trusted again
        if step < first:
            _train(engine, range(step, step + 1))
            continue
        with pytest.raises(SwapError) as caught:
            _train(engine, range(step, step + 1))
        messages.append(str(caught.value))
    engine.destroy()
    assert not path.exists()
    return "\n".join([*messages[:2], str(path)])


@pytest.mark.parametrize("defer", [True, False], ids=["defer_step", "in_step"])
@pytest.mark.parametrize(
    ("how", "message"), [("cut", "cut short"), ("changed", "checksum mismatch")]
)
def test_a_damaged_swap_file_is_a_named_error(ranks, tmp_path, how, message, defer):
    answers = ranks(2).run(damage_then_step, str(tmp_path), how, defer)
    for text in answers:
        first, second, path = text.split("\n")
        assert message in first and path in first
        assert path in second


@pytest.mark.parametrize("defer", [True, False], ids=["defer_step", "in_step"])
def test_a_swap_file_damaged_on_one_rank_stops_every_rank(ranks, tmp_path, defer):
    """Rank 0's file cut short: rank 0 raises its own error, rank 1 (which stepped) raises one
    naming rank 0 (in step, before either publishes; behind it, once every gather has run);
    both refuse the next step, and nothing hangs."""
    damaged, other = ranks(2).run(damage_then_step, str(tmp_path), "cut", defer, 0, timeout=60)
    first, second, path = damaged.split("\n")
    assert "cut short" in first and path in first and path in second
    first, second, _ = other.split("\n")
    assert "rank 0's swapped optimizer state failed its step" in first
    assert second == first


def build(config) -> str:
    try:
        zerolap.initialize(model=make_model(), config=config)
    except (ConfigError, SwapError) as err:
        return f"{type(err).__name__}: {err}"
    return "built"


@pytest.mark.parametrize("block", ["offload_optimizer", "offload_param"])
def test_a_missing_nvme_path_fails_before_training(ranks, tmp_path, block):
    missing = str(tmp_path / "nowhere")
    config = _config(3)
    config["zero_optimization"][block] = {"device": "nvme", "nvme_path": missing}
    answer = ranks(1).run(build, config)[0]
    key = f"zero_optimization.{block}.nvme_path"
    assert answer == f"ConfigError: {key}: {missing} is not an existing directory"


@pytest.fixture
def mount_tmpfs(tmp_path):
    """Mount a small tmpfs with the given options (needs the right to mount; else skip)."""
    mounted = []

    def mount(options: str) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True
        )
        if done.returncode != 0:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


def test_unwritable_or_full_nvme_path_fails_before_training(ranks, mount_tmpfs):
    readonly = mount_tmpfs("ro,size=1m")
    config = _config(2, opt={"device": "nvme", "nvme_path": str(readonly)})
    answer = ranks(1).run(build, config)[0]
    assert answer == (
        f"ConfigError: zero_optimization.offload_optimizer.nvme_path: {readonly} is not writable"
    )
    tiny = mount_tmpfs("size=8k")
    config = _config(2, opt={"device": "nvme", "nvme_path": str(tiny)}, sub_group=0)
    answer = ranks(1).run(build, config)[0]
    assert answer.startswith(f"SwapError: cannot allocate swap file {tiny}/")
    assert "No space left on device" in answer and "free on" in answer
    assert os.listdir(tiny) == []


def build_with_rank1_on(config, block: str, path: str) -> str:
    """Rank 1's ``nvme_path`` is ``path``; the others' is the config's."""
    if dist.get_rank() == 1:
        config["zero_optimization"][block]["nvme_path"] = path
    return build(config)


@pytest.mark.parametrize(("stage", "block"), [(2, "offload_optimizer"), (3, "offload_param")])
def test_a_disk_full_on_one_rank_stops_every_rank_at_initialize(
    ranks, mount_tmpfs, tmp_path, stage, block
):
    full = mount_tmpfs("size=64k")
    with open(full / "filler", "wb") as f, contextlib.suppress(OSError):
        f.write(b"x" * (128 << 10))  # nothing left for a swap file
    config = _config(stage, sub_group=0)
    config["zero_optimization"][block] = {"device": "nvme", "nvme_path": str(tmp_path)}
    if block == "offload_param":
        config["zero_optimization"][block]["max_in_cpu"] = 0
    first, second = ranks(2).run(build_with_rank1_on, config, block, str(full), timeout=60)
    assert second.startswith(f"SwapError: cannot allocate swap file {full}/"), second
    # Without the agreement rank 0 went on into the next collective and waited for rank 1.
    assert first == (
        "SwapError: rank 1 could not set up its swap file (its own error says why), "
        "so no rank trains"
    )
    assert os.listdir(full) == ["filler"]


def offload_cpu_notes() -> list[str]:
    config = _config(3, opt={"device": "cpu"}, param={"device": "cpu"})
    with captured_logs() as messages:
        engine, *_ = zerolap.initialize(model=make_model(), config=config)
    engine.destroy()
    return [m for m in messages if "offload" in m]


def test_cpu_offload_on_a_cpu_host_is_said_once(ranks):
    notes = ranks(1).run(offload_cpu_notes)[0]
    assert len(notes) == 2, notes
    assert notes[0].startswith("INFO: zero_optimization.offload_optimizer.device 'cpu'")
    assert "already live in host memory" in notes[0]
    assert notes[1].startswith("INFO: zero_optimization.offload_param.device 'cpu'")


def offload_param_notes(directory: str, live: int | None) -> list[str]:
    param = {"device": "nvme", "nvme_path": directory}
    config = _config(3, param=param)
    if live is not None:
        config["zero_optimization"]["stage3_max_live_parameters"] = live
    with captured_logs() as messages:
        engine, *_ = zerolap.initialize(model=make_model(), config=config)
    engine.destroy()
    return [m for m in messages if "stage3_max_live_parameters" in m]


def test_offload_param_with_everything_live_is_said(ranks, tmp_path):
    # DeepSpeed's default lets the whole (small) model stay gathered: the swap then moves only
    # the shard, which a user setting offload_param should hear.
    notes = ranks(1).run(offload_param_notes, str(tmp_path), None)[0]
    assert len(notes) == 1 and "covers the whole model" in notes[0], notes
    assert ranks(1).run(offload_param_notes, str(tmp_path), 100)[0] == []


def test_differences_fail_on_a_nan_or_another_dtype():
    ones = torch.ones(3)
    want = ([ones], {0: {"exp_avg": ones}})
    nan = torch.tensor([1.0, float("nan"), 1.0])
    for rtol in (0.0, 1e-5):
        assert differences("nan", ([nan], want[1]), want, rtol)
        assert differences("nan", (want[0], {0: {"exp_avg": nan}}), want, rtol)
        assert differences("dtype", ([ones.bfloat16()], want[1]), want, rtol)
        assert differences("same", want, want, rtol) == []
    assert differences("close", ([ones + 1e-6], want[1]), want, 1e-5) == []
