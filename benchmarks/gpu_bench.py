"""One accelerator, world size 1: zerolap's overhead over plain PyTorch at every ZeRO stage, and
what offload to host memory costs and saves (issue 14's and issue 11's GPU figures).

Run from the repo root: ``python benchmarks/gpu_bench.py [--model gpt2|42m|small] [--batch 8]
[--gas 1] [--steps 20] [--warmup 5] [--rounds 2] [--systems NAME...] [--budget-s S]
[--count-syncs] [--profile] [--phases] [--cpu-as-gpu] [--interleaved]``; on a
lent GPU, ``benchmarks/gpu_check.sh`` runs it after the CUDA tests.

Every row trains the same GPT (``zerolap/demo/gpt.py``; ``gpt2`` is GPT-2 small's shape: 12
layers, d_model 768, 12 heads, 1024 tokens, vocabulary 50,304, 124M parameters) from the same
seed on the same batches, in bf16 with fp32 master weights and torch's fused AdamW (lr 1e-4,
weight decay 0.01), each in a fresh process, the rows alternating order round by round (or,
``--interleaved``, all in one process per round, taking turns step by step):

* ``plain``: PyTorch alone, the same arithmetic as zerolap's bf16 step: bf16 parameters, fp32
  master copies stepped by fused AdamW on fp32 copies of the gradients, the bf16 parameters
  refreshed from them. With ``--gas`` above 1 it accumulates the micro-batches' gradients in
  bf16 (``.grad``, as zerolap's stages 0-1 do); stages 2-3 accumulate their shard in fp32, so
  their losses drift from plain's by that rounding.
* ``z0`` .. ``z3``: zerolap at that stage; ``z3-blocks``: stage 3 gathering each Transformer
  block whole (``stage3_module_granularity_threshold`` at the blocks' granularity: one
  collective and one pair of hooks per block instead of per layer); ``z2-cpu``: stage 2 with
  ``offload_optimizer: cpu``; ``z3-cpu``: stage 3 with ``offload_optimizer`` and
  ``offload_param`` on ``cpu``.
* ``ds0`` .. ``ds3``, ``ds3-blocks``, ``ds2-cpu``, ``ds3-cpu``: DeepSpeed with the same
  ds_config, where ``import deepspeed`` reaches DeepSpeed itself (not zerolap's shim); a row
  DeepSpeed cannot run (its CPU Adam must compile) prints its error instead.

Per row: the median step time (forward, backward, step; the device synchronized around each),
against plain's; the accelerator's peak allocated memory; the process's peak RSS (where the
offloaded state went); the largest difference of the losses from plain's over the steps; and
in how many of its rounds every final parameter's sum (in float64) equals plain's first
round's: a bf16 loss hides differences smaller than its rounding, the sums do not, so a row
whose arithmetic is plain's shows whether the GPU ran it deterministically.
Targets (issue 14): stages 0-2 at most 1.03x plain, stage 3 at most 1.10x.

``--cpu-as-gpu`` has zerolap take its GPU paths on a CPU, so that the proxy below measures
their host work. ``--model thin`` keeps GPT-2 small's twelve blocks and layers at a width whose
arithmetic is small: on a CPU its step time over plain's is mostly the framework's host work
per step, what a GPU waits for when its kernels are shorter than the host's bookkeeping (stage
3's per-layer gathers, reductions and hooks). ``--profile`` says where the time went: where
the device sat idle, by the phase of the step whose host work ended the wait, and what it ran
in each phase, kernel by kernel, so that two rows' phases can be compared; ``--phases``
times each phase on the host and, on a GPU, on the device with CUDA events, light enough to run
beside the timings (with ``--interleaved`` too).

Without an accelerator it runs on CPU (gloo) and says so: a check that the script works, whose
figures say nothing about GPUs (offload to host memory then moves nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import resource
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.zero_bench import TIMEOUT_S, spawn

MIB = 1 << 20
LR, WEIGHT_DECAY = 1e-4, 0.01
MODELS = {  # name -> GPTConfig keywords
    "gpt2": dict(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "42m": dict(vocab_size=8192, seq_len=256, n_layer=12, n_head=8, d_model=512),
    "small": dict(vocab_size=4096, seq_len=128, n_layer=5, n_head=4, d_model=256),
    # GPT-2 small's 12 blocks at a width whose arithmetic is negligible: its step time on a CPU
    # is the host's work per step, which on a GPU is the step when the host falls behind.
    "thin": dict(vocab_size=512, seq_len=32, n_layer=12, n_head=4, d_model=64),
}
SYSTEMS = {  # name -> (framework, stage, offload, blocks gathered whole)
    "plain": ("torch", 0, False, False),
    **{f"z{s}": ("zerolap", s, False, False) for s in range(4)},
    "z3-blocks": ("zerolap", 3, False, True),
    "z2-cpu": ("zerolap", 2, True, False),
    "z3-cpu": ("zerolap", 3, True, False),
    **{f"ds{s}": ("deepspeed", s, False, False) for s in range(4)},
    "ds3-blocks": ("deepspeed", 3, False, True),
    "ds2-cpu": ("deepspeed", 2, True, False),
    "ds3-cpu": ("deepspeed", 3, True, False),
}
TARGET = {0: 1.03, 1: 1.03, 2: 1.03, 3: 1.10}  # step time over plain's


@dataclass
class Row:
    step_s: list[float]
    losses: list[float]
    peak_device_bytes: int
    peak_rss_bytes: int
    device: str
    syncs_per_step: float | None = None  # --count-syncs: implicit host syncs, measured steps
    profile: str | None = None  # --profile: where the measured steps' host and device time went
    phases: dict[str, tuple[float, float | None]] | None = None  # --phases: median host, device s
    param_sums: list[float] | None = None  # each final parameter's sum, in float64


def _config(stage: int, offload: bool, batch: int, gas: int, model: str = "gpt2") -> dict:
    zero: dict = {"stage": stage}
    if model == "thin":
        # Stage 3 shards and prefetches what it would in GPT-2 small: the defaults (100,000
        # and 50,000,000 elements) scaled by the matrices' size against GPT-2 small's.
        scale = (MODELS["thin"]["d_model"] / MODELS["gpt2"]["d_model"]) ** 2
        zero["stage3_param_persistence_threshold"] = int(1e5 * scale)
        zero["stage3_prefetch_bucket_size"] = int(5e7 * scale)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,  # plain does not clip (DeepSpeed 0.19.8 defaults to 1.0)
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": zero,
    }


def _unmarked(name: str) -> contextlib.AbstractContextManager:
    """A phase of the step as the timing rows run it: unmarked (``--profile`` marks it)."""
    return contextlib.nullcontext()


PHASES = ("forward", "backward", "step")


class _PhaseTimer:
    """``--phases``: each phase of a step, timed on the host (from entering it to leaving it)
    and, on a GPU, on the device (between CUDA events recorded as the host enters and leaves
    it: the device's time from finishing the work queued before the phase to finishing the
    phase's, its waits for the host's launches included). A phase whose device time exceeds
    its kernels' is one the host held up; against plain's, each phase's device time says where
    a row's extra step time went. On the CPU proxy the host's time is the whole story. Events
    cost microseconds: the timing rows run without."""

    def __init__(self, torch, cuda: bool) -> None:
        self.torch, self.cuda = torch, cuda
        self.marks: dict[str, list] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        events = None
        if self.cuda:
            events = [self.torch.cuda.Event(enable_timing=True) for _ in range(2)]
            events[0].record()
        start = time.perf_counter()
        try:
            yield
        finally:
            host = time.perf_counter() - start
            if events is not None:
                events[1].record()
            self.marks.setdefault(name, []).append((host, events))

    def spans(self) -> dict[str, tuple[float, float | None]]:
        """After the step's sync: per phase, host and device seconds (summed over the step's
        micro-batches; the device's None without a GPU)."""
        return {
            name: (
                sum(host for host, _ in self.marks.get(name, [])),
                sum(e[0].elapsed_time(e[1]) / 1e3 for _, e in self.marks.get(name, []))
                if self.cuda
                else None,
            )
            for name in PHASES
        }


def _median_phases(timed: list[dict]) -> dict[str, tuple[float, float | None]] | None:
    """Per phase, the median host and device seconds of the measured steps' spans."""
    if not timed:
        return None
    on_device = timed[0][PHASES[0]][1] is not None
    return {
        name: (
            statistics.median(t[name][0] for t in timed),
            statistics.median(t[name][1] for t in timed) if on_device else None,
        )
        for name in PHASES
    }


class _Plain:
    """PyTorch alone, with the fp32 master weights a bf16 run needs."""

    def __init__(self, model, torch) -> None:
        self.torch = torch
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.optimizer = torch.optim.AdamW(
            self.master, lr=LR, weight_decay=WEIGHT_DECAY, fused=True
        )

    def param_sums(self) -> list[float]:
        return [p.detach().sum(dtype=self.torch.float64).item() for p in self.params]

    def train_step(self, micro_batches, phase=_unmarked) -> float:
        losses = []
        for tokens, targets in micro_batches:
            with phase("forward"):
                loss = self.model(tokens, targets)
            with phase("backward"):
                (loss / len(micro_batches)).backward()  # the engines' scaling by 1 / gas
            losses.append(loss.detach())
        with phase("step"):
            for p, m in zip(self.params, self.master, strict=True):
                m.grad = p.grad.float()
                p.grad = None
            self.optimizer.step()
            with self.torch.no_grad():
                self.torch._foreach_copy_(self.params, self.master)
        return sum(loss.item() for loss in losses) / len(losses)  # read once the step is queued


class _Engine:
    def __init__(self, engine, gathered) -> None:
        self.engine = engine
        self.gathered = gathered  # the framework's zero.GatheredParameters (stage 3's whole)

    def param_sums(self) -> list[float]:
        import torch

        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        with self.gathered(params):
            return [p.detach().sum(dtype=torch.float64).item() for p in params]

    def train_step(self, micro_batches, phase=_unmarked) -> float:
        losses = []
        for tokens, targets in micro_batches:
            with phase("forward"):
                loss = self.engine(tokens, targets)
            with phase("backward"):
                self.engine.backward(loss)
            with phase("step"):
                self.engine.step()  # steps at the last micro-batch
            losses.append(loss.detach())
        return sum(loss.item() for loss in losses) / len(losses)


def _row(rank: int, *job_port_results) -> None:
    """One row in this fresh process (or, ``--interleaved``, every row): ``measure(*job)``
    with the job's first item as ``measure``, its result (or its traceback) put on
    ``results``."""
    import os

    measure, *job, port, results = job_port_results
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    try:
        results.put((rank, True, measure(*job)))
    except BaseException:
        import traceback

        results.put((rank, False, traceback.format_exc()))


def _measure(
    system: str,
    model_name: str,
    batch: int,
    gas: int,
    steps: int,
    warmup: int,
    count_syncs: bool,
    profile: bool = False,
    phases: bool = False,
    cpu_as_gpu: bool = False,
) -> Row:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    trainer, cfg = _trainer(system, model_name, batch, gas, cpu_as_gpu, device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    step_s, losses = [], []
    counting = count_syncs and cuda
    profiling, profilers = contextlib.ExitStack(), None
    timed: list[dict[str, tuple[float, float]]] = []  # --phases, per measured step
    with profiling, warnings.catch_warnings(record=counting) as caught:
        for step in range(warmup + steps):
            micro_batches = _micro_batches(cfg, batch, gas, step, device)
            sync()
            if counting and step == warmup:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")  # each implicit sync warns
                caught.clear()
            if profile and step == warmup:
                profilers = _start_profiling(profiling, torch, cuda)
            start = time.perf_counter()
            phase = torch.profiler.record_function if profilers else _unmarked
            # (Not with --profile, which marks the phases for its own account of them.)
            timed_step = phases and step >= warmup and not profilers
            timer = _PhaseTimer(torch, cuda) if timed_step else None
            losses.append(trainer.train_step(micro_batches, timer or phase))
            sync()
            if step >= warmup:
                step_s.append(time.perf_counter() - start)
            if timer is not None:
                timed.append(timer.spans())
        if counting:
            torch.cuda.set_sync_debug_mode("default")
            found = sum("synchroniz" in str(w.message) for w in caught)
    return Row(
        step_s=step_s,
        losses=losses,
        param_sums=trainer.param_sums(),
        peak_device_bytes=torch.cuda.max_memory_allocated(device) if cuda else 0,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        device=torch.cuda.get_device_name(device) if cuda else "cpu (no accelerator)",
        syncs_per_step=found / steps if counting else None,
        profile=_profile_summary(*profilers, sum(step_s), steps) if profilers else None,
        phases=_median_phases(timed),
    )


def _micro_batches(cfg, batch: int, gas: int, step: int, device) -> list[tuple]:
    """Step ``step``'s micro-batches on ``device``: the same for every row."""
    from zerolap.demo.gpt import synthetic_batch

    return [
        tuple(t.to(device) for t in synthetic_batch(cfg, batch, seed=step * gas + m))
        for m in range(gas)
    ]


def _trainer(system: str, model_name: str, batch: int, gas: int, cpu_as_gpu: bool, device):
    """``system``'s trainer of the GPT (seeded alike for every system), and the GPT's config."""
    import torch

    from zerolap.demo.gpt import GPT, GPTConfig

    framework, stage, offload, blocks = SYSTEMS[system]
    cfg = GPTConfig(**MODELS[model_name])
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=torch.bfloat16)
    if framework == "torch":
        return _Plain(model, torch), cfg
    if framework == "deepspeed":
        import deepspeed

        if "+zerolap" in deepspeed.__version__:
            raise RuntimeError("import deepspeed reaches zerolap's shim, not DeepSpeed")
    else:
        import zerolap as deepspeed

        if cpu_as_gpu and device.type == "cpu":  # this process only
            import zerolap.accelerator

            zerolap.accelerator.runs_apart = lambda device: True
    config = _config(stage, offload, batch, gas, model_name)
    if blocks:
        config["zero_optimization"]["stage3_module_granularity_threshold"] = _block_size(model)
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config,
    )
    return _Engine(engine, deepspeed.zero.GatheredParameters), cfg


def _interleaved(
    systems: list[str],
    model_name: str,
    batch: int,
    gas: int,
    steps: int,
    warmup: int,
    cpu_as_gpu: bool = False,
    phases: bool = False,
) -> dict[str, Row]:
    """``--interleaved``: every system in this one process, taking turns step by step (the
    order turned by one each step), so that each measured step of a system and the steps of
    the others around it run on a host in the same state: a lent machine's host speed moves
    by up to 2x from one process to the next, which rows in separate processes carry into
    their ratios. Peak memory is the process's, every system's together."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    trainers = {}
    for name in systems:
        trainers[name], cfg = _trainer(name, model_name, batch, gas, cpu_as_gpu, device)
    step_s: dict[str, list[float]] = {name: [] for name in systems}
    losses: dict[str, list[float]] = {name: [] for name in systems}
    timed: dict[str, list[dict]] = {name: [] for name in systems}  # --phases
    for step in range(warmup + steps):
        micro_batches = _micro_batches(cfg, batch, gas, step, device)
        turn = step % len(systems)
        for name in systems[turn:] + systems[:turn]:
            timer = _PhaseTimer(torch, cuda) if phases and step >= warmup else None
            sync()
            start = time.perf_counter()
            losses[name].append(trainers[name].train_step(micro_batches, timer or _unmarked))
            sync()
            if step >= warmup:
                step_s[name].append(time.perf_counter() - start)
            if timer is not None:
                timed[name].append(timer.spans())
    peak_device = torch.cuda.max_memory_allocated(device) if cuda else 0
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    name_of_device = torch.cuda.get_device_name(device) if cuda else "cpu (no accelerator)"
    return {
        name: Row(
            step_s=step_s[name],
            losses=losses[name],
            param_sums=trainers[name].param_sums(),
            peak_device_bytes=peak_device,
            peak_rss_bytes=peak_rss,
            device=name_of_device,
            phases=_median_phases(timed[name]),
        )
        for name in systems
    }


def _block_size(model) -> int:
    """The granularity (DeepSpeed's measure, which both compute alike) of the GPT's blocks: as
    ``stage3_module_granularity_threshold`` it gathers each block whole, with one collective."""
    from zerolap.demo.gpt import Block
    from zerolap.zero.leaf_modules import granularities

    return max(g for module, g in granularities(model).items() if isinstance(module, Block))


def _start_profiling(stack: contextlib.ExitStack, torch, cuda: bool):
    """torch's profiler (host ops and, on a GPU, kernels) and Python's (the framework's own
    functions) over the measured steps; they end with ``stack``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ops = stack.enter_context(torch.profiler.profile(activities=activities))
    python = cProfile.Profile()
    stack.callback(python.disable)
    python.enable()
    return ops, python


def _profile_summary(ops, python: cProfile.Profile, wall_s: float, steps: int) -> str:
    """The device's busy share of the steps (its work over wall time: below 1 the host or a
    wait held it up), where it waited and what it ran (``_device_time``), the ops taking most
    host time, and the Python functions."""
    averages = ops.key_averages()
    out = io.StringIO()
    stats = pstats.Stats(python, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    try:
        device, work_s = _device_time(ops.profiler.kineto_results.events(), steps)
    except Exception as error:  # a diagnosis: its failure must not hide the rest
        device, work_s = f"device time: not read ({type(error).__name__}: {error})", 0.0
    return (
        f"device work {work_s / steps * 1e3:.2f} ms a step, {work_s / wall_s:.0%} of the "
        f"steps' wall time (profiled, so slower than the timing rows)\n{device}\n"
        f"{averages.table(sort_by='self_cpu_time_total', row_limit=20)}\n{out.getvalue()}"
    )


def _device_time(events, steps: int, largest: int = 12) -> tuple[str, float]:
    """Where the device waited for the host, and what it ran; and the seconds of its work.
    Each gap between the device's work (kernels and copies, all streams merged) is put on the
    host op that launched the work ending it, and on the phase of the step (forward,
    backward, step) that op ran in. Each kernel or copy's time is put on the phase its
    launching op ran in, by name, so that two rows' phases can be compared kernel by kernel
    (summed over streams: where streams overlap, busy time rather than wall time). The
    device's wait across the start of a forward (since the last step's sync, for the loop)
    is not counted."""
    cpu = [e for e in events if e.device_type().name == "CPU"]
    phases = sorted((e.start_ns(), e.end_ns(), e.name()) for e in cpu if e.name() in PHASES)
    launcher = {e.correlation_id(): e for e in cpu}
    work = sorted(
        (
            (e.start_ns(), e.end_ns(), e.name(), launcher.get(e.linked_correlation_id()))
            for e in events
            if e.device_type().name != "CPU"
            and e.name() not in PHASES  # a phase's span on the device's timeline, not work
            and e.linked_correlation_id() in launcher
        ),
        key=lambda w: w[:2],
    )
    if not work or not phases:
        return "device time: no device work recorded", 0.0
    forwards = [p[0] for p in phases if p[2] == "forward"]

    def phase_of(t: int) -> str:
        for start, end, name in phases:
            if start <= t <= end:
                return name
        return "between phases"

    by_phase: dict[str, float] = {}
    ran: dict[tuple[str, str], list[float]] = {}  # (phase, kernel) -> [ms, launches]
    gaps = []
    busy_until = None
    for start, end, name, op in work:
        when = op.start_ns()
        where = phase_of(when)
        tally = ran.setdefault((where, name), [0.0, 0])
        tally[0] += (end - start) / 1e6
        tally[1] += 1
        # Idle across a forward's start is the loop's sync between steps: not counted.
        if (
            busy_until is not None
            and start > busy_until
            and not any(busy_until < f < start for f in forwards)
        ):
            gap = (start - busy_until) / 1e6
            by_phase[where] = by_phase.get(where, 0.0) + gap
            gaps.append((gap, where, op.name(), name))
        busy_until = end if busy_until is None else max(busy_until, end)
    lines = [
        "device idle a step, by the phase whose host work ended the wait: "
        + ", ".join(
            f"{p} {by_phase.get(p, 0.0) / steps:.2f} ms" for p in (*PHASES, "between phases")
        )
    ]
    for gap, where, op, kernel in sorted(gaps, reverse=True)[:largest]:
        lines.append(f"  {gap:7.3f} ms in {where}, ended by {op} ({kernel[:60]})")
    for phase in (*PHASES, "between phases"):
        kernels = sorted(
            ((ms, n, k) for (p, k), (ms, n) in ran.items() if p == phase), reverse=True
        )
        if kernels:
            total = sum(ms for ms, _, _ in kernels) / steps
            lines.append(f"device work in {phase}: {total:.3f} ms a step, by kernel:")
            lines.extend(
                f"  {ms / steps:7.3f} ms {n / steps:6.1f}x  {k[:90]}"
                for ms, n, k in kernels[:largest]
            )
    return "\n".join(lines), sum(ms for ms, _ in ran.values()) / 1e3


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=8, help="micro-batch size")
    parser.add_argument("--gas", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    default = [s for s in SYSTEMS if not s.startswith("ds")]
    parser.add_argument("--systems", nargs="+", default=default, choices=list(SYSTEMS))
    parser.add_argument(
        "--count-syncs",
        action="store_true",
        help="count the implicit host syncs of each measured step (CUDA's sync debug mode, "
        "which slows the step: a diagnosis, not a timing)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile the measured steps (torch's profiler and cProfile) and print where the "
        "host's and the device's time went, after the table: a diagnosis, not a timing",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="time each phase of the measured steps (forward, backward, step) on the host "
        "and, on a GPU, on the device (CUDA events), and print them after the table",
    )
    parser.add_argument(
        "--cpu-as-gpu",
        action="store_true",
        help="without an accelerator, have zerolap take the paths it takes on a GPU (stages "
        "0-2's in-place gradients, the step's decisions left on the device), to measure their "
        "host work on the CPU proxy (--model thin)",
    )
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="run every system in one process per round, taking turns step by step, so that "
        "the host's speed, which moves between processes, is every row's alike (zerolap's and "
        "plain's rows; peak memory is then the process's, all rows together)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no row after this many seconds (a lent GPU's time is short); the table "
        "then holds the rows measured so far",
    )
    args = parser.parse_args(argv)
    if args.interleaved:
        diagnoses = [f for f in ("count_syncs", "profile") if getattr(args, f)]
        if diagnoses:
            parser.error(f"--interleaved times whole steps only, not --{diagnoses[0]}")
        if any(SYSTEMS[s][0] == "deepspeed" for s in args.systems):
            parser.error("--interleaved runs zerolap's and plain's rows (DeepSpeed's own "
                         "import cannot share a process with zerolap's)")  # fmt: skip
    return args


def _run_interleaved(args, systems: list[str], runs: dict[str, list[Row]]) -> None:
    """``--interleaved``: each round one process running every system by turns."""
    began = time.monotonic()
    for rnd in range(args.rounds):
        timeout = TIMEOUT_S * len(systems)
        if args.budget_s is not None:
            left = args.budget_s - (time.monotonic() - began)
            if left <= 0:
                return
            timeout = min(timeout, left + 60)
        job = (
            _interleaved, systems, args.model, args.batch, args.gas, args.steps, args.warmup,
            args.cpu_as_gpu, args.phases,
        )  # fmt: skip
        rows = spawn(1, _row, job, timeout)[0]
        for name in systems:
            runs[name].append(rows[name])
            print(
                f"round {rnd + 1}, {name}: {statistics.median(rows[name].step_s) * 1e3:.1f} ms "
                f"on {rows[name].device} (interleaved)",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    systems = args.systems if "plain" in args.systems else ["plain", *args.systems]
    runs: dict[str, list[Row]] = {name: [] for name in systems}
    errors: dict[str, str] = {}
    began = time.monotonic()
    if args.interleaved:
        _run_interleaved(args, systems, runs)
    for rnd in range(0 if args.interleaved else args.rounds):
        order = systems if rnd % 2 == 0 else list(reversed(systems))
        for name in order:
            if name in errors:
                continue
            timeout = TIMEOUT_S
            if args.budget_s is not None:
                left = args.budget_s - (time.monotonic() - began)
                if left <= 0:
                    break
                timeout = min(timeout, left + 60)  # a row started now may finish a minute late
            try:
                job = (
                    _measure, name, args.model, args.batch, args.gas, args.steps, args.warmup,
                    args.count_syncs, args.profile, args.phases, args.cpu_as_gpu,
                )  # fmt: skip
                row = spawn(1, _row, job, timeout)[0]
                runs[name].append(row)
            except RuntimeError as err:
                errors[name] = str(err).strip().splitlines()[-1]
                print(f"round {rnd + 1}, {name}: failed: {errors[name]}", flush=True)
                continue
            # Each row as it ends: what a call cut short by its limit still brings back.
            print(
                f"round {rnd + 1}, {name}: {statistics.median(row.step_s) * 1e3:.1f} ms, peak "
                f"{row.peak_device_bytes / MIB:.0f} MiB on {row.device}",
                flush=True,
            )
    plain = runs["plain"]
    if not plain:
        print(f"plain PyTorch: {errors.get('plain', 'not run: --budget-s spent')}")
        return 1
    base = statistics.median(s for row in plain for s in row.step_s)
    print(
        f"{args.model}, micro-batch {args.batch} x {args.gas}, bf16, world 1 on "
        f"{plain[0].device}; median of "
        f"{args.steps} steps x up to {args.rounds} rounds after {args.warmup} warm-up steps"
        + ("; zerolap on its GPU paths (--cpu-as-gpu)" if args.cpu_as_gpu else "")
        + (
            "; every row in one process per round, by turns (peak memory: all rows together)"
            if args.interleaved
            else ""
        )
    )
    syncs = f" {'syncs/step':>10}" if args.count_syncs else ""
    print(f"{'system':10} {'step':>9} {'vs plain':>9} {'target':>7} {'peak device':>12} "
          f"{'peak RSS':>9} {'loss diff':>10} {'params':>6}{syncs}")  # fmt: skip
    for name in systems:
        if name in errors:
            print(f"{name:10} failed: {errors[name]}")
            continue
        rows = runs[name]
        if not rows:
            print(f"{name:10} not run: --budget-s {args.budget_s:.0f} spent")
            continue
        step = statistics.median(s for row in rows for s in row.step_s)
        framework, stage, offload, _ = SYSTEMS[name]
        target = f"{TARGET[stage]:.2f}x" if framework == "zerolap" and not offload else ""
        diff = max(
            abs(a - b) for row in rows for a, b in zip(row.losses, plain[0].losses, strict=True)
        )
        same = sum(r.param_sums == plain[0].param_sums for r in rows)
        counted = [r.syncs_per_step for r in rows if r.syncs_per_step is not None]
        syncs = f" {statistics.median(counted):10.1f}" if counted else ""
        print(
            f"{name:10} {step * 1e3:7.1f}ms {step / base:8.3f}x {target:>7} "
            f"{max(r.peak_device_bytes for r in rows) / MIB:9.0f}MiB "
            f"{max(r.peak_rss_bytes for r in rows) / MIB:6.0f}MiB {diff:10.2e} "
            f"{f'{same}/{len(rows)}':>6}{syncs}"
        )
    timed = {name: [r.phases for r in runs[name] if r.phases] for name in systems}
    if any(timed.values()):
        on_device = next(rows for rows in timed.values() if rows)[0][PHASES[0]][1] is not None
        print(f"\nphases, median ms ({'host / device' if on_device else 'host'}):")
        for name, rows in timed.items():
            if rows:
                cells = []
                for p in PHASES:
                    cell = f"{p} {statistics.median(r[p][0] for r in rows) * 1e3:5.2f}"
                    if on_device:
                        cell += f" / {statistics.median(r[p][1] for r in rows) * 1e3:5.2f}"
                    cells.append(cell)
                print(f"{name:10} " + ", ".join(cells))
    for name in systems:
        for row in runs[name]:
            if row.profile is not None:
                print(f"\n=== {name}: {row.profile}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
