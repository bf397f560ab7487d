"""Parameters, MACs, FLOPs and forward latency per module: DeepSpeed's flops profiler
(``deepspeed.profiling.flops_profiler``: ``FlopsProfiler``, ``get_model_profile``).

How it counts. While the profiled model's forward runs, a torch dispatch mode sees every aten
operation, whatever Python call led to it (``F.linear``, ``@``, ``torch.einsum``, a Hugging
Face attention), and counts those torch's own formulas cover (``torch.utils.flop_counter``:
matrix products, convolutions, attention), each attributed to the innermost module running.
Every such operation is multiply-adds, so MACs are FLOPs / 2. Elementwise operations,
normalisations and activations are not counted: DeepSpeed adds its own estimates of those, a
few percent of a Transformer's, so its flops come out that much higher while its MACs agree
(``benchmarks/flops_deepspeed_diff.py``).

How it times. Forward hooks on every module read the clock on entry and exit (after an
accelerator synchronisation, as DeepSpeed does). ``get_model_profile`` and the engine time a
forward pass of their own without the dispatch mode, so the latencies they print do not
include the counting's own cost; ``FlopsProfiler`` used by hand does both in the same pass, as
DeepSpeed's does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from zerolap.accelerator import get_accelerator

__all__ = [
    "FlopsProfiler",
    "ModelProfile",
    "StepTimes",
    "get_model_profile",
]

_aten = torch.ops.aten
# torch's formulas, plus the CPU flash attention kernel, which takes the same leading
# arguments as the CUDA one and is missing from torch's table.
_FORMULAS = {
    **flop_registry,
    _aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[
        _aten._scaled_dot_product_flash_attention
    ],
}


class _Counting(TorchDispatchMode):
    """Adds each counted operation's FLOPs to ``profile``'s innermost running module."""

    def __init__(self, profile: ModelProfile, stack: list[torch.nn.Module]) -> None:
        super().__init__()
        self.profile = profile
        self.stack = stack

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FORMULAS.get(func._overloadpacket)
        if formula is not None and self.stack:
            self.profile.own_flops[self.stack[-1]] += int(formula(*args, **kwargs, out_val=out))
        return out


@functools.cache
def _warm_up() -> None:
    """The first operation through any Python dispatch mode imports a large part of torch
    (dynamo, sympy: about a second); done here, once per process, it stays out of the first
    profiled forward's latencies."""
    with _Counting(ModelProfile(torch.nn.Module()), []):
        torch.zeros(1).add(1)


@dataclasses.dataclass
class ModelProfile:
    """What one profiled pass found, per module: FLOPs its own operations did (children's
    not included), and its forward time (children's included), in seconds."""

    model: torch.nn.Module
    own_flops: dict[torch.nn.Module, int] = dataclasses.field(
        default_factory=lambda: defaultdict(int)
    )
    duration: dict[torch.nn.Module, float] = dataclasses.field(
        default_factory=lambda: defaultdict(float)
    )
    timed_passes: int = 1
    """What the durations are summed over: ``latency`` divides by it."""

    def flops(self, module: torch.nn.Module) -> int:
        """``module``'s and its descendants' (a module held twice in the tree counted once)."""
        return sum(self.own_flops.get(m, 0) for m in module.modules())

    def macs(self, module: torch.nn.Module) -> int:
        return self.flops(module) // 2

    def latency(self, module: torch.nn.Module) -> float:
        """Seconds per timed pass."""
        return self.duration.get(module, 0.0) / self.timed_passes


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """A training step's times, for the summary lines an engine adds (seconds)."""

    forward: float
    """One micro-batch's forward."""
    backward: float
    """One micro-batch's backward (gradient reduction included)."""
    step: float
    """The optimizer step (once per step)."""
    micro_batches: int
    samples: int
    """Samples the step trained over all ranks."""
    world_size: int
    data_parallel_size: int
    model_parallel_size: int
    micro_batch_size: int


def param_count(module: torch.nn.Module) -> int:
    """Parameters held by ``module`` and its children on this rank (a ZeRO-3 parameter counts
    whole: its ``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


class _Hooks:
    """Forward hooks on every module of ``model`` but those of ``ignore`` types, which record
    into ``profile``: which module runs (for counting) and how long each takes."""

    def __init__(
        self,
        model: torch.nn.Module,
        profile: ModelProfile,
        *,
        count: bool,
        timed: bool,
        ignore: Iterable[type] = (),
    ) -> None:
        self.model, self.profile, self.count, self.timed = model, profile, count, timed
        if count:
            _warm_up()
        self.stack: list[torch.nn.Module] = []
        self.starts: list[float] = []
        self.mode: _Counting | None = None
        self._sync = not get_accelerator().is_synchronized_device()
        ignored = tuple(ignore)
        self.handles = []
        for module in model.modules():
            if module is not model and ignored and isinstance(module, ignored):
                continue
            self.handles.append(module.register_forward_pre_hook(self._enter))
            self.handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _clock(self) -> float:
        if self._sync:
            get_accelerator().synchronize()
        return time.perf_counter()

    def _enter(self, module, args) -> None:
        if module is self.model and not self.stack and self.count:
            self.mode = _Counting(self.profile, self.stack)
            self.mode.__enter__()
        self.stack.append(module)
        self.starts.append(self._clock() if self.timed else 0.0)

    def _leave(self, module, args, output) -> None:
        if not self.stack or self.stack[-1] is not module:
            return  # a hook added while this module ran: its entry was not seen
        self.stack.pop()
        start = self.starts.pop()
        if self.timed:
            self.profile.duration[module] += self._clock() - start
        if module is self.model and not self.stack and self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.mode is not None:  # removed inside a forward
            self.mode.__exit__(None, None, None)
            self.mode = None


@contextlib.contextmanager
def recording(
    model: torch.nn.Module,
    profile: ModelProfile,
    *,
    count: bool,
    timed: bool,
    ignore: Iterable[type] = (),
) -> Iterator[None]:
    """``profile`` records the forwards of ``model`` run inside the block."""
    hooks = _Hooks(model, profile, count=count, timed=timed, ignore=ignore)
    try:
        yield
    finally:
        hooks.remove()


# -- numbers as DeepSpeed prints them -------------------------------------------------------


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """``num`` in the largest of T, G, M, K that keeps it at least 1: "336.23 M"."""
    scales = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0))
    if units is None:
        units, scale = next(((u, s) for u, s in scales if abs(num) >= s), ("", 1.0))
    else:
        scale = dict(scales)[units]
    return f"{round(num / scale, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(macs, units, precision) + "MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(flops, units, precision) + "FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(params, units, precision).rstrip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = 2) -> str:
    """Seconds as s, ms or us, whichever keeps the number at least 1."""
    scales = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6))
    if units is None:
        units, scale = next(((u, s) for u, s in scales if abs(seconds) >= s), ("us", 1e-6))
    else:
        scale = dict(scales)[units]
    return f"{round(seconds / scale, precision):g} {units}"


# -- the report -------------------------------------------------------------------------------


def _ratio(part: float, whole: float) -> str:
    return f"{round(100 * part / whole, 2) if whole else 0:g}%"


def _line(label: str, value) -> str:
    return f"{label:<70}  {value}"


def _by_depth(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    depths: dict[int, list[torch.nn.Module]] = defaultdict(list)

    def walk(module: torch.nn.Module, depth: int) -> None:
        depths[depth].append(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(model, 0)
    return depths


def aggregated_report(profile: ModelProfile, module_depth: int = -1, top_modules: int = 1) -> str:
    """At each depth, the module types that hold the most parameters, do the most MACs and
    take the longest, summed over the modules of each type there."""
    depths = _by_depth(profile.model)
    last = max(depths) if module_depth < 0 else min(module_depth, max(depths))
    lines = ["Top modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in range(last + 1):
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        for module in depths[depth]:
            entry = totals[type(module).__name__]
            entry[0] += param_count(module)
            entry[1] += profile.macs(module)
            entry[2] += profile.latency(module)
        lines.append(f"depth {depth}:")
        for title, index, show in (
            ("params", 0, params_to_string),
            ("MACs", 1, macs_to_string),
            ("fwd latency", 2, duration_to_string),
        ):
            top = sorted(totals.items(), key=lambda item: item[1][index], reverse=True)
            shown = {name: show(values[index]) for name, values in top[:top_modules]}
            lines.append(f"    {title:<11} - {shown}")
    return "\n".join(lines)


def detailed_report(profile: ModelProfile, module_depth: int = -1) -> str:
    """The model's module tree, each module with its parameters, MACs, forward latency (each
    also as a share of the model's) and achieved FLOPS."""
    model = profile.model
    total_params, total_macs = param_count(model), profile.macs(model)
    total_latency = profile.latency(model)

    def describe(module: torch.nn.Module) -> str:
        params, macs, latency = param_count(module), profile.macs(module), profile.latency(module)
        achieved = profile.flops(module) / latency if latency else 0
        return ", ".join(
            [
                f"{params_to_string(params)} = {_ratio(params, total_params)} Params",
                f"{macs_to_string(macs)} = {_ratio(macs, total_macs)} MACs",
                f"{duration_to_string(latency)} = {_ratio(latency, total_latency)} latency",
                flops_to_string(achieved),
            ]
        )

    lines: list[str] = []

    def walk(module: torch.nn.Module, name: str, depth: int) -> None:
        prefix = "  " * depth + (f"({name}): " if name else "")
        lines.append(f"{prefix}{type(module).__name__}({describe(module)})")
        if module_depth < 0 or depth < module_depth:
            for child_name, child in module.named_children():
                walk(child, child_name, depth + 1)

    walk(model, "", 0)
    return "\n".join(lines)


def model_report(
    profile: ModelProfile,
    *,
    profile_step: int = 1,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
    times: StepTimes | None = None,
    recompute_fwd_factor: float = 0.0,
) -> str:
    """The whole printed profile: the summary (with a training step's latencies and FLOPS
    when ``times`` is given), the aggregated view, and the module tree when ``detailed``."""
    model = profile.model
    flops, macs, params = profile.flops(model), profile.macs(model), param_count(model)
    mp = times.model_parallel_size if times else 1
    lines = [
        "",
        "-------------------------- DeepSpeed Flops Profiler --------------------------",
        f"Profile Summary at step {profile_step}:",
        "MACs: multiply-accumulates of the matrix products, convolutions and attention;",
        "flops = 2 x MACs; FLOPS: flops per second; latencies are per micro-batch but the",
        "optimizer step's; iter latency: the whole step.",
        "",
    ]
    if times is not None:
        lines += [
            _line("world size: ", times.world_size),
            _line("data parallel size: ", times.data_parallel_size),
            _line("model parallel size: ", times.model_parallel_size),
            _line("batch size per GPU: ", times.micro_batch_size),
        ]
    fwd = times.forward if times is not None else profile.latency(model)
    lines += [
        _line("params per GPU: ", params_to_string(params)),
        _line("params of model = params per GPU * mp_size: ", params_to_string(params * mp)),
        _line("fwd MACs per GPU: ", macs_to_string(macs)),
        _line("fwd flops per GPU: ", number_to_string(flops)),
        _line("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(flops * mp)),
        _line("fwd latency: ", duration_to_string(fwd)),
        _line(
            "fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
            flops_to_string(flops / fwd if fwd else 0),
        ),
    ]
    if times is not None:
        factor = 2 + recompute_fwd_factor
        bwd = times.backward
        iteration = times.micro_batches * (fwd + bwd) + times.step
        lines += [
            _line("bwd latency: ", duration_to_string(bwd)),
            _line(
                f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
                flops_to_string(factor * flops / bwd if bwd else 0),
            ),
            _line(
                f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                flops_to_string((factor + 1) * flops / (fwd + bwd) if fwd + bwd else 0),
            ),
            _line("step latency: ", duration_to_string(times.step)),
            _line("iter latency: ", duration_to_string(iteration)),
            _line(
                f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU * micro-batches / "
                "iter latency: ",
                flops_to_string((factor + 1) * flops * times.micro_batches / iteration),
            ),
            _line("samples/second: ", round(times.samples / iteration, 2)),
        ]
    lines += [
        "",
        "-" * 29 + " Aggregated Profile per GPU " + "-" * 29,
        aggregated_report(profile, module_depth, top_modules),
    ]
    if detailed:
        lines += [
            "",
            "-" * 30 + " Detailed Profile per GPU " + "-" * 30,
            "Each module: params, share of the model's params, MACs, share of the model's MACs,",
            "fwd latency, share of the model's fwd latency, FLOPS achieved. A module's MACs and",
            "latency include its children's, and the work it does itself outside them (a loss",
            "computed in its forward).",
            "",
            detailed_report(profile, module_depth),
        ]
    lines.append("------------------------------------------------------------------------------")
    return "\n".join(lines)


def write_report(text: str, output_file: str | None) -> None:
    """``text`` to ``output_file`` (its directory made), or to standard output."""
    if output_file:
        path = Path(output_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    else:
        print(text, file=sys.stdout, flush=True)


# -- DeepSpeed's interface ----------------------------------------------------------------


class FlopsProfiler:
    """DeepSpeed's profiler object: ``start_profile()``, run forwards, read the totals or
    ``print_model_profile()``, ``end_profile()``. Counting and timing happen in the same
    passes here, so the latencies include the counting's cost (``get_model_profile`` and the
    engine's ds_config profiler time a pass of their own)."""

    def __init__(self, model: torch.nn.Module, ds_engine=None, recompute_fwd_factor: float = 0.0):
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.profile: ModelProfile | None = None
        self._hooks: _Hooks | None = None
        self.started = False

    def start_profile(self, ignore_list: Iterable[type] | None = None) -> None:
        """Count and time every forward of the model from now on (afresh)."""
        self.stop_profile()
        self.profile = ModelProfile(self.model)
        self._hooks = _Hooks(
            self.model, self.profile, count=True, timed=True, ignore=ignore_list or ()
        )
        self.started = True

    def stop_profile(self) -> None:
        """Stop recording; what was recorded stays readable."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

    def reset_profile(self) -> None:
        """Forget what was recorded; recording goes on if started."""
        if self.profile is not None:
            self.profile.own_flops.clear()
            self.profile.duration.clear()

    def end_profile(self) -> None:
        """Stop recording and forget it."""
        self.stop_profile()
        self.profile = None
        self.started = False

    def _profile(self) -> ModelProfile:
        if self.profile is None:
            raise RuntimeError("the flops profiler has not been started: call start_profile()")
        return self.profile

    def get_total_flops(self, as_string: bool = False):
        flops = self._profile().flops(self.model)
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False):
        macs = self._profile().macs(self.model)
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False):
        duration = self._profile().latency(self.model)
        return duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False):
        params = param_count(self.model)
        return params_to_string(params) if as_string else params

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """Print (or write to ``output_file``) the profile of the forwards recorded so far."""
        if self.profile is None:
            return
        text = model_report(
            self.profile,
            profile_step=profile_step,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            recompute_fwd_factor=self.recompute_fwd_factor,
        )
        write_report(text, output_file)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        if self.profile is not None:
            print(aggregated_report(self.profile, module_depth, top_modules), flush=True)


def get_model_profile(
    model: torch.nn.Module,
    input_shape: tuple | None = None,
    args: list | None = None,
    kwargs: dict | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Iterable[type] | None = None,
    mode: str = "forward",
):
    """Profile one forward of ``model`` (``model(*args, **kwargs)``, or ``model.generate``
    with ``mode="generate"``; with ``input_shape``, one input of that shape in the model's
    dtype and device): ``warm_up`` passes, one timed pass, one counted pass. Returns
    ``(flops, macs, params)``, as strings unless ``as_string`` is false."""
    if mode not in ("forward", "generate"):
        raise ValueError(f"mode={mode!r}: use 'forward' or 'generate'")
    args = list(args or [])
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if args or kwargs:
            raise ValueError("get_model_profile(): give input_shape or args/kwargs, not both")
        first = next(model.parameters())
        args = [torch.ones((), dtype=first.dtype, device=first.device).new_empty(input_shape)]
    run = model.generate if mode == "generate" else model
    ignore = tuple(ignore_modules or ())
    for _ in range(warm_up):
        run(*args, **kwargs)
    profile = ModelProfile(model)
    with recording(model, profile, count=False, timed=True, ignore=ignore):
        run(*args, **kwargs)
    counted = ModelProfile(model)
    with recording(model, counted, count=True, timed=False, ignore=ignore):
        run(*args, **kwargs)
    profile.own_flops = counted.own_flops
    if print_profile:
        text = model_report(
            profile, module_depth=module_depth, top_modules=top_modules, detailed=detailed
        )
        write_report(text, output_file)
    flops, macs, params = profile.flops(model), profile.macs(model), param_count(model)
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
