"""Offload to disk (``offload_optimizer`` / ``offload_param`` on nvme) against keeping
everything in memory: step time, resident memory, the disk's own bandwidth, how much of the I/O
the step exposes, and the optimizer's throughput.

Run from the repo root: ``python benchmarks/offload_bench.py [--quick] [--models 42m 170m]
[--steps 5] [--rounds 3] [--sub-group-size N [N ...]] [--swap-dir DIR]``.

* Disk: the bandwidth of the swap directory's filesystem, measured first in the same run by
  writing and reading a 512 MiB file through ``zerolap.offload.swap_file`` (direct I/O where
  the filesystem takes it, as the swap files use).
* Training rows: a GPT (``zerolap/demo/gpt.py``) on 2 ranks (gloo, one thread each), ZeRO-2,
  fp32 AdamW (fused), micro-batch 1, with offload ``none`` or ``nvme`` (``sub_group_size`` from
  ``--sub-group-size``, 2M by default, ``buffer_count`` 4: 64 MiB of buffers per rank; ``nvme``
  steps the swapped sub-groups behind ``step()``, ``nvme-in-step`` is the same with
  ``defer_step: false``); and ZeRO-3 without offload (``z3``) and with both offloads on nvme
  (``z3-nvme``, every sharded unit's parameters swapped: ``max_in_cpu`` 0). Each system runs in
  fresh processes, alternating in rounds; step time is the slowest rank's, median over the timed
  steps of all rounds (the first step after warm-up starts with nothing stepping behind it and
  is not timed). Rank 0's median forward, backward and ``step()`` are printed apart: a step
  behind ``step()`` moves time from ``step()`` into the forward. Resident memory is the ranks'
  anonymous RSS after the last step (the sum over ranks) and the model state
  ``engine.memory_breakdown()`` counts as resident.
* Exposed I/O = step(offloaded) - step(same stage, no offload), against the I/O a step does:
  the bytes read and written by both ranks' swap files per step (counted by the files) over
  the disk's measured bandwidth. Target: exposed <= 25% of the I/O time, where forward +
  backward take longer than the I/O (the reads start when the last backward does; at stages 1-2
  the step and its writes run under the next forward). Only the ``buffer_count`` sub-groups read
  ahead hide under the backward, so what hides grows with the buffers: several
  ``--sub-group-size`` values run every offloaded system once per size (``nvme@10M``), and the
  ``buffers`` column is the memory that costs (both ranks).
* Optimizer throughput: elements per second of one step at one thread over a 16.8M-element
  shard: torch's fused AdamW alone, then zerolap's step (world size 1) with the state in memory
  and streamed from disk; and the swap files' checksum (XXH3) against zlib's CRC-32 over
  one 16 MiB region.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.zero_bench import ENV, spawn

MIB = 1 << 20
MODELS = {  # name -> GPTConfig keywords (42m is the preset; 170m is 4.1x its parameters)
    "42m": dict(vocab_size=8192, seq_len=256, n_layer=12, n_head=8, d_model=512),
    "170m": dict(vocab_size=8192, seq_len=256, n_layer=13, n_head=16, d_model=1024),
    "small": dict(vocab_size=4096, seq_len=128, n_layer=5, n_head=4, d_model=256),
}
SYSTEMS = {  # name -> (stage, offload_optimizer, offload_param)
    "none": (2, False, False),
    "nvme": (2, True, False),
    "nvme-in-step": (2, True, False),  # defer_step false: the whole step inside step()
    "z3": (3, False, False),
    "z3-nvme": (3, True, True),
}
BASELINE = {
    "nvme": "none",
    "nvme-in-step": "none",
    "z3-nvme": "z3",
}  # what each offloaded row is compared with


@dataclass
class RankResult:
    step_s: list[float]
    phases_s: list[tuple[float, float, float]]  # per timed step: forward, backward, step()
    anon_rss: int
    resident_bytes: int
    swapped_bytes: int
    buffer_bytes: int
    io_bytes_per_step: float
    io_busy_s_per_step: float
    loss: float


def _anon_rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _swap_files(engine) -> list:
    files = []
    for tier in engine.optimizer.tiers[1:]:
        files.append(tier.state.file)
    swap = getattr(engine.param_store, "swap", None)
    if swap is not None:
        files.append(swap.file)
    return files


def _io(files) -> tuple[int, float]:
    return (
        sum(f.read_bytes + f.write_bytes for f in files),
        sum(f.read_s + f.write_s for f in files),
    )


def _train(
    rank: int, model_name: str, system: str, steps: int, warmup: int, swap_dir: str, sub_group: int
):
    import torch

    import zerolap
    import zerolap.comm as dist
    from zerolap.demo.gpt import GPT, GPTConfig, synthetic_batch

    stage, opt, param = SYSTEMS[system]
    zero = {
        "stage": stage,
        "overlap_comm": True,
        "reduce_bucket_size": 2_000_000,
        "sub_group_size": sub_group,
    }
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 100_000
    if opt:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir, "buffer_count": 4}
        if system == "nvme-in-step":
            zero["offload_optimizer"]["defer_step"] = False
    if param:
        zero["offload_param"] = {"device": "nvme", "nvme_path": swap_dir, "max_in_cpu": 0}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }
    cfg = GPTConfig(**MODELS[model_name])
    torch.manual_seed(0)
    engine, *_ = zerolap.initialize(model=GPT(cfg), config=config)
    files = _swap_files(engine)
    times, phases, loss = [], [], 0.0
    io_start = (0, 0.0)
    for step in range(warmup + steps):
        if step == warmup:
            # I/O is counted from here: the last warm-up step's swapped sub-groups, which step
            # behind it (defer_step), are done first. So this step starts with nothing behind
            # it, unlike the others, and only the steps after it are timed.
            engine.optimizer.finish_step()
            io_start = _io(files)
        inputs, targets = synthetic_batch(cfg, 1, seed=step * 2 + rank)
        dist.barrier()
        began = time.perf_counter()
        loss_t = engine(inputs, targets)
        forward = time.perf_counter()
        engine.backward(loss_t)
        backward = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
        phases.append((forward - began, backward - forward, began + times[-1] - backward))
        loss = loss_t.item()
    # The last step's swapped sub-groups (defer_step) and its write-back finish under the
    # next forward: wait for them here.
    engine.optimizer.finish_step()
    for tier in engine.optimizer.tiers[1:]:
        tier.state.drain()
    io_bytes, io_s = _io(files)
    memory = engine.memory_breakdown()
    result = RankResult(
        step_s=times[warmup + 1 :],
        phases_s=phases[warmup + 1 :],
        anon_rss=_anon_rss(),
        resident_bytes=memory.total_bytes,
        swapped_bytes=memory.swapped_bytes,
        buffer_bytes=memory.swap_buffer_bytes,
        io_bytes_per_step=(io_bytes - io_start[0]) / steps,
        io_busy_s_per_step=(io_s - io_start[1]) / steps,
        loss=loss,
    )
    engine.destroy()
    return result


def _rank_main(rank, world, fn, args, port, results) -> None:
    os.environ.update(ENV)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    try:
        import torch

        torch.set_num_threads(1)
        import zerolap.comm as dist

        dist.init_distributed(dist_backend="gloo", verbose=False)
        results.put((rank, True, fn(rank, *args)))
    except BaseException:
        import traceback

        results.put((rank, False, traceback.format_exc()))


def _spawn(world: int, fn, *args) -> list:
    return spawn(world, _rank_main, (world, fn, args))


# -- the disk and the optimizer on their own ------------------------------------------------


def disk_bandwidth(directory: str, nbytes: int = 512 * MIB) -> tuple[float, float, bool]:
    """(write, read) bytes/s of ``directory``'s filesystem through a swap file, in 64 MiB
    transfers; and whether direct I/O was used."""
    from zerolap.offload.swap_file import SwapFile, aligned_empty

    chunk = 64 * MIB
    buffer = aligned_empty(chunk)
    buffer.random_(0, 255)
    swap = SwapFile(Path(directory) / "bandwidth.swap", nbytes)
    try:
        began = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            swap.write(offset, buffer, chunk)
        os.fsync(swap._fd)
        write = nbytes / (time.perf_counter() - began)
        began = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            swap.read(offset, buffer, chunk)
        read = nbytes / (time.perf_counter() - began)
        return write, read, swap.direct
    finally:
        swap.close()


def _optimizer_rate(rank: int, system: str, swap_dir: str, repeats: int) -> dict:
    """Elements per second of one optimizer step (engine at world size 1) or of torch's fused
    AdamW alone, over a 4096 x 4096 weight."""
    import torch

    import zerolap

    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096, bias=False)
    numel = model.weight.numel()
    times = []
    if system == "fused AdamW":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        model.weight.grad = torch.randn_like(model.weight)
        for _ in range(repeats + 1):
            began = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - began)
        return {"numel": numel, "step_s": statistics.median(times[1:])}
    zero = {"stage": 1, "sub_group_size": 2_000_000}
    if system == "zerolap nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
    }
    engine, *_ = zerolap.initialize(model=model, config=config)
    x = torch.randn(1, 4096)
    for _ in range(repeats + 1):
        engine.backward(engine(x).sum())
        began = time.perf_counter()  # (the reads began with the backward, as in training)
        engine.step()
        for tier in engine.optimizer.tiers[1:]:
            tier.state.drain()  # the write-back counts here: nothing else runs meanwhile
        times.append(time.perf_counter() - began)
    engine.destroy()
    return {"numel": numel, "step_s": statistics.median(times[1:])}


# -- the run ---------------------------------------------------------------------------------


def io_shapes(directory: str, nbytes: int = 256 * MIB, rounds: int = 3) -> None:
    """MiB/s writing and reading ``nbytes`` through a swap file as one request (what zerolap
    does per region), against DeepSpeed's ``aio`` shapes: blocks of ``block_size`` from
    ``intra_op_parallelism`` threads. Medians of ``rounds``, the shapes alternating."""
    from concurrent.futures import ThreadPoolExecutor

    from zerolap.offload.swap_file import SwapFile, aligned_empty

    buffer = aligned_empty(nbytes)
    buffer.random_(0, 255)
    view = memoryview((ctypes.c_ubyte * nbytes).from_address(buffer.data_ptr())).cast("B")
    swap = SwapFile(Path(directory) / "shapes.swap", nbytes)
    shapes = [(nbytes, 1)] + [(b * MIB, t) for b in (1, 4) for t in (1, 2, 4, 8)]
    pools = {threads: ThreadPoolExecutor(threads) for threads in (1, 2, 4, 8)}

    def transfer(call, block: int, threads: int) -> None:
        def one(offset: int) -> None:
            done = 0
            while done < block:
                done += call(swap._fd, [view[offset + done : offset + block]], offset + done)

        list(pools[threads].map(one, range(0, nbytes, block)))

    speeds = {shape: ([], []) for shape in shapes}
    try:
        for _ in range(rounds):
            for shape in shapes:
                began = time.perf_counter()
                transfer(os.pwritev, *shape)
                os.fsync(swap._fd)
                speeds[shape][0].append(nbytes / (time.perf_counter() - began) / MIB)
                began = time.perf_counter()
                transfer(os.preadv, *shape)
                speeds[shape][1].append(nbytes / (time.perf_counter() - began) / MIB)
    finally:
        swap.close()
        for pool in pools.values():
            pool.shutdown()
    print(f"{nbytes // MIB} MiB under {directory} ({'direct' if swap.direct else 'buffered'} I/O)")
    print("| requests | write MiB/s | read MiB/s |\n|---|---|---|")
    for (block, threads), (write, read) in speeds.items():
        what = "one" if block == nbytes else f"{block // MIB} MiB blocks, {threads} threads"
        print(f"| {what} | {statistics.median(write):.0f} | {statistics.median(read):.0f} |")


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--sub-group-size",
        type=int,
        nargs="+",
        default=[2_000_000],
        help="elements (buffers: 4 of them); several sizes run each offloaded system per size",
    )
    parser.add_argument(
        "--swap-dir", default=None, help="where swap files go (default: a temp dir)"
    )
    parser.add_argument("--quick", action="store_true", help="small model, 1 round, 2 steps")
    parser.add_argument(
        "--io-shapes",
        action="store_true",
        help="only the disk: one request against DeepSpeed's aio blocks and threads",
    )
    return parser.parse_args(argv)


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.2f}"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.quick:
        args.models, args.rounds, args.steps, args.warmup = ["small"], 1, 2, 1
    models = args.models or ["42m", "170m"]
    with tempfile.TemporaryDirectory(dir=args.swap_dir, prefix="zerolap-offload-") as swap:
        if args.io_shapes:
            io_shapes(swap)
            return 0
        write_bw, read_bw, direct = disk_bandwidth(swap)
        print(
            f"disk under {swap}: write {write_bw / MIB:,.0f} MiB/s, read {read_bw / MIB:,.0f} "
            f"MiB/s ({'direct' if direct else 'buffered'} I/O, 64 MiB transfers)\n"
        )
        io_bw = 2 / (1 / write_bw + 1 / read_bw)  # as much is read as written per step
        rows = _rows(args.systems, args.sub_group_size)
        for model in models:
            runs: dict[str, list] = {row: [] for row in rows}
            for rnd in range(args.rounds):
                order = list(rows) if rnd % 2 == 0 else list(reversed(rows))
                for row in order:
                    system, sub_group = rows[row]
                    runs[row].append(
                        _spawn(2, _train, model, system, args.steps, args.warmup, swap, sub_group)
                    )
            _print_model(model, runs, rows, io_bw)
        _print_optimizer(swap)
        _print_checksums()
    return 0


def _rows(systems: list[str], sizes: list[int]) -> dict[str, tuple[str, int]]:
    """Row name -> (system, sub_group_size): an offloaded system once per size, named by it
    when there are several; the others once (the size changes nothing they do)."""
    rows = {}
    for system in systems:
        if system in BASELINE and len(sizes) > 1:
            rows.update({f"{system}@{_size(n)}": (system, n) for n in sizes})
        else:
            rows[system] = (system, sizes[0])
    return rows


def _size(numel: int) -> str:
    return f"{numel / 1e6:g}M" if numel >= 1_000_000 else f"{numel / 1e3:g}K"


def _summary(rounds: list[list[RankResult]]) -> dict:
    steps = [max(s) for ranks in rounds for s in zip(*(r.step_s for r in ranks), strict=True)]
    last = rounds[-1]
    return {
        "step_s": statistics.median(steps),
        # Rank 0's median forward, backward and step() (where a step behind step() shows).
        "phases_s": [
            statistics.median(step[k] for ranks in rounds for step in ranks[0].phases_s)
            for k in range(3)
        ],
        "anon_rss": statistics.median(sum(r.anon_rss for r in ranks) for ranks in rounds),
        "resident": sum(r.resident_bytes for r in last),
        "swapped": sum(r.swapped_bytes for r in last),
        "buffers": sum(r.buffer_bytes for r in last),
        "io_bytes": sum(r.io_bytes_per_step for r in last),
        "io_busy_s": max(r.io_busy_s_per_step for r in last),
        "loss": last[0].loss,
    }


def _print_model(model: str, runs: dict, systems: dict, io_bw: float) -> None:
    rows = {name: _summary(rounds) for name, rounds in runs.items()}
    steps = sum(len(r) for r in next(iter(runs.values())))
    print(f"model {model}, 2 ranks, median step over {steps} runs")
    print(
        f"  {'system':12} {'step':>8} {'vs base':>8} {'anon RSS':>9} {'state in':>9} "
        f"{'swapped':>8} {'buffers':>8} {'I/O/step':>9} {'I/O time':>9} {'exposed':>8} "
        f"{'exp/I/O':>8} {'loss':>8}"
    )
    for name, row in rows.items():
        system = systems[name][0]
        base = rows.get(BASELINE.get(system, name), row)
        io_time = row["io_bytes"] / io_bw
        exposed = row["step_s"] - base["step_s"]
        share = f"{exposed / io_time:8.0%}" if io_time else f"{'-':>8}"
        print(
            f"  {name:12} {row['step_s'] * 1e3:6.0f}ms {row['step_s'] / base['step_s']:7.2f}x "
            f"{_gib(row['anon_rss']):>6}GiB {_gib(row['resident']):>6}GiB "
            f"{_gib(row['swapped']):>5}GiB {_gib(row['buffers']):>5}GiB "
            f"{_gib(row['io_bytes']):>6}GiB "
            f"{io_time * 1e3:7.0f}ms {exposed * 1e3:6.0f}ms {share} {row['loss']:8.4f}"
        )
    print(
        "  (anon RSS, state and buffers: both ranks together; I/O time = bytes / the disk's"
        " bandwidth; exposed = step - step of the same stage without offload)"
    )
    print("  rank 0's median forward / backward / step() (a step behind step() shows in forward):")
    for name, row in rows.items():
        forward, backward, step = (t * 1e3 for t in row["phases_s"])
        print(f"  {name:12} {forward:6.0f} / {backward:6.0f} / {step:6.0f} ms")
    print(
        "  the target (exposed <= 25% of the I/O time) holds where forward + backward take longer"
    )
    print("  than the I/O; forward + backward of the same stage without offload, against it:")
    for name, row in rows.items():
        base = rows.get(BASELINE.get(systems[name][0], name), row)
        io_time = row["io_bytes"] / io_bw
        if not io_time or base is row:
            continue
        compute = sum(base["phases_s"][:2])
        exposed = (row["step_s"] - base["step_s"]) / io_time
        verdict = (
            f"applies: {exposed:.0%}, {'met' if exposed <= 0.25 else 'not met'}"
            if compute >= io_time
            else "does not apply (the I/O is longer)"
        )
        print(f"  {name:12} {compute * 1e3:6.0f} ms against {io_time * 1e3:6.0f} ms: {verdict}")
    print()


def _print_optimizer(swap: str) -> None:
    print("optimizer step, one thread, 16.8M fp32 elements (AdamW):")
    fused = None
    for system in ("fused AdamW", "zerolap in memory", "zerolap nvme"):
        result = _spawn(1, _optimizer_rate, system, swap, 5)[0]
        rate = result["numel"] / result["step_s"]
        fused = fused or rate
        print(
            f"  {system:18} {result['step_s'] * 1e3:7.1f} ms  {rate / 1e6:7.1f} M elements/s"
            f"  {rate / fused:5.2f}x fused"
        )


def _print_checksums() -> None:
    """The swap files' checksum (XXH3) against zlib's CRC-32, one thread, over one 16 MiB region
    (a sub-group of 2M elements with two fp32 moments, as in the training rows)."""
    import zlib

    import xxhash

    data = os.urandom(16 * MIB)
    print("\nchecksum of one 16 MiB swap region, one thread:")
    for name, checksum in (("XXH3 (swap files)", xxhash.xxh3_64_intdigest), ("CRC-32", zlib.crc32)):
        times = []
        for _ in range(5):
            began = time.perf_counter()
            checksum(data)
            times.append(time.perf_counter() - began)
        print(f"  {name:18} {len(data) / statistics.median(times) / 1e9:7.1f} GB/s")


if __name__ == "__main__":
    raise SystemExit(main())
