"""A rank that ends as DeepSpeed's scripts do, without ``destroy_process_group``, while ops it
started are still in flight. Writes whether the process group was still alive when the last
exit handler ran (registered before ``init_distributed``, so it runs after zerolap's), and, in
the engine modes, whether the group's object was freed before the process ended (a weak
reference's callback writes to a second file)."""

import atexit
import gc
import os
import sys
import threading
import time
import weakref

import torch
import torch.distributed as torch_dist

import zerolap
import zerolap.comm as dist
import zerolap.comm.groups as groups

out_file, mode = sys.argv[1], sys.argv[2]


def report() -> None:
    with open(f"{out_file}.{os.environ['RANK']}", "w") as f:
        f.write("alive" if torch.distributed.is_initialized() else "released")


atexit.register(report)
groups.EXIT_RELEASE_S = 3.0
dist.init_distributed(dist_backend="gloo", verbose=False)
rank = dist.get_rank()
if mode == "in_flight":
    # All-gathers started on every rank and never waited for (the engine leaves its parameter
    # gathers in flight after step() until the next forward).
    handles = [
        dist.all_gather([torch.empty(1000) for _ in range(2)], torch.ones(1000), async_op=True)
        for _ in range(4)
    ]
elif mode == "unmatched":
    # Rank 0 starts an all-reduce rank 1 never joins, and ends while rank 1 is still busy
    # (until the test, having seen rank 0 leave, says go; a minute at most).
    if rank == 0:
        handle = dist.all_reduce(torch.ones(4), async_op=True)
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{out_file}.go") and time.monotonic() < deadline:
            time.sleep(0.1)
elif mode == "raises":
    handles = [dist.all_reduce(torch.ones(4), async_op=True)]
    raise ValueError("the script failed")
elif mode in ("engine", "engine_destroyed"):
    # A ZeRO-2 engine trained a step (its optimizer built after the group existed) and kept
    # in a global, as scripts keep it; or destroyed, let go of and the group destroyed.
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = zerolap.initialize(model=model, config=config)
    engine.backward(engine(torch.ones(4, 64)).sum())
    engine.step()
    freed = os.open(f"{out_file}.freed.{os.environ['RANK']}", os.O_WRONLY | os.O_CREAT)
    # os.write bound now: the callback may run late in the interpreter's teardown.
    group = weakref.ref(
        torch_dist.group.WORLD, lambda _, fd=freed, write=os.write: write(fd, b"freed")
    )
    if mode == "engine_destroyed":
        engine.destroy()
        del engine, _
        # Named explicitly, the default group is destroyed with every other (as by None).
        dist.destroy_process_group(dist.get_world_group())
        gc.collect()
        assert group() is None, "the destroyed group is still referenced"
        beating = [t.name for t in threading.enumerate() if t.name == "zerolap-watchdog"]
        assert not beating, "the watchdog still beats for a destroyed group"
