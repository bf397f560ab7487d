"""Sharded checkpoints: exact resume, resume at another world size or stage, consolidation,
a save killed part-way, and every error a user can hit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.multiproc import run_on_ranks
from zerolap.checkpoint import CheckpointError, get_fp32_state_dict

GLOBAL_BATCH = 8


class Net(torch.nn.Module):
    """Tied weights, a LayerNorm, a buffer and dropout (so resuming must restore the RNG)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(11, width)
        self.hidden = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.drop = torch.nn.Dropout(0.1)
        self.out = torch.nn.Linear(width, 11, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, tokens, targets):
        h = self.drop(torch.tanh(self.hidden(self.embed(tokens)))) * self.scale
        logits = self.out(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 11, (GLOBAL_BATCH, 5), generator=g)
    return tokens, torch.roll(tokens, 1, dims=1)


def _engine(stage: int, *, dropout: bool = True, precision: str = "fp32", width: int = 16):
    model = Net(width)
    if not dropout:
        model.drop.p = 0.0
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100},
        "bf16": {"enabled": precision == "bf16"},
    }
    engine, *_ = zerolap.initialize(model=model, config=config)
    return engine


def _train(engine, first_step: int, steps: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = GLOBAL_BATCH // world
    for step in range(first_step, first_step + steps):
        tokens, targets = _batch(step)
        engine.backward(
            engine(
                tokens[rank * micro : (rank + 1) * micro],
                targets[rank * micro : (rank + 1) * micro],
            )
        )
        engine.step()


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in engine.module.parameters()]


def train_through(stage: int, precision: str, steps: int) -> list[torch.Tensor]:
    torch.manual_seed(100 + dist.get_rank())
    engine = _engine(stage, precision=precision)
    _train(engine, 0, steps)
    return _params(engine)


def train_and_save(stage: int, precision: str, steps: int, path: str, dropout: bool = True):
    torch.manual_seed(100 + dist.get_rank())
    engine = _engine(stage, precision=precision, dropout=dropout)
    _train(engine, 0, steps)
    engine.save_checkpoint(path, client_state={"epoch": 3})
    return _params(engine)


def load_and_train(
    stage: int, precision: str, first_step: int, steps: int, path: str, dropout: bool = True
):
    torch.manual_seed(999)  # whatever the new process does first, the checkpoint's RNG wins
    engine = _engine(stage, precision=precision, dropout=dropout)
    load_path, client = engine.load_checkpoint(path)
    assert client == {"epoch": 3} and load_path.endswith(f"global_step{first_step}")
    assert engine.global_steps == first_step
    _train(engine, first_step, steps)
    return _params(engine)


@pytest.mark.parametrize(
    ("stage", "precision"), [(0, "fp32"), (1, "fp32"), (2, "fp32"), (2, "bf16")]
)
def test_resume_is_exact(ranks, tmp_path, stage, precision):
    straight = ranks(2).run(train_through, stage, precision, 4)[0]
    ranks(2).run(train_and_save, stage, precision, 2, str(tmp_path))
    # A new pair of processes continues from the checkpoint.
    from tests.comm.test_env import LAUNCHERS

    def resumed_env(rank, port):
        return LAUNCHERS["torchrun"](rank, port)

    resumed = run_on_ranks(
        _resume_entry, 2, stage, precision, str(tmp_path), env=resumed_env, init=False
    )[0]
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def _resume_entry(stage, precision, path):
    torch.set_num_threads(1)
    dist.init_distributed(verbose=False)
    return load_and_train(stage, precision, 2, 2, path)


def _reference(steps: int) -> list[torch.Tensor]:
    model = Net()
    model.drop.p = 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    from zerolap.runtime.lr_schedules import WarmupLR

    sched = WarmupLR(opt, warmup_num_steps=5)
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        model(*_batch(step)).backward()
        opt.step()
        sched.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("saved", "loaded"), [((2, 2), (4, 1)), ((4, 2), (2, 2)), ((4, 1), (1, 0)), ((2, 0), (2, 2))]
)
def test_resume_at_another_world_size_and_stage(ranks, tmp_path, saved, loaded):
    (n_saved, stage_saved), (n_loaded, stage_loaded) = saved, loaded
    ranks(n_saved).run(train_and_save, stage_saved, "fp32", 2, str(tmp_path), False)
    resumed = ranks(n_loaded).run(load_and_train, stage_loaded, "fp32", 2, 2, str(tmp_path), False)[
        0
    ]
    for got, want in zip(resumed, _reference(4), strict=True):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def check_consolidation(path: str, precision: str) -> list:
    torch.manual_seed(0)
    engine = _engine(2, precision=precision)
    _train(engine, 0, 2)
    engine.save_checkpoint(path)
    master = engine.optimizer.master
    return [_params(engine), None if master is None else master.clone()]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_consolidated_state_dict_loads_into_the_plain_model(ranks, tmp_path, precision):
    live, _ = ranks(2).run(check_consolidation, str(tmp_path), precision)[0]
    state = get_fp32_state_dict(tmp_path)
    assert all(t.dtype == torch.float32 for t in state.values() if t.is_floating_point())
    plain = Net()
    plain.load_state_dict(state, strict=True)  # tied keys, buffer and all
    for got, want in zip(plain.parameters(), live, strict=True):
        if precision == "fp32":
            assert torch.equal(got, want)
        else:  # the fp32 master, which the bf16 parameters are a rounding of
            assert torch.equal(got.bfloat16().float(), want)
    assert plain.scale.item() == 1.5


def save_then_crash(path: str) -> None:
    """Save a good checkpoint, then die in the middle of writing the next one."""
    from zerolap.checkpoint import files

    engine = _engine(1)
    _train(engine, 0, 1)
    engine.save_checkpoint(path, tag="good")
    real_save = torch.save

    def dying_save(obj, target):
        real_save(obj, target)
        with open(target, "r+b") as f:  # half the bytes made it to disk
            f.truncate(os.path.getsize(target) // 2)
        os._exit(9)

    files.torch.save = dying_save
    _train(engine, 1, 1)
    engine.save_checkpoint(path, tag="good")  # the same tag: the old one must survive


def load_after_crash(path: str):
    engine = _engine(1)
    engine.load_checkpoint(path)
    return engine.global_steps


def test_a_save_killed_part_way_leaves_the_previous_checkpoint(tmp_path):
    from tests.multiproc import RankFailure

    with pytest.raises(RankFailure, match="exited with code 9"):
        run_on_ranks(_crash_entry, 1, str(tmp_path), init=True, timeout=120)
    assert (tmp_path / "latest").read_text() == "good"
    assert (tmp_path / "good.partial").exists()  # the interrupted save, never published
    assert run_on_ranks(load_after_crash, 1, str(tmp_path)) == [1]


def _crash_entry(path):
    save_then_crash(path)


def check_errors(path: str) -> None:
    root = Path(path)
    engine = _engine(2)
    _train(engine, 0, 1)
    engine.save_checkpoint(root, tag="t")
    dist.barrier()
    with pytest.raises(CheckpointError, match="tag 'nope' not found"):
        engine.load_checkpoint(root, tag="nope")
    with pytest.raises(CheckpointError, match="not a checkpoint directory: no 'latest' file"):
        engine.load_checkpoint(root / "t")
    other = _engine(2, width=8)
    with pytest.raises(CheckpointError, match=r"another model.*hidden.weight: saved \(16, 16\)"):
        other.load_checkpoint(root)
    dist.barrier()
    if dist.get_rank() == 0:
        shard = root / "t" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 3])
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"optimizer shard of rank 1 .* is truncated"):
        engine.load_checkpoint(root)
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "t" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    dist.barrier()
    with pytest.raises(CheckpointError, match="missing optimizer shard of rank 1"):
        engine.load_checkpoint(root)


def test_errors_name_the_problem(ranks, tmp_path):
    ranks(2).run(check_errors, str(tmp_path))


def test_cli_consolidate(ranks, tmp_path):
    import subprocess
    import sys

    live, _ = ranks(2).run(check_consolidation, str(tmp_path / "ckpt"), "fp32")[0]
    out = tmp_path / "model.pt"
    cli = [sys.executable, "-m", "zerolap.cli", "consolidate"]
    result = subprocess.run(
        [*cli, str(tmp_path / "ckpt"), str(out)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    plain = Net()
    plain.load_state_dict(torch.load(out), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), live, strict=True))
    bad = subprocess.run(
        [*cli, str(tmp_path), str(out)], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "is not a checkpoint directory" in bad.stderr
