"""A DeepSpeed-style script for the launcher test: parses ``--local_rank`` as DeepSpeed's
examples do, trains two steps, and writes what each rank saw."""

import argparse
import json
import os

import deepspeed
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--out", required=True)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
deepspeed.init_distributed()
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
config = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
    "zero_optimization": {"stage": 2},
}
engine, *_ = deepspeed.initialize(
    args=args, model=model, model_parameters=model.parameters(), config=config
)
for _ in range(2):
    engine.backward(engine(torch.ones(4, 8)).pow(2).mean())
    engine.step()
rank = deepspeed.comm.get_rank()
with open(f"{args.out}.{rank}", "w") as f:
    json.dump(
        {
            "local_rank_arg": args.local_rank,
            "env": os.environ["LOCAL_RANK"],
            "world": deepspeed.comm.get_world_size(),
            "steps": engine.global_steps,
            "cores": sorted(os.sched_getaffinity(0)),
            "omp_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": torch.get_num_threads(),
        },
        f,
    )
