"""The engine against the ZeRO formulas (memory, bytes on the wire), the overlap of bucket
reductions with backward, mixed precision, and its errors."""

from __future__ import annotations

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.zero.models import global_batch, loss_fn, make_model
from zerolap.config import ConfigError
from zerolap.zero.bucket import BucketState


def wide_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(128, 128), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(128, 1))


def _config(stage: int, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 8192,
            "overlap_comm": True,
            **zero,
        },
    }


def _train_step(engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    x = torch.randn(8, 128, generator=g)
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def check_memory_against_formulas() -> list[dict]:
    rows = []
    for stage in (0, 1, 2):
        engine, *_ = zerolap.initialize(model=wide_mlp(), config=_config(stage))
        _train_step(engine, 0)  # optimizer state exists from here on
        g = torch.Generator().manual_seed(1)
        engine.backward(engine(torch.randn(8, 128, generator=g)).pow(2).mean())
        after_backward = engine.memory_breakdown()
        assert all(
            b.buffer is None and b.state == BucketState.REDUCED for b in engine.reducer.buckets
        ), "bucket buffers outlived their reduction"
        engine.step()
        after_step = engine.memory_breakdown()
        for when, m in (("after backward", after_backward), ("after step", after_step)):
            rows.append({"stage": stage, "when": when, **m.as_dict()})
    return rows


def test_memory_per_rank_matches_the_zero_formulas(ranks):
    n = 4
    for rows in ranks(n).run(check_memory_against_formulas):
        for row in rows:
            psi = row["numel"]
            per_param = {0: 16, 1: 8 + 8 / n, 2: 4 + 12 / n}[row["stage"]]
            assert row["expected_bytes"] == pytest.approx(psi * per_param)
            assert row["total_bytes"] == pytest.approx(row["expected_bytes"], rel=0.05), row
            # Never above the ZeRO paper's accounting (16, 8 + 12/N, 4 + 16/N in fp32).
            assert row["total_bytes"] <= row["zero_formula_bytes"] * 1.01, row
            if row["stage"] == 2:
                assert row["grads_bytes"] == pytest.approx(psi * 4 / n, rel=0.02), row
                # Plus a few reusable bucket buffers, each the largest bucket: a 128 x 128
                # weight exceeds reduce_bucket_size and gets a bucket of its own.
                assert 0 < row["bucket_buffer_bytes"] <= 4 * 128 * 128 * 4, row


def check_wire_bytes_per_step(stage: int, reduce_scatter: bool) -> tuple[int, int]:
    engine, *_ = zerolap.initialize(
        model=wide_mlp(), config=_config(stage, reduce_scatter=reduce_scatter)
    )
    _train_step(engine, 0)
    dist.configure(enabled=True)
    dist.reset_log()
    try:
        _train_step(engine, 1)
        # Stages 1-2 leave the parameter gathers in flight: a read of the values waits.
        _ = [p.detach() for p in engine.module.parameters()]
        sent = sum(r.wire_bytes for r in dist.COMMS_LOGGER.records)
        ops = {r.op for r in dist.COMMS_LOGGER.records}
    finally:
        dist.configure(enabled=False)
        dist.reset_log()
    if stage > 0:
        assert "ring_all_gather" in ops
        assert ("ring_reduce_scatter" in ops) == reduce_scatter
    return sent, sum(p.numel() for p in engine.params)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    ("stage", "reduce_scatter"), [(0, False), (1, True), (1, False), (2, True), (2, False)]
)
def test_wire_volume_per_step(ranks, world_size, stage, reduce_scatter):
    results = ranks(world_size).run(check_wire_bytes_per_step, stage, reduce_scatter)
    for sent, psi in results:
        ddp = 2 * psi * (world_size - 1) / world_size * 4
        if stage > 0 and not reduce_scatter:
            ddp *= 1.5  # an all-reduce per bucket (2) plus the parameter all-gather (1)
        assert sent == pytest.approx(ddp, rel=0.05), (sent, ddp)


def check_overlap(overlap: bool) -> tuple[int, int, bool, int]:
    engine, *_ = zerolap.initialize(model=wide_mlp(), config=_config(2, overlap_comm=overlap))
    dist.configure(enabled=True)
    dist.reset_log()
    try:
        _train_step(engine, 0)
        end = engine.reducer.last_timing.compute_end
        spans = [
            (r.start, r.waited) for r in dist.COMMS_LOGGER.records if r.op == "ring_reduce_scatter"
        ]
    finally:
        dist.configure(enabled=False)
        dist.reset_log()
    during = [waited for start, waited in spans if start < end]
    # Reductions launched during backward were also waited for there (autograd held back).
    waited_inside = all(waited is not None and waited[1] < end for waited in during)
    return len(during), len(spans), waited_inside, len(engine.layout.buckets)


def test_overlap_launches_buckets_while_backward_computes(ranks):
    for during, total, _, _ in ranks(2).run(check_overlap, True):
        assert total > 2
        assert during == total, "every bucket completes in a hook: all launch before autograd ends"
    for during, total, waited_inside, buckets in ranks(2).run(check_overlap, False):
        # Without overlap_comm nothing runs under autograd: buckets wait for its end, except
        # when stage 2's pool of 4 bucket buffers runs out; then the ready ones are reduced
        # and waited for at once.
        assert buckets > 4 and total > 2
        assert 0 < during < total and waited_inside, (during, total)


def check_fp16_overflow_is_skipped_on_every_rank() -> dict:
    config = _config(2)
    config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1}
    engine, *_ = zerolap.initialize(model=wide_mlp(), config=config)
    assert engine.module[0].weight.dtype == torch.float16
    x = torch.randn(8, 128).half()
    before = [p.detach().clone() for p in engine.module.parameters()]
    loss = engine(x).float().pow(2).mean()
    if dist.get_rank() == 1:
        loss = loss * float("inf")  # only one rank overflows
    engine.backward(loss)
    engine.step()
    unchanged = all(
        torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True)
    )
    result = {
        "applied": engine.was_step_applied(),
        "skipped": engine.skipped_steps,
        "scale": engine.loss_scaler.loss_scale,
        "unchanged": unchanged,
    }
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    result["applied_after"] = engine.was_step_applied()
    return result


def test_fp16_overflow_skips_the_step_on_all_ranks(ranks):
    for result in ranks(2).run(check_fp16_overflow_is_skipped_on_every_rank):
        assert result == {
            "applied": False,
            "skipped": 1,
            "scale": 128.0,
            "unchanged": True,
            "applied_after": True,
        }


def check_bf16_trains_and_tracks_fp32(stage: int) -> tuple[float, float]:
    losses = {}
    for precision in ("fp32", "bf16"):
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
            "bf16": {"enabled": precision == "bf16"},
        }
        engine, *_ = zerolap.initialize(model=make_model(), config=config)
        trace = []
        for step in range(8):
            tokens, targets = global_batch(step % 2, 2 * dist.get_world_size())
            lo = dist.get_rank() * 2
            loss = loss_fn(engine(tokens[lo : lo + 2]).float(), targets[lo : lo + 2])
            engine.backward(loss)
            engine.step()
            trace.append(loss.item())
        if precision == "bf16":
            assert engine.optimizer.master is not None
            assert engine.optimizer.master.dtype == torch.float32
        losses[precision] = trace
    assert losses["bf16"][-1] < losses["bf16"][0] - 0.3, losses
    return losses["fp32"][-1], losses["bf16"][-1]


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_mixed_precision(ranks, stage):
    for fp32, bf16 in ranks(2).run(check_bf16_trains_and_tracks_fp32, stage):
        assert bf16 == pytest.approx(fp32, abs=0.05)


def _bf16_master_engine(stage: int, masters: bool = True):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
        # Stage 3 with every parameter sharded (this model's would all persist whole).
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 200,
            "stage3_param_persistence_threshold": 0,
        },
        "bf16": {
            "enabled": True,
            "bf16_master_weights_and_grads": masters,
            "bf16_optimizer_states": masters,
        },
    }
    engine, *_ = zerolap.initialize(model=make_model(), config=config)
    return engine


def _bf16_master_step(engine, step: int) -> None:
    """The step's two micro-batches, up to (not including) the step at the boundary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(step, 4 * world)
    for micro in range(2):
        mine = slice(2 * (micro * world + rank), 2 * (micro * world + rank) + 2)
        engine.backward(loss_fn(engine(tokens[mine]).float(), targets[mine]))
        if micro == 0:
            engine.step()  # not a boundary: nothing steps


def _gathered(engine) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    with zerolap.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def check_bf16_masters(stage: int, ckpt: str) -> dict:
    """bf16.bf16_master_weights_and_grads + bf16_optimizer_states: no fp32 master, bf16
    gradients and optimizer state, each step torch's AdamW on the bf16 parameters with the
    reduced bf16 gradients, bitwise; a checkpoint resumes bitwise."""
    engine = _bf16_master_engine(stage)
    reference = make_model().to(torch.bfloat16)
    # What the ds_config builds: torch's fused AdamW (zerolap.runtime.optimizers).
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.02, weight_decay=0.01, fused=True)
    params = list(engine.module.parameters())
    world = dist.get_world_size()
    for step in range(3):
        _bf16_master_step(engine, step)
        if step == 0:  # the reduced bf16 gradients against one process's, to bf16's precision
            single = make_model().to(torch.bfloat16)
            tokens, targets = global_batch(0, 4 * world)
            for part in range(2 * world):
                chunk = slice(2 * part, 2 * part + 2)
                (loss_fn(single(tokens[chunk]).float(), targets[chunk]) / (2 * world)).backward()
            worst = max(
                ((zerolap.utils.safe_get_full_grad(p) - s.grad.float()).abs().max()
                 / s.grad.float().abs().max()).item()
                for p, s in zip(params, single.parameters(), strict=True)
            )  # fmt: skip
            assert worst < 0.02, worst
        for param, ref in zip(params, reference.parameters(), strict=True):
            ref.grad = zerolap.utils.safe_get_full_grad(param).to(torch.bfloat16)
        engine.step()
        optimizer.step()
    trained = _gathered(engine)
    equal = all(torch.equal(p, r) for p, r in zip(trained, reference.parameters(), strict=True))
    states = {t.dtype for s in engine.optimizer.state.values() for t in s.values() if t.dim()}
    grads = engine.grads.shard.dtype if stage >= 2 else engine.grads.flat.dtype
    result = {"equal": equal, "master": engine.optimizer.master, "states": states, "grads": grads}
    memory = engine.memory_breakdown()  # bf16 parameters, gradients and two moments, no master
    bytes_per_param = {1: 4 + 4 / 2, 2: 2 + 6 / 2, 3: 8 / 2}[stage]
    assert memory.expected_bytes == memory.numel * bytes_per_param
    assert abs(memory.total_bytes - memory.expected_bytes) < 0.01 * memory.expected_bytes
    engine.save_checkpoint(ckpt, tag="three")
    _bf16_master_step(engine, 3)
    engine.step()
    continued = _gathered(engine)
    engine.destroy()
    engine = _bf16_master_engine(stage)
    engine.load_checkpoint(ckpt, tag="three")
    _bf16_master_step(engine, 3)
    engine.step()
    resumed = _gathered(engine)
    engine.destroy()
    result["resumed"] = all(torch.equal(a, b) for a, b in zip(continued, resumed, strict=True))
    return result


def check_bf16_masters_switched_at_resume(stage: int, ckpt: str) -> list[bool]:
    """A checkpoint saved with fp32 masters resumes with bf16 ones and the other way round:
    the parameters as saved, the optimizer state in the new masters' dtype, a step taken."""
    out = []
    for saved_with, loaded_with in ((False, True), (True, False)):
        engine = _bf16_master_engine(stage, masters=saved_with)
        for step in range(2):
            _bf16_master_step(engine, step)
            engine.step()
        engine.save_checkpoint(ckpt, tag=f"saved-{saved_with}")
        saved = _gathered(engine)
        engine.destroy()
        engine = _bf16_master_engine(stage, masters=loaded_with)
        engine.load_checkpoint(ckpt, tag=f"saved-{saved_with}")
        loaded = _gathered(engine)
        dtypes = {t.dtype for s in engine.optimizer.state.values() for t in s.values() if t.dim()}
        _bf16_master_step(engine, 2)
        engine.step()
        out.append(
            all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True))
            and dtypes == {torch.bfloat16 if loaded_with else torch.float32}
            and engine.was_step_applied()
        )
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_masters_switched_at_resume(ranks, stage, tmp_path):
    for result in ranks(2).run(check_bf16_masters_switched_at_resume, stage, str(tmp_path)):
        assert result == [True, True]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_masters_step_the_parameters_themselves(ranks, stage, tmp_path):
    for result in ranks(2).run(check_bf16_masters, stage, str(tmp_path)):
        assert result == {
            "equal": True,
            "master": None,
            "states": {torch.bfloat16},
            "grads": torch.bfloat16,
            "resumed": True,
        }


def check_bf16_gradients_averaged_in_fp32(stage: int, prescale: bool) -> tuple[float, float]:
    """With fp32 communication each rank's bf16 gradients are summed and divided in fp32: stage
    2 keeps that fp32 average, stage 1 rounds it to bf16 once (its buffer is the parameters'
    dtype). Returns the worst relative error and the share of elements off by more than 1e-6."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
        "bf16": {"enabled": True},
        "communication_data_type": "fp32",
        "prescale_gradients": prescale,
    }
    engine, *_ = zerolap.initialize(model=make_model(), config=config)
    reference = make_model().to(torch.bfloat16)
    tokens, targets = global_batch(0, 2 * world)
    mine = slice(2 * rank, 2 * rank + 2)
    engine.backward(loss_fn(engine(tokens[mine]).float(), targets[mine]))
    loss_fn(reference(tokens[mine]).float(), targets[mine]).backward()
    worst, off, total = 0.0, 0, 0
    for param, local in zip(engine.module.parameters(), reference.parameters(), strict=True):
        expected = local.grad.float()
        dist.all_reduce(expected)
        expected /= world
        if stage == 1:
            expected = expected.bfloat16().float()
        error = (zerolap.utils.safe_get_full_grad(param) - expected).abs() / (expected.abs() + 1e-6)
        worst = max(worst, error.max().item())
        off += int((error > 1e-6).sum())
        total += error.numel()
    engine.destroy()
    return worst, off / total


@pytest.mark.parametrize("stage,prescale", [(1, False), (2, False), (2, True)])
def test_bf16_gradients_are_averaged_in_fp32(ranks, stage, prescale):
    # World 3: 1/3 is inexact in bf16, so a gradient divided before the fp32 sum and rounded
    # to bf16 would show (in about half the elements).
    for worst, off in ranks(3).run(check_bf16_gradients_averaged_in_fp32, stage, prescale):
        if stage == 2:
            assert worst < 1e-5
        else:  # the fp32 sum's order may differ from all_reduce's: a rare bf16 rounding tie
            assert off < 1e-3


def check_communication_dtype_halves_bytes() -> tuple[list[int], list[int], float]:
    config = _config(2, reduce_scatter=True)
    config["communication_data_type"] = "fp16"
    engine, *_ = zerolap.initialize(model=wide_mlp(), config=config)
    reference, *_ = zerolap.initialize(model=wide_mlp(), config=_config(2))
    dist.configure(enabled=True)
    dist.reset_log()
    try:
        _train_step(engine, 0)
        sent = [r.message_bytes for r in dist.COMMS_LOGGER.records if r.op == "ring_reduce_scatter"]
    finally:
        dist.configure(enabled=False)
        dist.reset_log()
    _train_step(reference, 0)
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(engine.module.parameters(), reference.module.parameters(), strict=True)
    )
    return sorted(sent), sorted(b.numel * 2 for b in engine.layout.buckets), diff


def test_fp16_communication_data_type(ranks):
    for sent, fp16_buckets, diff in ranks(2).run(check_communication_dtype_halves_bytes):
        assert sent == fp16_buckets  # every bucket travels as fp16: half the fp32 bytes
        assert diff < 1e-3  # and training follows the fp32-reduced run closely


def check_errors_before_training() -> None:
    with pytest.raises(ConfigError, match=r"zero_optimization\.stag: unknown key; did you mean"):
        zerolap.initialize(
            model=wide_mlp(), config={"train_batch_size": 8, "zero_optimization": {"stag": 1}}
        )
    # No optimizer anywhere: an engine that runs forward only, and says so when asked to train.
    engine, optimizer, _, scheduler = zerolap.initialize(
        model=wide_mlp(), config={"train_batch_size": 8 * dist.get_world_size()}
    )
    assert optimizer is None and scheduler is None and engine.optimizer is None
    with pytest.raises(RuntimeError, match=r"engine.backward\(\) needs an optimizer"):
        engine.backward(engine(torch.ones(2, 128)).sum())
    engine, *_ = zerolap.initialize(model=wide_mlp(), config=_config(2))
    with (
        pytest.raises(RuntimeError, match="no_sync is not possible with ZeRO stage 2"),
        engine.no_sync(),
    ):
        pass
    mixed = wide_mlp()
    mixed[0].half()
    with pytest.raises(ValueError, match="must share one dtype"):
        zerolap.initialize(model=mixed, config=_config(1))
    _train_step(engine, 0)  # the group is still usable


def test_errors_before_training(ranks):
    ranks(2).run(check_errors_before_training)


def check_no_sync_frozen_and_two_engines() -> None:
    model = wide_mlp()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    a, *_ = zerolap.initialize(model=model, config=_config(1))
    b, *_ = zerolap.initialize(model=wide_mlp(), config=_config(0))
    x = torch.randn(8, 128)
    with a.no_sync():
        a.backward(a(x).pow(2).mean())
    assert a.grads.flat.abs().sum() > 0  # accumulated locally
    a.backward(a(x).pow(2).mean())
    a.step()
    b.backward(b(x).pow(2).mean())
    assert b.module[0].weight.grad is not None  # stage 0 shows gradients as DDP does
    b.step()
    assert torch.equal(model[0].weight, frozen)
    assert a.global_steps == 1 and b.global_steps == 1


def test_no_sync_frozen_params_and_coexisting_engines(ranks):
    ranks(2).run(check_no_sync_frozen_and_two_engines)
