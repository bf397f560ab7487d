"""ds_config's monitors on real engines: what rank 0 writes to CSV files and TensorBoard, at
which sample counts, with which values; the pipeline engine's losses; a missing package named
before training on every rank."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import torch

import zerolap
from tests.pipe import models
from tests.pipe.test_engine import _config as _pipe_config
from zerolap.config import ConfigError

STEPS, GAS, MICRO = 3, 2, 4
TIMERS = ("forward", "backward", "backward_inner", "backward_allreduce", "step")


def _rows(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    with path.open(newline="") as file:
        header, *rows = list(csv.reader(file))
    return header, [(int(step), float(value)) for step, value in rows]


def check_engine_events(out: str) -> dict:
    """fp16, accumulation 2, a warmup schedule and the timers: rank 0's records of what the
    monitors should hold."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "fp16": {"enabled": True, "initial_scale_power": 8},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 200},
        "wall_clock_breakdown": True,
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": "job"},
        "tensorboard": {"enabled": True, "output_path": out, "job_name": "job"},
    }
    engine, *_ = zerolap.initialize(model=model, config=config)
    rank = torch.distributed.get_rank()
    steps = []
    for step in range(STEPS):
        losses = []
        for micro in range(GAS):
            generator = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x = torch.randn(MICRO, 16, generator=generator).half()
            loss = engine(x).float().pow(2).mean()
            losses.append(loss.detach().float())
            engine.backward(loss)
            engine.step()
        steps.append(
            {
                "samples": engine.global_samples,
                "train_loss": ((losses[0] + losses[1]) / 2).item(),
                "lr": engine.get_lr()[0],
                "loss_scale": engine.loss_scaler.loss_scale,
            }
        )
    writers = [type(m).__name__ for m in engine.monitor.monitors]
    enabled = engine.monitor.enabled
    engine.destroy()
    return {"steps": steps, "writers": writers, "enabled": enabled}


def test_csv_and_tensorboard_hold_rank_0s_step_events(ranks, tmp_path):
    results = ranks(2).run(check_engine_events, str(tmp_path))
    assert results[0]["writers"] == ["TensorBoardMonitor", "CsvMonitor"]
    assert results[1]["writers"] == [] and results[1]["enabled"]  # enabled, writes nothing
    expected = results[0]["steps"]
    samples = [entry["samples"] for entry in expected]
    assert samples == [MICRO * GAS * 2 * (i + 1) for i in range(STEPS)]
    job = tmp_path / "job"
    for name in ("train_loss", "lr", "loss_scale"):
        header, rows = _rows(job / f"Train_Samples_{name}.csv")
        assert header == ["step", name]
        # Exactly one row per step: rank 1 wrote nothing into the shared directory.
        assert rows == [(entry["samples"], entry[name]) for entry in expected], name
    assert len({entry["lr"] for entry in expected}) == STEPS  # the warmup moves it
    timed = {}
    for timer in TIMERS:
        header, rows = _rows(job / f"Train_Samples_elapsed_time_ms_{timer}.csv")
        assert header == ["step", f"elapsed_time_ms_{timer}"]
        assert [step for step, _ in rows] == samples
        assert all(value > 0 for _, value in rows), timer
        timed[timer] = [value for _, value in rows]
    for whole, inner, wait in zip(
        timed["backward"], timed["backward_inner"], timed["backward_allreduce"], strict=True
    ):
        assert math.isclose(whole, inner + wait, rel_tol=1e-9)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(job))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {f"Train/Samples/{n}" for n in ("train_loss", "lr", "loss_scale")} <= tags
    assert {f"Train/Samples/elapsed_time_ms_{t}" for t in TIMERS} <= tags
    for name in ("train_loss", "lr", "loss_scale"):
        scalars = events.Scalars(f"Train/Samples/{name}")
        assert [s.step for s in scalars] == samples
        for scalar, entry in zip(scalars, expected, strict=True):  # stored as float32
            assert scalar.value == torch.tensor(entry[name], dtype=torch.float32).item()


def check_missing_package(block: str, module: str) -> str:
    hidden = sys.modules.get(module, "absent")
    sys.modules[module] = None  # an import of it fails, as if not installed
    try:
        model = torch.nn.Linear(4, 1)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            block: {"enabled": True},
        }
        with pytest.raises(ConfigError) as caught:
            zerolap.initialize(model=model, config=config)
        return str(caught.value)
    finally:
        if hidden == "absent":
            del sys.modules[module]
        else:
            sys.modules[module] = hidden


@pytest.mark.parametrize(
    ("block", "module"), [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("comet", "comet_ml")]
)
def test_a_missing_package_fails_initialize_on_every_rank(ranks, block, module):
    messages = ranks(2).run(check_missing_package, block, module)
    for message in messages:
        assert f"{block}.enabled is true" in message and module in message, message
        assert "pip install" in message


def check_pipeline_losses(out: str) -> dict:
    module = models.pipeline(2)
    config = _pipe_config(1, 2, csv_monitor={"enabled": True, "output_path": out})
    engine, *_ = zerolap.initialize(model=module, config=config)
    train = []
    for step in range(2):
        loss = engine.train_batch(iter(models.micro_batches(step, 2, 1, 0)))
        train.append((engine.global_samples, loss.item()))
    # bcast_loss=False: the last stage alone returns it, but rank 0 (stage 0) still writes it.
    evaluated = engine.eval_batch(iter(models.micro_batches(5, 2, 1, 0)), bcast_loss=False)
    out_loss = None if evaluated is None else evaluated.item()
    return {"train": train, "eval": (engine.global_samples, out_loss)}


def test_pipeline_engine_writes_train_and_eval_losses(ranks, tmp_path):
    first, last = ranks(2).run(check_pipeline_losses, str(tmp_path))
    assert first["train"] == last["train"]
    job = tmp_path / "DeepSpeedJobName"  # DeepSpeed's default job name
    assert _rows(job / "Train_Samples_train_loss.csv") == (["step", "train_loss"], first["train"])
    assert _rows(job / "Train_Samples_eval_loss.csv") == (["step", "eval_loss"], [last["eval"]])
    samples = [models.MICRO * 2, models.MICRO * 4]  # 2 micro-batches a step, one data rank
    assert [step for step, _ in first["train"]] == samples
    assert [step for step, _ in _rows(job / "Train_Samples_lr.csv")[1]] == samples


def check_monitor_failures(out: str) -> dict:
    from tests.logs import captured_logs

    model = torch.nn.Linear(4, 1)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "csv_monitor": {"enabled": True, "output_path": str(Path(out) / "a-file")},
    }
    with pytest.raises(ConfigError) as caught:  # rank 0 cannot make its directory
        zerolap.initialize(model=model, config=config)
    started = str(caught.value)
    config["csv_monitor"]["output_path"] = out
    engine, *_ = zerolap.initialize(model=model, config=config)
    with captured_logs() as logs:
        for step in range(3):
            if step == 1 and torch.distributed.get_rank() == 0:
                written = Path(out) / "DeepSpeedJobName" / "Train_Samples_lr.csv"
                written.unlink()
                written.mkdir()  # a directory where the file was: it cannot be appended to
            engine.backward(engine(torch.randn(2, 4)).pow(2).sum())
            engine.step()
    return {
        "started": started,
        "errors": [line for line in logs if "monitor failed" in line],
        "writers": len(engine.monitor.monitors),
        "steps": engine.global_steps,
    }


def test_a_monitor_that_fails_fails_initialize_on_every_rank_or_goes_off(ranks, tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    first, second = ranks(2).run(check_monitor_failures, str(tmp_path))
    assert "csv_monitor: NotADirectoryError" in first["started"]
    assert "could not start on rank 0" in second["started"]
    # A write that fails mid-run: said once, the writer off, the training on.
    assert len(first["errors"]) == 1 and "csv_monitor" in first["errors"][0]
    assert first["writers"] == 0 and first["steps"] == second["steps"] == 3
    assert second["errors"] == []


def check_profiler_sends_timers(out: str) -> list[str]:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "flops_profiler": {"enabled": True, "output_file": str(Path(out) / "flops.txt")},
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": "job"},
    }
    engine, *_ = zerolap.initialize(model=torch.nn.Linear(4, 1), config=config)
    engine.backward(engine(torch.randn(2, 4)).pow(2).sum())
    engine.step()
    return sorted(p.name for p in (Path(out) / "job").iterdir())


def test_the_flops_profiler_sends_the_timers_as_deepspeed_does(ranks, tmp_path):
    names = ranks(2).run(check_profiler_sends_timers, str(tmp_path))[0]
    assert {f"Train_Samples_elapsed_time_ms_{timer}.csv" for timer in TIMERS} <= set(names)
