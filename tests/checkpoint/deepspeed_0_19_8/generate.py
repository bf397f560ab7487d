"""Write the DeepSpeed 0.19.8 checkpoints of this folder with real DeepSpeed (CPU is enough):

    pip install torch==2.13.0
    DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8
    python tests/checkpoint/deepspeed_0_19_8/generate.py  # from the repository root

Each case trains ``model.STEPS`` steps on 2 gloo ranks and saves ``<case>/ckpt``; then it takes
one more step and saves in ``<case>/expected.pt`` what a resumed run must reproduce: that step's
loss (the mean over ranks) and the fp32 parameters after it, plus the fp32 parameters in the
checkpoint itself; for the ``model.UNIVERSAL`` cases it then runs DeepSpeed's
``ds_to_universal`` on the checkpoint. The pipeline cases (``pipe_model``) do the same with
``train_batch``, on stages x data-parallel ranks, and keep every parameter by name (a tied one
from its first stage); the mixture-of-experts cases (``moe_model``) keep every parameter by its
global name (each expert from the first rank holding it). Not run by the tests (they read the
files); kept to say how they were made.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(case: str) -> None:
    import deepspeed
    import torch

    from tests.checkpoint.deepspeed_0_19_8.model import (
        CASES,
        STEPS,
        batch,
        build_model,
        ds_config,
        param_groups,
    )

    stage, world, bf16, two_groups = CASES[case]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    model = build_model()
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, two_groups),
        config=ds_config(stage, world, bf16),
    )

    def step(number: int) -> float:
        loss = engine(*batch(number, rank))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().reshape(1)
        torch.distributed.all_reduce(mean)
        return mean.item() / world

    def fp32_params() -> dict:
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for name, param in engine.module.named_parameters():
            if not param.requires_grad:
                continue
            if stage == 0 and not bf16:
                out[name] = param.detach().float().clone()
            elif stage == 0:  # FP16_Optimizer: the fp32 master is one flat buffer per group
                out[name] = None
            else:
                out[name] = safe_get_full_fp32_param(param).detach().float().clone()
        return out

    for number in range(1, STEPS + 1):
        step(number)
    saved_params = fp32_params()
    ckpt = HERE / case / "ckpt"
    engine.save_checkpoint(str(ckpt), client_state={"client_key": 7})
    next_loss = step(STEPS + 1)
    expected = {"next_loss": next_loss, "saved_params": saved_params, "params_after": fp32_params()}
    finish(case, ckpt, expected)


def pipeline_worker(case: str) -> None:
    import deepspeed
    import deepspeed.pipe as pipe
    import torch

    from tests.checkpoint.deepspeed_0_19_8 import pipe_model as m

    stage, stages, dp, client = m.CASES[case]
    deepspeed.init_distributed(dist_backend="gloo")
    model = m.build_model(pipe, stages)
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        optimizer=m.client_optimizer(model) if client else None,
        config=m.ds_config(stage, dp, client),
    )
    dp_rank = engine.grid.get_data_parallel_rank()

    def params() -> dict:
        every: list = [None] * torch.distributed.get_world_size()
        mine = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        torch.distributed.all_gather_object(every, mine)
        return {n: v for found in reversed(every) for n, v in found.items()}  # rank 0's last

    for number in range(1, m.STEPS + 1):
        engine.train_batch(m.batches(number, dp_rank))
    saved_params = params()
    ckpt = HERE / case / "ckpt"
    engine.save_checkpoint(str(ckpt), client_state={"client_key": 7})
    next_loss = engine.train_batch(m.batches(m.STEPS + 1, dp_rank)).item()
    expected = {"next_loss": next_loss, "saved_params": saved_params, "params_after": params()}
    finish(case, ckpt, expected)


def moe_worker(case: str) -> None:
    import deepspeed
    import torch
    from deepspeed.moe.layer import MoE

    from tests.checkpoint.deepspeed_0_19_8 import moe_model as m

    stage, world = m.CASES[case]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    model = m.MoENet(MoE, m.EP)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=m.ds_config(stage)
    )
    names = m.global_names(model, rank % m.EP)

    def step(number: int) -> float:
        loss = engine(*m.batch(number, rank))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().reshape(1)
        torch.distributed.all_reduce(mean)
        return mean.item() / world

    def params() -> dict:
        from deepspeed.utils import safe_get_full_fp32_param

        mine = {}
        for name, param in model.named_parameters():
            full = param if stage == 0 else safe_get_full_fp32_param(param)
            mine[names[name]] = full.detach().float().clone()
        every: list = [None] * world
        torch.distributed.all_gather_object(every, mine)
        return {n: v for found in reversed(every) for n, v in found.items()}  # rank 0's last

    for number in range(1, m.STEPS + 1):
        step(number)
    saved_params = params()
    ckpt = HERE / case / "ckpt"
    engine.save_checkpoint(str(ckpt), client_state={"client_key": 7})
    next_loss = step(m.STEPS + 1)
    expected = {"next_loss": next_loss, "saved_params": saved_params, "params_after": params()}
    finish(case, ckpt, expected)


def finish(case: str, ckpt: Path, expected: dict) -> None:
    import torch

    if torch.distributed.get_rank() == 0:
        torch.save(expected, HERE / case / "expected.pt")
        for extra in ("zero_to_fp32.py", "zero_to_torch.py"):
            (ckpt / extra).unlink(missing_ok=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def world_size(case: str) -> int:
    from tests.checkpoint.deepspeed_0_19_8 import model, moe_model, pipe_model

    if case in moe_model.CASES:
        return moe_model.CASES[case][1]
    if case in pipe_model.CASES:
        _, stages, dp, _ = pipe_model.CASES[case]
        return stages * dp
    return model.CASES[case][1]


def launch(case: str) -> None:
    from tests.checkpoint.deepspeed_0_19_8 import model

    world = world_size(case)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    shutil.rmtree(HERE / case, ignore_errors=True)
    (HERE / case).mkdir()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = str(HERE.parents[2])
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", case], env=env))
    if any(proc.wait() for proc in procs):
        raise SystemExit(f"{case}: a rank failed")
    if case in model.UNIVERSAL:
        to_universal(HERE / case / "ckpt" / f"global_step{model.STEPS}")


def to_universal(folder: Path) -> None:
    """DeepSpeed's own converter's output beside ``folder`` (``<tag>_universal`` and
    ``latest_universal``). ``--inject_missing_state`` is how DeepSpeed's docs have
    non-Megatron users run it: at stages 1-2 it asks for Megatron's layout notes otherwise."""
    subprocess.run(
        [
            sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state",
            "--input_folder", str(folder), "--output_folder", f"{folder}_universal",
        ],
        check=True,
    )  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[2]))
    from tests.checkpoint.deepspeed_0_19_8 import model, moe_model, pipe_model

    if sys.argv[1:2] == ["--worker"]:
        case = sys.argv[2]
        if case in moe_model.CASES:
            moe_worker(case)
        else:
            (pipeline_worker if case in pipe_model.CASES else worker)(case)
    else:
        for name in sys.argv[1:] or [*model.CASES, *pipe_model.CASES, *moe_model.CASES]:
            launch(name)
            print(f"{name}: written", flush=True)
