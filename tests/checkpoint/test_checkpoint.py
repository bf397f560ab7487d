"""Sharded checkpoints: exact resume, resume at another world size or stage, consolidation,
a save killed part-way, and every error a user can hit.

Under stage 3 the model has units of both kinds: ``embed`` (tied with ``out``) and ``hidden``
are sharded, ``norm`` (32 elements, under the persistence threshold) stays whole."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.logs import captured_logs
from tests.multiproc import run_on_ranks
from zerolap.checkpoint import CheckpointError, get_fp32_state_dict
from zerolap.checkpoint.files import MODEL_FILE
from zerolap.zero import GatheredParameters

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


def _engine(
    stage: int,
    *,
    dropout: bool = True,
    precision: str = "fp32",
    width: int = 16,
    zero: dict | None = None,
    model_parameters=None,
    micro: int | None = None,
):
    model = Net(width)
    if not dropout:
        model.drop.p = 0.0
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": micro or GLOBAL_BATCH // dist.get_world_size(),
        "gradient_clipping": 0.0,  # the references below do not clip
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
        # warmup_min_lr > 0: every step moves the weights, so a load that left them as a fresh
        # model has them cannot pass for one that restored them.
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_num_steps": 5}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 100,
            "stage3_param_persistence_threshold": 50,
            **(zero or {}),
        },
        "bf16": {"enabled": precision == "bf16"},
    }
    chosen = model_parameters(model) if model_parameters else None
    engine, *_ = zerolap.initialize(model=model, config=config, model_parameters=chosen)
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
    """Whole parameters (gathered under stage 3), in fp32."""
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


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
    ("stage", "precision"),
    [(0, "fp32"), (1, "fp32"), (2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")],
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

    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_num_steps=5)
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        model(*_batch(step)).backward()
        opt.step()
        sched.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ((2, 2), (4, 1)),
        ((4, 2), (2, 2)),
        ((4, 1), (1, 0)),
        ((2, 0), (2, 2)),
        ((2, 2), (2, 3)),
        ((2, 3), (4, 3)),
        ((4, 3), (2, 2)),
        ((4, 3), (1, 1)),
    ],
)
def test_resume_at_another_world_size_and_stage(ranks, tmp_path, saved, loaded):
    (n_saved, stage_saved), (n_loaded, stage_loaded) = saved, loaded
    ranks(n_saved).run(train_and_save, stage_saved, "fp32", 2, str(tmp_path), False)
    resumed = ranks(n_loaded).run(load_and_train, stage_loaded, "fp32", 2, 2, str(tmp_path), False)[
        0
    ]
    for got, want in zip(resumed, _reference(4), strict=True):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def resume_accumulating_more(path: str, stage: int) -> tuple[list[torch.Tensor], list[int]]:
    """One rank resumes what two ranks saved, with the same global batch: two micro-batches
    of half of it per step, where the saved run took one per rank."""
    engine = _engine(stage, dropout=False, micro=GLOBAL_BATCH // 2)
    engine.load_checkpoint(path)
    steps_after = []
    for step in (3, 4):
        tokens, targets = _batch(step)
        for half in (slice(0, GLOBAL_BATCH // 2), slice(GLOBAL_BATCH // 2, None)):
            engine.backward(engine(tokens[half], targets[half]))
            engine.step()
            steps_after.append(engine.global_steps)
    return _params(engine), steps_after


@pytest.mark.parametrize("stage", [0, 2])
def test_resume_with_another_accumulation_count_steps_on_whole_batches(ranks, tmp_path, stage):
    # 3 steps of one micro-batch per rank: the saved micro_steps (3) is odd, so a resume that
    # kept it would step after the first of two micro-batches.
    ranks(2).run(train_and_save, stage, "fp32", 3, str(tmp_path), False)
    params, steps_after = ranks(1).run(resume_accumulating_more, str(tmp_path), stage)[0]
    assert steps_after == [3, 4, 4, 5]
    for got, want in zip(params, _reference(5), strict=True):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def saved_mid_step(path: str) -> list[str]:
    engine = _engine(0, dropout=False, micro=GLOBAL_BATCH // 2)  # 2 micro-batches per step
    tokens, targets = _batch(0)
    engine.backward(engine(tokens[: GLOBAL_BATCH // 2], targets[: GLOBAL_BATCH // 2]))
    engine.step()
    engine.save_checkpoint(path, tag="mid")
    with captured_logs() as logs:
        engine.load_checkpoint(path, tag="mid")
    assert not engine.is_gradient_accumulation_boundary()  # the next micro-batch starts step 1
    return logs


def test_a_save_between_micro_batches_warns_that_the_step_restarts(ranks, tmp_path):
    logs = ranks(1).run(saved_mid_step, str(tmp_path))[0]
    assert (
        "WARNING: the checkpoint was saved 1 micro-batch(es) into step 1, whose accumulated "
        "gradients a checkpoint does not hold: that step starts afresh" in logs
    )


def check_consolidation(path: str, precision: str, stage: int = 2) -> list[torch.Tensor]:
    torch.manual_seed(0)
    engine = _engine(stage, precision=precision)
    _train(engine, 0, 2)
    engine.save_checkpoint(path)
    return _params(engine)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_consolidated_state_dict_loads_into_the_plain_model(ranks, tmp_path, stage, precision):
    live = ranks(2).run(check_consolidation, str(tmp_path), precision, stage)[0]
    state = get_fp32_state_dict(tmp_path)
    assert all(t.dtype == torch.float32 for t in state.values() if t.is_floating_point())
    plain = Net()
    plain.load_state_dict(state, strict=True)  # tied keys, buffer and all
    for got, want in zip(plain.parameters(), live, strict=True):
        if precision == "fp32":
            assert torch.equal(got, want)
        else:  # the fp32 master, which the bf16 parameters are a rounding of
            assert torch.equal(got.bfloat16().float(), want)
    if precision == "bf16":  # ... and not that rounding itself
        assert not all(torch.equal(a, b) for a, b in zip(plain.parameters(), live, strict=True))
    assert plain.scale.item() == 1.5
    if stage == 3:  # no rank held whole parameters: the optimizer shards are their copy
        module = torch.load(tmp_path / "global_step2" / MODEL_FILE)["module"]
        assert module["hidden.weight"].numel() == module["norm.weight"].numel() == 0
        assert module["scale"].item() == 1.5


def save_gathered_16bit(path: str) -> list[torch.Tensor]:
    engine = _engine(3, precision="bf16", zero={"stage3_gather_16bit_weights_on_model_save": True})
    _train(engine, 0, 1)
    engine.save_checkpoint(path)
    return _params(engine)


def test_stage3_saves_gathered_16bit_weights_when_asked(ranks, tmp_path):
    live = ranks(2).run(save_gathered_16bit, str(tmp_path))[0]
    module = torch.load(tmp_path / "global_step1" / MODEL_FILE)["module"]
    plain = Net().bfloat16()
    plain.load_state_dict(module, strict=True)
    for got, want in zip(plain.parameters(), live, strict=True):
        assert got.dtype == torch.bfloat16 and torch.equal(got.float(), want)


def _all_but_hidden_bias(model):
    return [p for name, p in model.named_parameters() if name != "hidden.bias"]


def save_partly_optimized(path: str) -> list[torch.Tensor]:
    """Stage 3 with a parameter the optimizer does not hold: only its shards keep it."""
    engine = _engine(3, dropout=False, model_parameters=_all_but_hidden_bias)
    with GatheredParameters([engine.module.hidden.bias], modifier_rank=0):
        engine.module.hidden.bias.data.fill_(0.25)  # not the value a fresh model starts from
    _train(engine, 0, 2)
    engine.save_checkpoint(path)
    return _params(engine)


def load_partly_optimized(path: str) -> list[torch.Tensor]:
    engine = _engine(3, dropout=False, model_parameters=_all_but_hidden_bias)
    engine.load_checkpoint(path)
    return _params(engine)


def test_stage3_keeps_parameters_outside_the_optimizer(ranks, tmp_path):
    live = ranks(2).run(save_partly_optimized, str(tmp_path))[0]
    plain = Net()
    plain.load_state_dict(get_fp32_state_dict(tmp_path), strict=True)
    assert torch.equal(plain.hidden.bias, torch.full((16,), 0.25))
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), live, strict=True))
    loaded = ranks(4).run(load_partly_optimized, str(tmp_path))[0]
    assert all(torch.equal(a, b) for a, b in zip(loaded, live, strict=True))


def check_partial_loads(path: str, precision: str) -> list[torch.Tensor]:
    """Stage 3: load_module_only and load_optimizer_states=False take the weights (and, in
    bf16, the fp32 master) and leave the optimizer fresh; then one more step trains."""
    torch.manual_seed(0)
    engine = _engine(3, precision=precision, dropout=False)
    _train(engine, 0, 2)
    engine.save_checkpoint(path)
    live, master, lr = _params(engine), engine.optimizer.master, engine.get_lr()

    def check_weights(fresh):
        assert all(torch.equal(a, b) for a, b in zip(_params(fresh), live, strict=True))
        assert not fresh.optimizer.state  # no Adam moments were loaded
        if master is not None:  # the saved fp32 master, not a rounding of the bf16 weights
            assert torch.equal(fresh.optimizer.master, master)
            assert not torch.equal(master, fresh.param_store.shard.float())

    partial = _engine(3, precision=precision, dropout=False)
    partial.load_checkpoint(path, load_optimizer_states=False)
    check_weights(partial)
    assert partial.global_steps == 2 and partial.get_lr() == lr  # scheduler and counters
    module_only = _engine(3, precision=precision, dropout=False)
    module_only.load_checkpoint(path, load_module_only=True)
    check_weights(module_only)
    assert module_only.global_steps == 0 and module_only.get_lr() != lr
    if master is not None:  # load_from_fp32_weights: false starts the master from bf16
        rounded = _engine(3, precision=precision, zero={"load_from_fp32_weights": False})
        rounded.load_checkpoint(path)
        assert torch.equal(rounded.optimizer.master, rounded.param_store.shard.float())
    _train(module_only, 2, 1)
    return _params(module_only)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage3_load_module_only_and_without_optimizer_states(ranks, tmp_path, precision):
    trained = ranks(2).run(check_partial_loads, str(tmp_path), precision)[0]
    if precision == "bf16":
        return
    # A fresh optimizer and scheduler from the saved weights, one step on batch 2.
    plain = Net()
    plain.drop.p = 0.0
    plain.load_state_dict(get_fp32_state_dict(tmp_path), strict=True)
    opt = torch.optim.AdamW(plain.parameters(), lr=0.05, weight_decay=0.01)
    from zerolap.runtime.lr_schedules import WarmupLR

    WarmupLR(opt, warmup_min_lr=0.01, warmup_num_steps=5)
    plain(*_batch(2)).backward()
    opt.step()
    for got, want in zip(trained, plain.parameters(), strict=True):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


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
    with captured_logs() as logs:  # DeepSpeed's behaviour: nothing to resume, no error
        assert engine.load_checkpoint(root / "t") == (None, None)
    assert any("no 'latest' file in" in m and str(root / "t") in m for m in logs), logs
    if dist.get_rank() == 0:
        (root / "t" / "latest").write_text("")  # cut short: an error, not "nothing to resume"
    dist.barrier()
    with captured_logs() as logs, pytest.raises(CheckpointError) as error:
        engine.load_checkpoint(root / "t")
    assert str(error.value) == (
        f"{root / 't' / 'latest'} is empty: it should name the newest checkpoint's tag"
    )
    assert not [m for m in logs if "re-saved" in m], logs
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "t" / "latest").unlink()
    other = _engine(3, width=8)  # stage 3: its parameters' .data are empty
    with pytest.raises(
        CheckpointError, match=r"another model.*hidden.weight: saved \(16, 16\), model \(8, 8\)"
    ):
        other.load_checkpoint(root)
    shard = root / "t" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    first_save = shard.read_bytes()
    engine.save_checkpoint(root, tag="t")  # the same tag again: another save
    dist.barrier()
    if dist.get_rank() == 0:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01  # one bit flipped, the size unchanged
        shard.write_bytes(bytes(data))
    dist.barrier()
    changed = r"zero_pp_rank_1_mp_rank_00_optim_states.pt does not match the checksum"
    with pytest.raises(CheckpointError, match=changed):
        engine.load_checkpoint(root)
    with pytest.raises(CheckpointError, match=changed):
        get_fp32_state_dict(root)  # consolidation checks alike
    dist.barrier()
    if dist.get_rank() == 0:
        shard.write_bytes(first_save)  # a whole file, but from the earlier save of the tag
    dist.barrier()
    with pytest.raises(CheckpointError, match=changed):
        engine.load_checkpoint(root)
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "t" / "checksums.json").unlink()  # even without the digests
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"optim_states.pt belongs to another save"):
        engine.load_checkpoint(root)
    dist.barrier()
    if dist.get_rank() == 0:
        shard.write_bytes(first_save[: len(first_save) // 3])
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"optimizer shard of rank 1 .* is truncated"):
        engine.load_checkpoint(root)
    dist.barrier()
    if dist.get_rank() == 0:
        shard.unlink()
    dist.barrier()
    with pytest.raises(CheckpointError, match="missing optimizer shard of rank 1"):
        engine.load_checkpoint(root)


def test_errors_name_the_problem(ranks, tmp_path):
    ranks(2).run(check_errors, str(tmp_path))


def test_cli_consolidate(ranks, tmp_path):
    import subprocess
    import sys

    live = ranks(2).run(check_consolidation, str(tmp_path / "ckpt"), "fp32")[0]
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
    assert bad.returncode == 2 and "not a checkpoint directory: no 'latest' file" in bad.stderr
    # DeepSpeed's recovery script in the checkpoint folder, and the module it runs, as the
    # messages of transformers and Accelerate tell users to run them.
    for command in (
        [sys.executable, str(tmp_path / "ckpt" / "zero_to_fp32.py")],
        [sys.executable, "-m", "zerolap.utils.zero_to_fp32"],
    ):
        written = tmp_path / f"fp32-{len(command)}"
        done = subprocess.run(
            [*command, str(tmp_path / "ckpt"), str(written), "--safe_serialization"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        from safetensors.torch import load_file

        plain = Net()
        plain.load_state_dict(load_file(written / "model.safetensors"), strict=True)
        assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), live, strict=True))


def resave_killed_between_renames(path: str) -> list:
    """Save tag "t" (weights A), train on, re-save "t" (weights B) but die between publication's
    two renames (the old folder moved aside, the new one not yet in): loading "t" must give A,
    the last complete save, with a warning."""
    engine = _engine(2, dropout=False)
    _train(engine, 0, 2)
    saved = _params(engine)
    engine.save_checkpoint(path, tag="t")
    _train(engine, 2, 2)
    real_replace = os.replace

    def dies_at_the_second_rename(src, dst):
        if str(src).endswith("t.partial"):
            raise OSError("killed")  # nothing after this runs, as if the process died here
        real_replace(src, dst)

    died = False
    if dist.get_rank() == 0:
        os.replace = dies_at_the_second_rename
    try:
        engine.save_checkpoint(path, tag="t")
    except CheckpointError as err:  # on every rank alike
        died = "could not publish it" in str(err)
    finally:
        os.replace = real_replace
    engine.destroy()
    assert not (Path(path) / "t").exists()  # the state the kill left: "t" moved aside only
    fresh = _engine(2, dropout=False)
    with captured_logs() as logs:
        fresh.load_checkpoint(path)  # through "latest", which still names "t"
    loaded = _params(fresh)
    fresh.destroy()
    same = all(torch.equal(a, b) for a, b in zip(loaded, saved, strict=True))
    return [died, same, [m for m in logs if "interrupted" in m]]


def test_a_resave_killed_mid_publication_loads_the_previous_save(ranks, tmp_path):
    results = ranks(2).run(resave_killed_between_renames, str(tmp_path), timeout=120)
    assert results[0][:2] == [True, True] and results[1][:2] == [True, True]
    assert "re-save was interrupted before publication" in results[0][2][0]


def save_with_a_full_disk(path: str, full_rank: int) -> list:
    """Rank ``full_rank``'s disk fills up while it writes its shard (ENOSPC): every
    rank gets the same named error, the partial files are gone, the previous checkpoint still
    loads, and training and saving go on."""
    import errno

    import zerolap.checkpoint.files as files

    engine = _engine(2, dropout=False)
    _train(engine, 0, 1)
    engine.save_checkpoint(path, tag="good")
    good = _params(engine)
    _train(engine, 1, 1)
    real_save = files.torch.save

    def full(obj, target):
        raise OSError(errno.ENOSPC, "No space left on device")

    if dist.get_rank() == full_rank:
        files.torch.save = full
    try:
        engine.save_checkpoint(path, tag="bad")
        message = "saved"
    except CheckpointError as err:
        message = str(err)
    finally:
        files.torch.save = real_save
    leftovers = sorted(p.name for p in Path(path).iterdir())
    _train(engine, 2, 1)  # the ranks are still in step
    engine.save_checkpoint(path, tag="later")
    fresh = _engine(2, dropout=False)
    fresh.load_checkpoint(path, tag="good")
    same = all(torch.equal(a, b) for a, b in zip(_params(fresh), good, strict=True))
    fresh.destroy()
    engine.destroy()
    return [message, leftovers, same]


@pytest.mark.parametrize("full_rank", [0, 1])
def test_a_full_disk_fails_the_save_on_every_rank_and_keeps_the_last_one(
    ranks, tmp_path, full_rank
):
    results = ranks(2).run(save_with_a_full_disk, str(tmp_path), full_rank, timeout=120)
    shard = f"zero_pp_rank_{full_rank}_mp_rank_00_optim_states.pt"
    for message, leftovers, same in results:
        assert message.startswith(
            f"checkpoint 'bad' not saved: rank {full_rank}: no space left on the device of "
        ), message
        assert f"bad.partial writing {shard}: about " in message
        # No partial folder: the good one published, with the weights' recovery script.
        assert leftovers == ["good", "latest", "zero_to_fp32.py"]
        assert same


def load_during_a_resave(path: str, vanish: bool) -> dict:
    """Another job re-saves tag ``t`` (publishes it) while rank 0's load is between the model
    file and the shards; rank 1 reads the old save, the new one, or both. Every rank ends with
    the whole new save, instead of a mix. ``vanish``: rank 1's first read meets the moment the
    old folder has been moved aside (its file is not found), once the new save is published."""
    import shutil

    from zerolap.checkpoint import files

    root = Path(path)
    rank = dist.get_rank()
    engine = _engine(2)
    _train(engine, 0, 1)
    engine.save_checkpoint(root, tag="t")  # save A
    if rank == 0:
        shutil.copytree(root / "t", root / "a")
    _train(engine, 1, 1)
    engine.save_checkpoint(root, tag="t")  # save B: staged again below, A put back
    expected = {"step": engine.global_steps, "params": _params(engine)}
    if rank == 0:
        os.replace(root / "t", root / "t.partial")
        os.replace(root / "a", root / "t")
    dist.barrier()
    read = files.read
    resaved = []

    def read_then_resave(file, *, what):
        if rank == 1 and vanish and not resaved:
            deadline = time.monotonic() + 60
            while (files.tag_identity(root, "t") or {}).get("step") != expected["step"]:
                assert time.monotonic() < deadline, "rank 0 never re-saved"
                time.sleep(0.01)
            resaved.append(True)
            raise FileNotFoundError(2, "No such file or directory", str(file))
        out = read(file, what=what)
        if rank == 0 and not resaved and file.name == MODEL_FILE:
            files.publish(root, "t", save_latest=True)  # B replaces A mid-load
            resaved.append(True)
        return out

    files.read = read_then_resave
    try:
        fresh = _engine(2)
        with captured_logs() as logs:
            fresh.load_checkpoint(root)
    finally:
        files.read = read
    return {
        "resaved": resaved,
        "logs": logs,
        "step": fresh.global_steps,
        "same": all(
            torch.equal(a, b) for a, b in zip(_params(fresh), expected["params"], strict=True)
        ),
        "expected_step": expected["step"],
    }


@pytest.mark.parametrize("vanish", [False, True], ids=["between-files", "file-vanishes"])
def test_a_load_during_a_resave_reads_one_whole_save(ranks, tmp_path, vanish):
    first, second = ranks(2).run(load_during_a_resave, str(tmp_path), vanish)
    assert first["resaved"] and second["resaved"] == [True] * vanish
    for result in (first, second):
        assert result["same"] and result["step"] == result["expected_step"] == 2
        assert any("re-saved while it was read; reading the new save" in m for m in result["logs"])
