"""Experts spread over ranks, the same script under real DeepSpeed 0.19.8 and under zerolap.

Real DeepSpeed lives in its own virtual environment (``benchmarks/deepspeed_diff.py
--make-env /tmp/dsenv`` makes one). Then, from the repo root:

    python benchmarks/moe_deepspeed_diff.py --deepspeed-python /tmp/dsenv/bin/python

The model is the DeepSpeed MoE checkpoints' (``tests/checkpoint/deepspeed_0_19_8/
moe_model.py``: two MoE layers of 4 experts spread over 2 expert-parallel ranks, routing
without randomness, the ds_config's AdamW), built with each library's own ``MoE`` class and
trained 4 steps of 2 accumulated micro-batches on 2 gloo ranks, at ZeRO 0, 1 and 2, without
clipping and with clipping at 0.05 (active from the first step). Per run it prints the largest
loss difference, the largest parameter difference (relative to the tensor's largest element;
experts by their global index) and both libraries' gradient norms.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = [(0, 0.0), (1, 0.0), (2, 0.0), (2, 0.05), (0, 0.05)]  # (ZeRO stage, clipping)
STEPS, ACCUMULATION = 4, 2


def worker(library: str, stage: int, clip: float, out: str) -> None:
    import torch

    if library == "zerolap":
        import zerolap as deepspeed
    else:
        import deepspeed
    from tests.checkpoint.deepspeed_0_19_8 import moe_model as m

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    model = m.MoENet(deepspeed.moe.layer.MoE, m.EP)
    config = m.ds_config(stage) | {
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": clip,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    losses, norms = [], []
    for step in range(STEPS):
        total = torch.zeros(1)
        for micro in range(ACCUMULATION):
            loss = engine(*m.batch(ACCUMULATION * step + micro + 1, rank))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / (ACCUMULATION * torch.distributed.get_world_size()))
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    names = m.global_names(model, rank % m.EP)
    mine = {names[n]: p.detach().float().clone() for n, p in model.named_parameters()}
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    if rank == 0:
        params = {n: v for found in every for n, v in found.items()}
        torch.save({"losses": losses, "norms": norms, "params": params}, out)


def run(python: str, library: str, stage: int, clip: float, out: Path) -> dict:
    import torch

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [python, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(29400 + stage * 10 + int(clip > 0)), __file__,
               "--worker", library, str(stage), str(clip), str(out)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"{library} at ZeRO {stage}, clipping {clip} failed:\n{done.stderr[-3000:]}"
        )
    return torch.load(out, weights_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed-python", required=True, help="python of real DeepSpeed's venv")
    args = parser.parse_args()
    print(
        "| ZeRO | clipping | largest loss difference | largest parameter difference "
        "(relative) | grad norms zerolap | grad norms DeepSpeed |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for stage, clip in RUNS:
            ours = run(sys.executable, "zerolap", stage, clip, Path(folder) / "z.pt")
            theirs = run(args.deepspeed_python, "deepspeed", stage, clip, Path(folder) / "d.pt")
            loss = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))
            param = max(
                ((ours["params"][n] - v).abs().max() / v.abs().max()).item()
                for n, v in theirs["params"].items()
            )

            def shown(norms):
                return " ".join("-" if x is None else f"{x:.6f}" for x in norms)

            print(
                f"| {stage} | {clip} | {loss:.2e} | {param:.2e} | {shown(ours['norms'])} "
                f"| {shown(theirs['norms'])} |",
                flush=True,
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.path.insert(0, str(ROOT))
        worker(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
    else:
        main()
