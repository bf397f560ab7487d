"""Training-step time, bytes on the wire and memory of zerolap's ZeRO stages against torch's DDP,
ZeroRedundancyOptimizer and FSDP2, on a GPT decoder (``zerolap/demo/gpt.py``).

Run from the repo root: ``python benchmarks/zero_bench.py [--quick] [--models small 42m]
[--world-sizes 2 4] [--steps 5] [--rounds 1] [--optimizer fused|client] [--systems NAME...]``,
a NAME being a system's key
or a set: ``all`` (the default), ``stages012`` or ``stage3_vs_fsdp2`` (DDP, FSDP2, and zerolap
stage 3 with and without prefetch).

Every system trains the same model, from the same seed, on the same synthetic batches (rank r of
step s always sees the same tokens), with fp32 AdamW (lr 1e-4, weight decay 0.01, ``fused=True``,
the default of zerolap's config-built AdamW; with ``--optimizer client``, torch's default AdamW
built by the script and handed to ``initialize(optimizer=...)``, as a DeepSpeed user does) and
8 MB gradient buckets. Each system runs in fresh
processes (gloo on localhost, one torch thread per rank, ``MALLOC_MMAP_THRESHOLD_`` set for all
alike), so its peak RSS is its own. A "compute only" reference runs the same ranks with a plain
AdamW and no communication at all: what a step would cost if communication were free. Per system:

* step time: each step starts after a barrier and covers forward, backward and optimizer step;
  a step's time is its slowest rank's; the table shows the median over the measured steps
  (after ``--warmup`` steps), pooled over ``--rounds`` (each round runs the systems in the
  opposite order of the previous one).
* vs compute: the step time over the compute-only reference's, the floor a step cannot beat.
* other threads' CPU: per step and rank, the CPU time of the rank's threads other than the
  main one (gloo's workers, zerolap's ring and watchdog threads). On this 2-core machine, where
  two ranks share two cores, that time is taken from compute: compute-only plus it is the
  honest limit of a step here, hidden or not.
* other load: CPU cores busy with *other* processes during the measured steps (the machine's
  busy time from /proc/stat minus the ranks' own CPU time). Above ~0.2 the step times of that
  row are inflated by whatever else ran on this 2-core machine; such a run is repeated
  (``--retries``) and the least disturbed one kept.
* wire bytes: for zerolap, the ``wire_bytes`` of the collectives launched in an extra step run
  with the comms logger on (mean over ranks); for the torch systems, the ring formula (DDP's
  all-reduce: 2; ZeroRedundancyOptimizer adds a broadcast of every parameter from its owner: 3;
  FSDP2 all-gathers in forward and in backward and reduce-scatters: 3, though gloo's
  reduce-scatter really moves an all-reduce's volume). Both in units of Psi(N-1)/N * 4 bytes.
* bwd eta / bwd exposed: the share of backward's gradient reductions hidden behind backward's
  compute, and the time backward's end waited for them (zerolap only). step eta / step
  exposed: the same over the whole logged step, every collective that ran or was waited in it
  (the parameter gathers the previous step left in flight and this forward waited for
  included): 1 - (time the caller sat in a collective) / (time any collective ran).
* stage 3's gathers (``engine.fetch_stats()``): per measured step and rank, the units fetched,
  how many a prefetch had launched, how many were gathered on demand, and the time forward and
  backward blocked waiting for them.
* model state: tensor bytes of parameters, gradients and optimizer state held after the step
  (zerolap: ``engine.memory_breakdown()``), max over ranks.
* peak RSS: the kernel's high-water mark of each rank's resident set (``ru_maxrss``), max over
  ranks.
* loss: the mean over ranks of the last step's loss, and the largest difference from DDP's loss
  over all steps (fp32 data parallelism should agree to ~1e-5).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["SYSTEMS", "RunSpec", "System", "SystemResult", "main", "run"]

MIB = 1 << 20
LR = 1e-4
WEIGHT_DECAY = 0.01  # given explicitly to every system (zerolap's AdamW would default to 0)
# --optimizer client: what a DeepSpeed user builds and hands to initialize(optimizer=...), the
# torch default implementation (neither fused nor foreach on CPU), for every system alike.
CLIENT_ADAMW = {"lr": 5e-4, "betas": (0.9, 0.95), "weight_decay": 0.01}
BUCKET_NUMEL = 2_000_000  # zerolap reduce_bucket_size: 8 MB of fp32 ...
BUCKET_MB = 8  # ... and DDP's bucket_cap_mb
ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
# --malloc default: glibc's own (dynamic) mmap threshold, as a user's run has it. Faster (large
# temporaries are reused from the heap instead of faulted in afresh), but peak RSS then depends
# on each system's allocation pattern.
DEFAULT_MALLOC_ENV = {"OMP_NUM_THREADS": "1"}
# Micro-batch per model at world size 2, chosen so that a step takes about a second on one
# thread; at world size N it is scaled by 2/N, since N ranks share this machine's two cores.
MICRO_BATCH_AT_2 = {"small": 16, "42m": 1}
QUICK_MICRO_BATCH = 4
TIMEOUT_S = 600.0
# A run during which other processes kept more than this many cores busy is run again.
DISTURBED_CORES = 0.25


@dataclass(frozen=True)
class System:
    key: str  # how --systems names it
    name: str
    kind: str  # "local", "ddp", "torch_zero", "fsdp2" or "zerolap"
    stage: int = 0  # zerolap's ZeRO stage
    reduce_scatter: bool = True  # zerolap's zero_optimization.reduce_scatter
    prefetch: bool = True  # stage 3: stage3_prefetch_bucket_size as STAGE3, or 0
    like_fsdp2: bool = True  # stage 3: the STAGE3 keys; else DeepSpeed's defaults for them


SYSTEMS: tuple[System, ...] = (
    System("local", "compute only (no communication)", "local"),
    System("ddp", "torch DDP", "ddp"),
    System("torch_zero", "torch ZeroRedundancyOptimizer", "torch_zero"),
    System("fsdp2", "torch FSDP2 (fully_shard)", "fsdp2"),
    System("stage0", "zerolap stage 0", "zerolap", stage=0),
    System("stage1", "zerolap stage 1", "zerolap", stage=1),
    System("stage2", "zerolap stage 2", "zerolap", stage=2),
    System(
        "stage2_allreduce",
        "zerolap stage 2, reduce_scatter=false",
        "zerolap",
        stage=2,
        reduce_scatter=False,
    ),
    System("stage3", "zerolap stage 3", "zerolap", stage=3),
    System(
        "stage3_no_prefetch",
        "zerolap stage 3, prefetch_bucket_size=0",
        "zerolap",
        stage=3,
        prefetch=False,
    ),
    System(
        "stage3_defaults",
        "zerolap stage 3, DeepSpeed's default stage3_* keys",
        "zerolap",
        stage=3,
        like_fsdp2=False,
    ),
)
# --systems also takes these names for sets of systems.
SYSTEM_SETS: dict[str, tuple[str, ...]] = {
    "all": tuple(s.key for s in SYSTEMS),
    "stages012": ("local", "ddp", "torch_zero", "stage0", "stage1", "stage2", "stage2_allreduce"),
    "stage3_vs_fsdp2": ("ddp", "fsdp2", "stage3", "stage3_no_prefetch"),
}
# zero_optimization keys of the stage-3 systems, chosen to do what FSDP2 does with
# reshard_after_forward=True, about one FSDP2 group ahead:
# * param_persistence_threshold: DeepSpeed's default (1e5). It keeps the LayerNorms whole (1024
#   elements each, 0.06% of the 42M model); every Linear and both embeddings are sharded.
#   FSDP2 shards everything, but its root group (embeddings, final norm) stays gathered from
#   forward to backward, so the two keep about as much whole.
# * max_reuse_distance 0: release every unit after its forward and gather it again for its
#   backward, as reshard_after_forward=True does (the default of 1e9 would keep a model this
#   small gathered from forward to backward and skip the backward all-gather).
# * prefetch_bucket_size 5e6: the largest FSDP2 group of the 42M model is its root (4.3M
#   elements; a transformer block is 3.2M). zerolap prefetches a unit only if it fits in the
#   budget, and the tied embedding is one 4.2M unit. DeepSpeed's default of 5e7 would gather the
#   whole 42M model ahead at the start of forward and of backward. (On the 5M small model 5e6
#   is everything.)
STAGE3 = {
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 5_000_000,
}
# Theoretical bytes sent per rank per step for the torch systems, in units of Psi(N-1)/N * 4.
# FSDP2: all-gather in forward, again in backward, reduce-scatter of the gradients (on gloo its
# reduce_scatter_tensor moves an all-reduce's volume, so the wire really carries 4: FACTS.md).
THEORY_WIRE_UNITS = {"local": 0.0, "ddp": 2.0, "torch_zero": 3.0, "fsdp2": 3.0}


@dataclass(frozen=True)
class RunSpec:
    model: str
    world_size: int
    micro_batch: int
    warmup: int
    steps: int  # measured steps; two more (comms-logged) steps follow them
    client_optimizer: bool = False  # every system steps a client-built CLIENT_ADAMW

    def adamw(self) -> dict:
        """The keyword arguments of every system's ``torch.optim.AdamW``."""
        if self.client_optimizer:
            return dict(CLIENT_ADAMW)
        return {"lr": LR, "weight_decay": WEIGHT_DECAY, "fused": True}

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps + 2


@dataclass
class RankResult:
    numel: int  # model parameters
    step_s: list[float]  # every step, warm-up and logged step included
    losses: list[float]
    wire_bytes: int | None  # sent by the collectives the last step launched (zerolap only)
    state_bytes: int
    peak_rss_bytes: int
    window_s: float  # wall time of the measured steps
    window_cpu_s: float  # this process's CPU time over them
    window_main_cpu_s: float  # ... its main thread's (the rest is gloo's and zerolap's threads)
    window_busy_s: float  # the whole machine's busy CPU time over them (rank 0 only)
    overlap: tuple[float, float, float] | None  # backward's (eta, exposed s, comm s), zerolap
    step_overlap: tuple[float, float] | None  # the whole last step's (eta, exposed s), zerolap
    fetch: dict | None  # stage 3: engine.fetch_stats() counters over the measured steps


@dataclass
class SystemResult:
    system: System
    step_s: float = float("nan")
    other_load: float = float("nan")  # cores used by other processes while measuring
    wire_units: float = float("nan")
    wire_measured: bool = False
    state_mib: float = float("nan")
    peak_rss_mib: float = float("nan")
    eta: float = float("nan")  # share of backward's gradient reduction hidden behind compute
    step_eta: float = float("nan")  # share of the whole step's communication hidden
    step_exposed_ms: float = float("nan")  # the whole step's communication the caller sat in
    comm_cpu_ms: float = float("nan")  # CPU per step and rank of threads other than the main
    exposed_ms: float = float("nan")  # reduction time backward waited for at its end
    comm_ms: float = float("nan")  # reduction time in all
    fetch: dict | None = None  # stage 3: fetch_stats() per measured step, mean over ranks
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the system's runs, spawn included
    error: str | None = None


# -- inside each rank ----------------------------------------------------------------------------


def _tensor_bytes(tensors) -> int:
    """Bytes this rank holds: a DTensor (FSDP2) counts its local shard only."""
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)


def _optimizer_state_tensors(optimizer):
    import torch

    for state in optimizer.state.values():
        yield from (t for t in state.values() if isinstance(t, torch.Tensor))


def _machine_busy_s() -> float:
    """CPU seconds all cores of this machine spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _cpu_s() -> float:
    """CPU seconds of this process, all its threads (gloo's included)."""
    return time.process_time()


@dataclass
class _Trainer:
    step: Callable  # (inputs, targets) -> loss as a float
    state_bytes: Callable[[], int]
    logged: bool  # whether the comms logger can measure this system's wire bytes
    overlap: Callable[[], tuple[float, float, float]] | None = None  # after a logged step
    fetch_stats: Callable[[], dict | None] | None = None  # stage 3's cumulative counters
    # Wait for what the last step left in flight (before its wire bytes are read).
    settle: Callable[[], None] = lambda: None


def _torch_trainer(system: System, model, adamw: dict) -> _Trainer:
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    wrapped = (
        model if system.kind == "local" else DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    )
    if system.kind == "torch_zero":
        optimizer = ZeroRedundancyOptimizer(
            wrapped.parameters(), optimizer_class=torch.optim.AdamW, **adamw
        )
        local = optimizer.optim  # the state of this rank's partition
    else:
        optimizer = local = torch.optim.AdamW(wrapped.parameters(), **adamw)
    return _plain_trainer(wrapped, model, optimizer, local)


def _plain_trainer(wrapped, model, optimizer, local_optimizer) -> _Trainer:
    """A torch training step through ``wrapped``; model state counted from ``model``'s
    parameters and gradients and ``local_optimizer``'s state (this rank's part of it)."""

    def step(inputs, targets) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = wrapped(inputs, targets)
        loss.backward()
        optimizer.step()
        return loss.item()

    def state_bytes() -> int:
        params = list(model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        states = _optimizer_state_tensors(local_optimizer)
        return _tensor_bytes(params) + _tensor_bytes(grads) + _tensor_bytes(states)

    return _Trainer(step, state_bytes, logged=False)


def _fsdp2_trainer(model, world_size: int, adamw: dict) -> _Trainer:
    """torch's FSDP2: ``fully_shard`` on every transformer block, then on the root (embeddings,
    final norm, tied head), in fp32, resharding after forward as ZeRO-3 does."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    optimizer = torch.optim.AdamW(model.parameters(), **adamw)
    return _plain_trainer(model, model, optimizer, optimizer)


def _zerolap_trainer(system: System, model, spec: RunSpec) -> _Trainer:
    import torch

    import zerolap

    config = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # the torch peers do not clip (DeepSpeed 0.19.8 defaults to 1.0)
        "zero_optimization": {
            "stage": system.stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": system.reduce_scatter,
            "reduce_bucket_size": BUCKET_NUMEL,
            "allgather_bucket_size": BUCKET_NUMEL,
        },
    }
    client = None
    if spec.client_optimizer:
        client = torch.optim.AdamW(model.parameters(), **spec.adamw())
    else:
        config["optimizer"] = {"type": "AdamW", "params": spec.adamw()}
    if system.stage == 3 and system.like_fsdp2:
        config["zero_optimization"] |= STAGE3
        if not system.prefetch:
            config["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    engine, _, _, _ = zerolap.initialize(model=model, optimizer=client, config=config)
    backward_start = [0.0]

    def step(inputs, targets) -> float:
        loss = engine(inputs, targets)
        backward_start[0] = time.perf_counter()
        engine.backward(loss)
        engine.step()
        return loss.item()

    def overlap() -> tuple[float, float, float]:
        """Backward's compute span against the reductions the comms logger timed in it."""
        from zerolap.comm import COMMS_LOGGER
        from zerolap.profiling.overlap import overlap_stats

        timing = engine.reducer.last_timing
        backward = (backward_start[0], timing.compute_end + timing.exposed_wait_s)
        comm = [
            (r.start, r.end)
            for r in COMMS_LOGGER.records
            if r.end is not None and backward[0] <= r.start < backward[1]
        ]
        stats = overlap_stats([(backward[0], timing.compute_end)], comm, step=backward)
        return stats.eta, stats.exposed_comm_s, stats.comm_s

    return _Trainer(
        step,
        lambda: engine.memory_breakdown().total_bytes,
        logged=True,
        overlap=overlap,
        fetch_stats=engine.fetch_stats,
        settle=engine.wait_in_flight,
    )


def _train(rank: int, spec: RunSpec, system: System, port: int) -> RankResult:
    import resource

    import torch.distributed as torch_dist

    import zerolap.comm as dist
    from zerolap.demo.gpt import PRESETS, build_gpt, synthetic_batch

    dist.init_distributed(
        dist_backend="gloo",
        rank=rank,
        world_size=spec.world_size,
        init_method=f"tcp://127.0.0.1:{port}",
        verbose=False,
    )
    model = build_gpt(spec.model, seed=0)
    numel = sum(p.numel() for p in model.parameters())
    batches = [
        synthetic_batch(PRESETS[spec.model], spec.micro_batch, seed=step * 1000 + rank)
        for step in range(spec.total_steps)
    ]
    if system.kind == "zerolap":
        trainer = _zerolap_trainer(system, model, spec)
    elif system.kind == "fsdp2":
        trainer = _fsdp2_trainer(model, spec.world_size, spec.adamw())
    else:
        trainer = _torch_trainer(system, model, spec.adamw())
    step_s, losses, wire_bytes, overlap, step_overlap = [], [], None, None, None
    window: dict[str, float] = {}
    fetch_stats = trainer.fetch_stats or (lambda: None)
    fetch: dict | None = None
    for index, (inputs, targets) in enumerate(batches):
        # The logger runs over the last two steps: the first only starts what the last one's
        # forward waits for (stages 1-2 leave the parameter gathers in flight after step()).
        if trainer.logged and index == spec.total_steps - 2:
            dist.reset_log()
            dist.configure(enabled=True)
        last = trainer.logged and index == spec.total_steps - 1
        torch_dist.barrier()  # not through zerolap.comm: the logger must not see it
        if index in (spec.warmup, spec.warmup + spec.steps):  # the measured window's ends
            ends = {
                "wall": time.perf_counter(),
                "cpu": _cpu_s(),
                "main_cpu": time.thread_time(),
                "busy": _machine_busy_s(),
            }
            window = {k: v - window.get(k, 0.0) for k, v in ends.items()}
            counters = fetch_stats()
            if counters is not None:
                fetch = {k: v - (fetch or {}).get(k, 0) for k, v in counters.items()}
        start = time.perf_counter()
        losses.append(trainer.step(inputs, targets))
        end = time.perf_counter()
        step_s.append(end - start)
        if last:
            from zerolap.profiling.overlap import total_exposure

            dist.configure(enabled=False)
            trainer.settle()
            records = dist.COMMS_LOGGER.records
            wire_bytes = sum(r.wire_bytes for r in records if r.start >= start)
            whole = total_exposure(records, window=(start, end))
            step_overlap = (whole.eta, whole.exposed_s)
            overlap = trainer.overlap() if trainer.overlap else None
    state_bytes = trainer.state_bytes()
    torch_dist.barrier()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return RankResult(
        numel=numel,
        step_s=step_s,
        losses=losses,
        wire_bytes=wire_bytes,
        state_bytes=state_bytes,
        peak_rss_bytes=peak_rss,
        window_s=window["wall"],
        window_cpu_s=window["cpu"],
        window_main_cpu_s=window["main_cpu"],
        window_busy_s=window["busy"] if rank == 0 else 0.0,
        overlap=overlap,
        step_overlap=step_overlap,
        fetch=fetch,
    )


def _rank_main(rank: int, spec: RunSpec, system: System, port: int, results) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        results.put((rank, True, _train(rank, spec, system, port)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


# -- the launcher --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(spec: RunSpec, system: System) -> list[RankResult]:
    """Run ``system`` on ``spec.world_size`` fresh processes; their results in rank order."""
    return spawn(spec.world_size, _rank_main, (spec, system))


def parse_in_rounds(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser``'s arguments, with those of a benchmark that alternates its systems in rounds
    of fresh processes (``--quick``: 1 round of 2 steps after 1 warm-up)."""
    parser.add_argument("--quick", action="store_true", help="1 round of 2 steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    return args


def call_rank(rank: int, fn: Callable, args: tuple, port: int, results) -> None:
    """A spawned rank on one thread: ``fn(rank, *args, port)``'s value, or its traceback, put on
    ``results``."""
    import torch

    torch.set_num_threads(1)
    try:
        results.put((rank, True, fn(rank, *args, port)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def in_rounds(systems: tuple[str, ...], fn: Callable, args, world_size: int = 2) -> dict:
    """``fn(rank, system, args, port)`` on fresh processes for each system in turn, round after
    round (``args.rounds``): system -> one list of rank results per round."""
    runs: dict[str, list[list]] = {system: [] for system in systems}
    for round_index in range(args.rounds):
        for system in systems:
            runs[system].append(spawn(world_size, call_rank, (fn, (system, args))))
            print(f"round {round_index + 1}: {system} done", file=sys.stderr)
    return runs


def median_step(rounds: list[list[dict]], steps: int) -> float:
    """The median over rounds and steps of the slowest rank's step (each result's ``times``)."""
    return statistics.median(
        max(rank["times"][i] for rank in ranks) for ranks in rounds for i in range(steps)
    )


def spawn(world_size: int, target: Callable, args: tuple, timeout: float = TIMEOUT_S) -> list:
    """``target(rank, *args, port, results)`` on ``world_size`` fresh processes, each putting
    ``(rank, ok, value)`` on ``results``; the values in rank order, or a RuntimeError naming
    the rank that failed, died or gave no answer within ``timeout`` seconds."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=target, args=(rank, *args, port, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    answers: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(answers) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in answers and not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    what = f"ranks {dead} exited" if dead else f"no answer in {timeout:.0f}s"
                    raise RuntimeError(what) from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            answers[rank] = value
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
    return [answers[r] for r in range(world_size)]


def _other_load(ranks: list[RankResult]) -> float:
    """Cores busy with other processes while ``ranks`` were measured."""
    own_cpu_s = sum(r.window_cpu_s for r in ranks)
    return max(0.0, ranks[0].window_busy_s - own_cpu_s) / ranks[0].window_s


def _median_step_s(spec: RunSpec, ranks: list[RankResult]) -> float:
    measured = range(spec.warmup, spec.warmup + spec.steps)
    return statistics.median(max(r.step_s[i] for r in ranks) for i in measured)


def summarise(spec: RunSpec, system: System, rounds: list[list[RankResult]]) -> SystemResult:
    """One row from every round's per-rank results."""
    n = spec.world_size
    measured = range(spec.warmup, spec.warmup + spec.steps)
    slowest = [max(r.step_s[i] for r in ranks) for ranks in rounds for i in measured]
    first = rounds[0]  # wire bytes and losses do not change between rounds
    unit = first[0].numel * (n - 1) / n * 4  # bytes of Psi(N-1)/N fp32 elements
    if system.kind in THEORY_WIRE_UNITS:
        wire_units, wire_measured = THEORY_WIRE_UNITS[system.kind], False
    else:
        wire_units, wire_measured = statistics.mean(r.wire_bytes or 0 for r in first) / unit, True
    losses = [statistics.mean(r.losses[i] for r in first) for i in range(spec.total_steps)]
    overlaps = [r.overlap for r in first if r.overlap is not None]
    eta, exposed, comm = (
        (statistics.mean(o[k] for o in overlaps) for k in range(3))
        if overlaps
        else (float("nan"),) * 3
    )
    steps = [r.step_overlap for r in first if r.step_overlap is not None]
    step_eta, step_exposed = (
        (statistics.mean(o[k] for o in steps) for k in range(2)) if steps else (float("nan"),) * 2
    )
    comm_cpu = statistics.mean(
        (r.window_cpu_s - r.window_main_cpu_s) / spec.steps for ranks in rounds for r in ranks
    )
    fetches = [r.fetch for ranks in rounds for r in ranks if r.fetch is not None]
    fetch = (
        {k: statistics.mean(f[k] for f in fetches) / spec.steps for k in fetches[0]}
        if fetches
        else None
    )
    return SystemResult(
        system,
        step_s=statistics.median(slowest),
        other_load=statistics.mean(_other_load(ranks) for ranks in rounds),
        wire_units=wire_units,
        wire_measured=wire_measured,
        state_mib=max(r.state_bytes for ranks in rounds for r in ranks) / MIB,
        peak_rss_mib=max(r.peak_rss_bytes for ranks in rounds for r in ranks) / MIB,
        eta=eta,
        exposed_ms=exposed * 1e3,
        comm_ms=comm * 1e3,
        step_eta=step_eta,
        step_exposed_ms=step_exposed * 1e3,
        comm_cpu_ms=comm_cpu * 1e3,
        fetch=fetch,
        losses=losses,
    )


def _least_disturbed(
    spec: RunSpec, system: System, *, retries: int, log: Callable[[str], object]
) -> list[RankResult]:
    """Run ``system``; while other processes took more than ``DISTURBED_CORES`` of the machine
    during its measured steps, run it again (at most ``retries`` times) and keep the run they
    disturbed least."""
    best: list[RankResult] | None = None
    for attempt in range(retries + 1):
        ranks = _spawn(spec, system)
        load = _other_load(ranks)
        log(
            f"  [{spec.model} N={spec.world_size}] {system.name}: "
            f"{_median_step_s(spec, ranks):.3f} s/step, other load {load:.2f} cores"
            + (f" (retry {attempt})" if attempt else "")
        )
        if best is None or load < _other_load(best):
            best = ranks
        if load <= DISTURBED_CORES:
            break
    return best


def run_spec(
    spec: RunSpec,
    *,
    systems: tuple[System, ...] = SYSTEMS,
    rounds: int = 1,
    retries: int = 1,
    log: Callable[[str], object] = print,
) -> list[SystemResult]:
    """Every one of ``systems`` on ``spec``, ``rounds`` times in alternating order; one result
    per system, in the order given. A system that fails is reported, not raised."""
    runs: dict[System, list[list[RankResult]]] = {s: [] for s in systems}
    seconds = dict.fromkeys(systems, 0.0)
    errors: dict[System, str] = {}
    for round_index in range(rounds):
        order = systems if round_index % 2 == 0 else systems[::-1]
        for system in order:
            if system in errors:
                continue
            began = time.perf_counter()
            try:
                runs[system].append(_least_disturbed(spec, system, retries=retries, log=log))
            except Exception as err:  # report it and go on with the other systems
                errors[system] = str(err)
                log(f"  [{spec.model} N={spec.world_size}] {system.name}: FAILED")
            seconds[system] += time.perf_counter() - began
    results = []
    for system in systems:
        if system in errors:
            result = SystemResult(system, error=errors[system])
        else:
            result = summarise(spec, system, runs[system])
        result.seconds = seconds[system]
        results.append(result)
    return results


# -- reporting -----------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def _find(results: list[SystemResult], key: str) -> SystemResult | None:
    for r in results:
        if r.system.key == key and not r.error:
            return r
    return None


def _fmt(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


def _ms(value: float) -> str:
    return _fmt(value, ".0f")


def format_table(spec: RunSpec, numel: int, results: list[SystemResult], rounds: int) -> str:
    ddp, local = _find(results, "ddp"), _find(results, "local")
    pooled = f" x {rounds} rounds" if rounds > 1 else ""
    lines = [
        f"### {spec.model} ({numel / 1e6:.1f}M params), world size {spec.world_size}, "
        f"micro-batch {spec.micro_batch}, median of {spec.steps} steps{pooled} after "
        f"{spec.warmup} warm-up",
        "",
        "| system | step s | vs DDP | vs compute | other load | wire / (Psi(N-1)/N*4) | "
        "sent MB/rank | model state MiB | peak RSS MiB | bwd comm ms | bwd exposed ms | bwd eta "
        "| step exposed ms | step eta | other threads' CPU ms | final loss | max dloss vs DDP "
        "| run s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    unit_mb = numel * 4 * (spec.world_size - 1) / spec.world_size / 1e6
    for r in results:
        if r.error is not None:
            last = r.error.strip().splitlines()[-1]
            lines.append(f"| {r.system.name} | FAILED: {last} |||||||||||||||| {r.seconds:.0f} |")
            continue
        vs_ddp = _ratio(r.step_s, ddp.step_s) if ddp else float("nan")
        vs_local = _ratio(r.step_s, local.step_s) if local else float("nan")
        wire = f"{r.wire_units:.2f}" + ("" if r.wire_measured else " (theory)")
        dloss = "-"
        if ddp and len(ddp.losses) == len(r.losses):
            dloss = f"{max(abs(a - b) for a, b in zip(r.losses, ddp.losses, strict=True)):.1e}"
        lines.append(
            f"| {r.system.name} | {r.step_s:.3f} | {_fmt(vs_ddp, '.3f')} | "
            f"{_fmt(vs_local, '.3f')} | {r.other_load:.2f} | "
            f"{wire} | {r.wire_units * unit_mb:.0f} | {r.state_mib:.0f} | {r.peak_rss_mib:.0f} | "
            f"{_ms(r.comm_ms)} | {_ms(r.exposed_ms)} | {_fmt(r.eta, '.2f')} | "
            f"{_ms(r.step_exposed_ms)} | {_fmt(r.step_eta, '.2f')} | {_ms(r.comm_cpu_ms)} | "
            f"{r.losses[-1]:.5f} | {dloss} | {r.seconds:.0f} |"
        )
    return "\n".join(lines)


def format_fetches(results: list[SystemResult]) -> str:
    """Stage 3's gathers per measured step (``engine.fetch_stats()``), mean over ranks."""
    rows = [r for r in results if r.fetch is not None]
    if not rows:
        return ""
    lines = [
        "| system | fetches / step | prefetched | on demand | forward wait ms | backward wait ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = r.fetch
        lines.append(
            f"| {r.system.name} | {f['fetches']:.0f} | {f['prefetched']:.1f} | "
            f"{f['on_demand']:.1f} | {f['forward_wait_s'] * 1e3:.1f} | "
            f"{f['backward_wait_s'] * 1e3:.1f} |"
        )
    return "\n".join(lines)


def format_summary(spec: RunSpec, results: list[SystemResult]) -> list[str]:
    """Rows of the summary table: zerolap's step time against the peer it must match."""

    def step(key: str) -> float:
        found = _find(results, key)
        return found.step_s if found else float("nan")

    ddp, zero, local = step("ddp"), step("torch_zero"), step("local")
    checks = [
        ("stage 0 / DDP", step("stage0"), ddp, 1.0),
        ("stage 1 / DDP", step("stage1"), ddp, 0.85),
        ("stage 2 / DDP", step("stage2"), ddp, 0.85),
        ("stage 1 / compute only", step("stage1"), local, 1.10),
        ("stage 2 / compute only", step("stage2"), local, 1.10),
        ("stage 3 / compute only", step("stage3"), local, 1.15),
        ("stage 1 / ZeroRedundancyOptimizer", step("stage1"), zero, 1.0),
        ("stage 2 / ZeroRedundancyOptimizer", step("stage2"), zero, 1.0),
        ("stage 3 / FSDP2", step("stage3"), step("fsdp2"), 1.0),
        ("stage 3, no prefetch / stage 3", step("stage3_no_prefetch"), step("stage3"), math.inf),
        ("DDP / compute only", ddp, local, math.inf),
    ]
    rows = []
    for label, ours, theirs, target in checks:
        ratio = _ratio(ours, theirs)
        if math.isnan(ratio):
            continue  # one of the two was not run
        verdict = "-" if target == math.inf else ("ok" if ratio <= target else "OVER")
        where = f"| {spec.model} | {spec.world_size} | {label} |"
        rows.append(f"{where} {ratio:.3f} | {'' if verdict == '-' else target} | {verdict} |")
    return rows


# -- entry point ---------------------------------------------------------------------------------


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, world 2, few steps")
    parser.add_argument("--models", nargs="+", choices=sorted(MICRO_BATCH_AT_2), default=None)
    parser.add_argument("--world-sizes", nargs="+", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="measured steps per system")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured steps first")
    parser.add_argument("--micro-batch", type=int, default=None, help="override the presets")
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=[*SYSTEM_SETS, *(s.key for s in SYSTEMS)],
        default=["all"],
        metavar="SYSTEM",
        help="systems to run, by key ("
        + ", ".join(s.key for s in SYSTEMS)
        + ") or set ("
        + "; ".join(f"{name}: {' '.join(keys)}" for name, keys in SYSTEM_SETS.items())
        + "); default all",
    )
    parser.add_argument(
        "--optimizer",
        choices=("fused", "client"),
        default="fused",
        help="fused: AdamW(lr=1e-4, weight_decay=0.01, fused=True), zerolap's from the ds_config; "
        f"client: torch's default AdamW({', '.join(f'{k}={v}' for k, v in CLIENT_ADAMW.items())}) "
        "built by the script and passed to initialize(optimizer=...), as a DeepSpeed user does",
    )
    parser.add_argument(
        "--malloc",
        choices=("fixed", "default"),
        default="fixed",
        help="fixed: MALLOC_MMAP_THRESHOLD_=131072 for every system, so that peak RSS compares "
        "allocation, not fragmentation; default: glibc's dynamic threshold (what a user's run "
        "has: faster steps, RSS not comparable)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs per system, in alternating order (pooled)"
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=None,
        help=f"re-runs of a system whose steps other processes disturbed (> {DISTURBED_CORES} "
        "cores busy); the least disturbed run is kept (default 1, 0 with --quick)",
    )
    return parser.parse_args(argv)


def _specs(args: argparse.Namespace) -> list[RunSpec]:
    models = args.models or (["small"] if args.quick else ["small", "42m"])
    worlds = args.world_sizes or ([2] if args.quick else [2, 4])
    steps = args.steps or (3 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    specs = []
    for model in models:
        for n in worlds:
            if n < 2:
                raise SystemExit(f"--world-sizes: {n} is not a data-parallel world size (>= 2)")
            micro = args.micro_batch or (
                QUICK_MICRO_BATCH if args.quick else max(1, MICRO_BATCH_AT_2[model] * 2 // n)
            )
            specs.append(RunSpec(model, n, micro, warmup, steps, args.optimizer == "client"))
    return specs


def _systems(names: list[str]) -> tuple[System, ...]:
    """The systems ``names`` (keys or set names) select, in ``SYSTEMS`` order."""
    keys = {key for name in names for key in SYSTEM_SETS.get(name, (name,))}
    return tuple(s for s in SYSTEMS if s.key in keys)


def run(argv: list[str] | None = None) -> list[SystemResult]:
    """Run the benchmark, print its tables (markdown) and return every row."""
    args = _parse(argv)
    specs = _specs(args)
    systems = _systems(args.systems)
    retries = args.retries if args.retries is not None else (0 if args.quick else 1)
    env = ENV if args.malloc == "fixed" else DEFAULT_MALLOC_ENV
    saved = {key: os.environ.get(key) for key in ENV}
    for key in ENV:
        os.environ.pop(key, None)
    os.environ.update(env)  # inherited by every spawned rank, for every system alike
    began = time.perf_counter()
    everything: list[SystemResult] = []
    summary: list[str] = []
    try:
        import torch

        from zerolap.demo.gpt import build_gpt

        adamw = ", ".join(f"{k}={v}" for k, v in specs[0].adamw().items())
        how = "built by the script" if specs[0].client_optimizer else "from the ds_config"
        print(
            f"# zero_bench: torch {torch.__version__}, gloo on localhost, one thread per rank, "
            f"fp32 AdamW({adamw}) {how}, {BUCKET_MB} MB buckets, malloc {args.malloc}, "
            f"{os.cpu_count()} CPUs\n",
            flush=True,
        )
        for spec in specs:
            numel = sum(p.numel() for p in build_gpt(spec.model).parameters())
            results = run_spec(
                spec,
                systems=systems,
                rounds=args.rounds,
                retries=retries,
                log=lambda s: print(s, file=sys.stderr),
            )
            print(format_table(spec, numel, results, args.rounds) + "\n", flush=True)
            fetches = format_fetches(results)
            if fetches:
                print(f"Stage 3's gathers per step:\n\n{fetches}\n", flush=True)
            summary += format_summary(spec, results)
            everything += results
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    print("### Summary: step-time ratios\n")
    print("| model | N | ratio | value | target | |\n|---|---|---|---|---|---|")
    print("\n".join(summary))
    print(f"\ntotal wall time {time.perf_counter() - began:.0f} s", flush=True)
    for result in everything:
        if result.error:
            print(f"\n{result.system.name} failed:\n{result.error}", file=sys.stderr)
    return everything


def main(argv: list[str] | None = None) -> int:
    """``run``; the exit status is 1 when a system failed (``zerolap bench`` ORs it)."""
    return int(any(result.error for result in run(argv)))


if __name__ == "__main__":
    sys.exit(main())
