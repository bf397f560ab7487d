"""ZeRO stage 3 through the engine: what initialize shards, when units are gathered and released,
the recorded-order prefetch and its limits, more units than the pool of gradient bucket
buffers, ``GatheredParameters``, ``save_16bit_model``,
``empty_partition_cache``, memory and bytes on the wire against the formulas, and the error when
ranks disagree on the module order. Parity on ``TiedMLP`` is in ``test_parity.py``; here a model
that calls a module twice, shares a weight between two modules and skips modules is checked
against one process.

Unit sizes below: ``Linear(32, 32)`` is 1056 elements, ``Linear(128, 128)`` 16512 (a multiple of
4, so no unit carries padding at 2 or 4 ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zerolap
import zerolap.comm as dist
from tests.logs import captured_logs
from zerolap.zero import GatheredParameters, ParamStatus

TIMEOUT = 60.0
UNIT = 32 * 32 + 32  # elements of one Linear(32, 32)


def chain(layers: int = 4, width: int = 32, seed: int = 0) -> torch.nn.Sequential:
    """``layers`` Linear(width, width) with tanh between: one sharded unit each."""
    torch.manual_seed(seed)
    modules: list[torch.nn.Module] = []
    for _ in range(layers):
        modules += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*modules)


def config(*, lr: float = 1e-3, bf16: bool = False, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,  # the references do not clip
        "optimizer": {"type": "AdamW", "params": {"lr": lr}},
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


def local_batch(step: int, width: int = 32, micro: int = 4) -> torch.Tensor:
    """This rank's block of the global batch of ``step``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(micro * world, width, generator=torch.Generator().manual_seed(step))
    return x[rank * micro : (rank + 1) * micro]


def train_step(engine, step: int, width: int = 32) -> float:
    x = local_batch(step, width).to(engine.param_store.dtype)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def gathered(params) -> list[torch.Tensor]:
    params = list(params)
    with GatheredParameters(params):
        return [p.detach().clone() for p in params]


def max_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))


def sharded_params(engine) -> list[torch.nn.Parameter]:
    store = engine.param_store
    return [p for p in store.params if not store.persistent[store.unit_of[id(p)]]]


# -- what initialize shards ------------------------------------------------------------------


def head_model(seed: int) -> torch.nn.Sequential:
    """Units of 1056 (Linear 32x32), 64 (LayerNorm) and 99 (Linear 32x3) elements."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 3)
    )


def check_initialize_shards(threshold: int, bf16: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = head_model(seed=0)
    model = head_model(seed=rank)  # rank 0's weights must win
    engine, *_ = zerolap.initialize(
        model=model,
        config=config(bf16=bf16, stage3_param_persistence_threshold=threshold),
    )
    dtype = torch.bfloat16 if bf16 else torch.float32
    store = engine.param_store
    persistent_names = []
    for (name, param), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert param.ds_shape == tuple(want.shape) and param.ds_numel == want.numel(), name
        assert param.dtype == dtype, name
        if store.persistent[store.unit_of[id(param)]]:
            persistent_names.append(name)
            assert param.ds_status == ParamStatus.AVAILABLE, name
            assert torch.equal(param.data, want.detach().to(dtype)), name
        else:
            assert param.ds_status == ParamStatus.SHARDED, name
            assert param.data.numel() == 0, name
    # This rank's chunk of every unit (each padded to a multiple of N), and persistent units
    # whole besides.
    units, persistent = engine.units.groups, engine.units.persistent
    assert store.shard.numel() == sum(-(-sum(g) // world) for g in units)
    whole = sum(b.numel for b, keep in zip(engine.layout.buckets, persistent, strict=True) if keep)
    assert store.live_numel() == 0
    assert store.nbytes() == (store.shard.numel() + whole) * (2 if bf16 else 4)
    # fp32 master shard only under bf16, the size of the shard.
    master = engine.optimizer.master
    if bf16:
        assert master.dtype == torch.float32 and master.numel() == store.shard.numel()
    else:
        assert master is None
    # Gathered values are rank 0's initial weights.
    for got, want in zip(gathered(model.parameters()), reference.parameters(), strict=True):
        assert torch.equal(got, want.detach().to(dtype))
    train_step(engine, 0)
    state_numel = sum(
        t.numel() for s in engine.optimizer.state.values() for t in s.values() if t.dim() > 0
    )
    return {
        "persistent": persistent_names,
        "state_numel": state_numel,
        "shard_numel": store.shard.numel(),
    }


@pytest.mark.parametrize(
    ("threshold", "bf16", "persistent"),
    [
        (0, False, []),
        # The per-module rule: Linear(32, 3) has 99 elements, so 99 shards it and 100 keeps it.
        (99, False, ["1.weight", "1.bias"]),
        (100, True, ["1.weight", "1.bias", "2.weight", "2.bias"]),
    ],
)
def test_initialize_shards_modules_above_the_persistence_threshold(
    ranks, threshold, bf16, persistent
):
    results = ranks(2).run(check_initialize_shards, threshold, bf16, timeout=TIMEOUT)
    for result in results:
        assert result["persistent"] == persistent
    # The ranks' optimizer states (exp_avg, exp_avg_sq) cover every element exactly once.
    total = sum(p.numel() for p in head_model(0).parameters())
    assert sum(r["state_numel"] for r in results) == 2 * total
    for result in results:
        assert result["state_numel"] <= 2 * result["shard_numel"]


# -- gather before use, release after ----------------------------------------------------------


def check_gather_release_cycle(reduce_bucket_size: int) -> dict:
    model = chain(layers=3)
    zero = dict(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    engine, *_ = zerolap.initialize(
        model=model, config=config(reduce_bucket_size=reduce_bucket_size, **zero)
    )
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    events = []

    def state(module) -> tuple[str, int]:
        return module.weight.ds_status.name, module.weight.data.numel()

    for i, layer in enumerate(linears):
        # Registered after the engine's hooks: they see what the engine's hooks left.
        layer.register_forward_pre_hook(lambda m, a, i=i: events.append(("pre", i, *state(m))))
        layer.register_forward_hook(lambda m, a, o, i=i: events.append(("post", i, *state(m))))
        layer.weight.register_hook(
            lambda g, i=i, m=layer: events.append(("grad", i, *state(m))) or None
        )
    dist.configure(enabled=True)
    dist.reset_log()
    try:
        out = engine(local_batch(0)).pow(2).mean()
        after_forward = engine.param_store.live_numel()
        engine.backward(out)
        ops = [r.op for r in dist.COMMS_LOGGER.records]
    finally:
        dist.configure(enabled=False)
        dist.reset_log()
    statuses = {p.ds_status for p in model.parameters()}
    result = {
        "events": events,
        "after_forward": after_forward,
        "after_backward": engine.param_store.live_numel(),
        "statuses": statuses,
        "data_numel": sum(p.data.numel() for p in model.parameters()),
        "grads": [p.grad for p in model.parameters()],
        "grads_bytes": engine.grads.nbytes(),
        "shard_bytes": engine.param_store.shard.numel() * 4,
        "gathers": ops.count("ring_all_gather"),
        "reduce_scatters": ops.count("ring_reduce_scatter"),
    }
    engine.step()
    return result


@pytest.mark.parametrize(
    "reduce_bucket_size, reduce_scatters",
    [(int(5e8), 1), (2 * 1056, 2), (1056, 3), (0, 3)],
    ids=["default", "2 units", "1 unit", "0"],
)
def test_forward_and_backward_gather_and_release(ranks, reduce_bucket_size, reduce_scatters):
    full = 32 * 32
    runs = ranks(2).run(check_gather_release_cycle, reduce_bucket_size, timeout=TIMEOUT)
    for result in runs:
        forward = [e for e in result["events"] if e[0] != "grad"]
        assert forward == [
            e for i in range(3) for e in (("pre", i, "AVAILABLE", full), ("post", i, "SHARDED", 0))
        ]
        # Backward: the gradient of each weight is computed while its unit is whole again.
        backward = [e for e in result["events"] if e[0] == "grad"]
        assert backward == [("grad", i, "AVAILABLE", full) for i in (2, 1, 0)]
        assert result["after_forward"] == 0 and result["after_backward"] == 0
        assert result["statuses"] == {ParamStatus.SHARDED} and result["data_numel"] == 0
        assert result["grads"] == [None] * 6  # only this rank's gradient shard exists
        assert result["grads_bytes"] == result["shard_bytes"]
        # One all-gather per unit (32 x 32 + 32 elements) in forward and again in backward;
        # one reduce-scatter per run of consecutive units up to reduce_bucket_size elements.
        assert (result["gathers"], result["reduce_scatters"]) == (6, reduce_scatters)


# -- prefetch ----------------------------------------------------------------------------------


def run_steps_with_stats(zero: dict, steps: int = 3) -> list[dict]:
    """Per step, the increase of each fetch counter."""
    engine, *_ = zerolap.initialize(model=chain(layers=4), config=config(**zero))
    previous = {k: 0 for k in engine.fetch_stats()}
    deltas = []
    for step in range(steps):
        train_step(engine, step)
        stats = engine.fetch_stats()
        deltas.append(
            {
                k: stats[k] - previous[k]
                for k in ("fetches", "prefetched", "on_demand", "trace_misses")
            }
        )
        previous = stats
    return deltas


def _stats(fetches, prefetched, on_demand) -> dict:
    return {"fetches": fetches, "prefetched": prefetched, "on_demand": on_demand, "trace_misses": 0}


# Four units; a step fetches each in forward and again in backward (8 fetches). The first step
# records the order and gathers everything on demand; a unit still gathered when it is needed
# again (kept by max_reuse_distance) is neither prefetched nor gathered on demand.
PREFETCH_CASES = {
    # Default: every forward fetch was prefetched, every backward fetch kept.
    "default": ({}, _stats(8, 4, 0)),
    # Nothing kept: every fetch prefetched but the last module's, released after its forward
    # and needed at once by backward.
    "reuse 0": ({"stage3_max_reuse_distance": 0}, _stats(8, 7, 1)),
    "prefetch off": ({"stage3_prefetch_bucket_size": 0}, _stats(8, 0, 4)),
    "prefetch off, reuse 0": (
        {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0},
        _stats(8, 0, 8),
    ),
    # A prefetch bucket smaller than a unit still prefetches the next unit, one at a time.
    "bucket one short": ({"stage3_prefetch_bucket_size": UNIT - 1}, _stats(8, 4, 0)),
    "bucket one unit": ({"stage3_prefetch_bucket_size": UNIT}, _stats(8, 4, 0)),
}


@pytest.mark.parametrize("case", list(PREFETCH_CASES))
def test_prefetch_follows_the_recorded_order(ranks, case):
    zero, later = PREFETCH_CASES[case]
    for deltas in ranks(2).run(run_steps_with_stats, zero, timeout=TIMEOUT):
        assert deltas[0] == _stats(8, 0, 8), deltas
        assert deltas[1:] == [later, later], deltas


class SplitInTwo(torch.nn.Module):
    """One unit whose forward returns two tensors, each needing a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32, 64) * 0.1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x @ self.weight).chunk(2, dim=-1)


class TwoOutputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.split, self.last = (
            torch.nn.Linear(32, 32),
            SplitInTwo(),
            torch.nn.Linear(32, 32),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.split(torch.tanh(self.first(x)))
        return self.last(a * torch.tanh(b))


def fetches_per_step_with_two_outputs() -> list[int]:
    engine, *_ = zerolap.initialize(model=TwoOutputs(), config=config(stage3_max_reuse_distance=0))
    counts, before = [], 0
    for step in range(3):
        train_step(engine, step)
        counts.append(engine.fetch_stats()["fetches"] - before)
        before += counts[-1]
    assert engine.fetch_stats()["trace_misses"] == 0
    return counts


def test_a_module_with_two_outputs_is_fetched_once_for_its_backward(ranks):
    """Both outputs' gradients reach the module's backward; its unit is fetched at the first
    (three units: three fetches in forward, three in backward)."""
    assert ranks(2).run(fetches_per_step_with_two_outputs, timeout=TIMEOUT) == [[6, 6, 6]] * 2


def check_prefetch_at_the_end_of_step(zero: dict) -> list[str]:
    """Per step, the status of the record's first unit between step() and the next forward."""
    engine, *_ = zerolap.initialize(model=chain(layers=4), config=config(**zero))
    seen = []
    for step in range(3):
        train_step(engine, step)
        first = next(engine.fetcher.trace.next_step())
        seen.append(engine.param_store.status[first].name)
    return seen


@pytest.mark.parametrize(
    ("zero", "status"),
    [({}, {"GATHERING", "AVAILABLE"}), ({"stage3_prefetch_bucket_size": 0}, {"SHARDED"})],
)
def test_next_step_prefetched_when_step_ends(ranks, zero, status):
    """The next step's first units start gathering in step(), not at the next forward."""
    for seen in ranks(2).run(check_prefetch_at_the_end_of_step, zero, timeout=TIMEOUT):
        assert set(seen) <= status, seen


def check_live_cap(zero: dict) -> tuple[int, int]:
    """The most elements ever gathered at once, recorded at every launch, over 3 steps."""
    engine, *_ = zerolap.initialize(model=chain(layers=4), config=config(**zero))
    store = engine.param_store
    peaks = []
    launch = store.launch

    def recording_launch(unit: int) -> None:
        launch(unit)
        peaks.append(store.live_numel())

    store.launch = recording_launch
    for step in range(3):
        train_step(engine, step)
    return max(peaks), max(store.numel)


@pytest.mark.parametrize(
    "zero",
    [
        {"stage3_max_live_parameters": 2 * UNIT + 50},
        {"stage3_max_live_parameters": 2 * UNIT + 50, "stage3_max_reuse_distance": 0},
        {"stage3_max_live_parameters": 0},
    ],
    ids=["cap 2 units", "cap 2 units, reuse 0", "cap 0"],
)
def test_max_live_parameters_caps_what_is_gathered(ranks, zero):
    cap = zero["stage3_max_live_parameters"]
    for peak, largest in ranks(2).run(check_live_cap, zero, timeout=TIMEOUT):
        assert peak <= max(cap, largest), f"{peak} elements gathered at once, cap {cap}"


# -- a module order that changes -----------------------------------------------------------


class Branchy(torch.nn.Module):
    """Three layers, and a branch some steps take; ``generate`` calls forward repeatedly."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.branch = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, take_branch: bool = False) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        if take_branch:
            h = h + torch.tanh(self.branch(h))
        return self.c(h)

    def generate(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            x = torch.tanh(self(x))
        return x


# (kind, argument) per step of the changing-order test.
BRANCHY_SCRIPT = [
    ("train", False),  # recorded
    ("train", False),  # prefetched
    ("train", True),  # branch: off trace, the first (and only) warning
    ("train", False),  # off the branch step's record
    ("eval", 3),  # three eval forwards through the engine: prefixes of the record
    ("train", False),  # on trace again
    # engine.module.generate: three forwards with no engine.forward before them, so they extend
    # the previous step past its record (off trace)
    ("generate", 3),
    ("train", False),  # a prefix of the new record (that step and the generation): on trace
    ("train", False),
]


def branchy_batch(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step))


def zero_grads(model: torch.nn.Module) -> None:
    """Gradients that exist from the start: the engine steps every parameter, used or not (its
    flat buffers give unused ones zeros), where torch's AdamW skips a parameter with no grad."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)


def branchy_reference() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Parameters at the end and every eval/generate output, in one process."""
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    zero_grads(model)
    outputs = []
    for step, (kind, arg) in enumerate(BRANCHY_SCRIPT):
        x = branchy_batch(step)
        if kind == "train":
            opt.zero_grad(set_to_none=False)
            model(x, take_branch=arg).pow(2).mean().backward()
            opt.step()
        else:
            with torch.no_grad():
                for _ in range(arg if kind == "eval" else 1):
                    outputs.append(model(x) if kind == "eval" else model.generate(x, arg))
    return [p.detach().clone() for p in model.parameters()], outputs


def check_changing_order() -> dict:
    rank = dist.get_rank()
    cfg = config(lr=0.05, stage3_prefetch_bucket_size=300)  # one unit (272) ahead
    cfg["optimizer"]["params"]["weight_decay"] = 0.01
    engine, *_ = zerolap.initialize(model=Branchy(), config=cfg)
    outputs, misses = [], []
    with captured_logs() as caught:
        for step, (kind, arg) in enumerate(BRANCHY_SCRIPT):
            x = branchy_batch(step)
            if kind == "train":
                engine.train()
                mine = x[rank * 4 : rank * 4 + 4]
                engine.backward(engine(mine, take_branch=arg).pow(2).mean())
                engine.step()
            elif kind == "eval":
                engine.eval()
                with torch.no_grad():
                    outputs += [engine(x) for _ in range(arg)]
            else:
                engine.eval()
                with torch.no_grad():
                    outputs.append(engine.module.generate(x, arg))
            misses.append(engine.fetch_stats()["trace_misses"])
    reference_params, reference_outputs = branchy_reference()
    params = gathered(engine.module.parameters())
    return {
        "warnings": [w for w in caught if w.startswith("WARNING")],
        "misses": misses,
        "params": max_diff(params, reference_params),
        "outputs": max_diff(outputs, reference_outputs),
        "n_outputs": (len(outputs), len(reference_outputs)),
    }


def test_changing_module_order_falls_back_to_on_demand(ranks):
    for result in ranks(2).run(check_changing_order, timeout=TIMEOUT):
        assert len(result["warnings"]) == 1, result["warnings"]
        assert "different order from the recorded step" in result["warnings"][0]
        assert "'branch'" in result["warnings"][0]
        assert result["misses"] == [0, 0, 1, 2, 2, 2, 3, 3, 3]
        assert result["n_outputs"] == (4, 4)
        assert result["outputs"] < 1e-5 and result["params"] < 1e-5, result


def chain_against_one_process(overlap: bool) -> float:
    """Six sharded units, more than the pool of four bucket buffers, trained 3 steps with or
    without ``overlap_comm``: the largest difference from one process on the global batch."""
    cfg = config(lr=0.05, overlap_comm=overlap)
    cfg["optimizer"]["params"]["weight_decay"] = 0.01  # torch's AdamW's default
    engine, *_ = zerolap.initialize(model=chain(layers=6), config=cfg)
    reference = chain(layers=6)
    opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    world = dist.get_world_size()
    for step in range(3):
        train_step(engine, step)
        opt.zero_grad()
        x = torch.randn(4 * world, 32, generator=torch.Generator().manual_seed(step))
        reference(x).pow(2).mean().backward()
        opt.step()
    return max_diff(gathered(engine.module.parameters()), list(reference.parameters()))


@pytest.mark.parametrize("overlap", [True, False])
def test_more_units_than_bucket_buffers_train_as_one_process(ranks, overlap):
    """Without ``overlap_comm`` a bucket that needs a buffer when the pool is used up reduces
    the ready ones first: a unit whose gradients were held (written together when its last one
    comes) is written before it is ready, so it never goes out as zeros."""
    assert (
        ranks(2).run(chain_against_one_process, overlap, timeout=TIMEOUT)
        == [pytest.approx(0.0, abs=1e-5)] * 2
    )


def with_layer_norms() -> torch.nn.Sequential:
    """Three sharded Linears, each followed by a persistent LayerNorm (64 elements, under the
    threshold of 100): three persistent units, each a bucket of its own."""
    torch.manual_seed(0)
    layers = [(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Tanh()) for _ in range(3)]
    return torch.nn.Sequential(*[m for layer in layers for m in layer])


def gathers_in_step(swap_dir: str | None) -> tuple[int, list[str], float]:
    """The persistent units, the collectives the third ``step()`` ran, and the largest
    difference from one process on the global batch after it; with ``swap_dir``, every
    sharded unit's chunk swapped to disk there (``offload_param: nvme``)."""
    swap = {"device": "nvme", "nvme_path": swap_dir, "max_in_cpu": 0} if swap_dir else None
    cfg = config(lr=0.05, stage3_param_persistence_threshold=100, offload_param=swap)
    cfg["optimizer"]["params"]["weight_decay"] = 0.01  # torch's AdamW's default
    engine, *_ = zerolap.initialize(model=with_layer_norms(), config=cfg)
    store = engine.param_store
    persistent = sum(store.persistent[: store.trainable_buckets])
    reference = with_layer_norms()
    opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for step in range(3):
        engine.backward(engine(local_batch(step)).pow(2).mean())
        dist.configure(enabled=step == 2)  # the first steps record what the next prefetches
        dist.reset_log()
        try:
            engine.step()
            ops = [r.op for r in dist.COMMS_LOGGER.records]
        finally:
            dist.configure(enabled=False)
            dist.reset_log()
        opt.zero_grad()
        x = torch.randn(
            4 * dist.get_world_size(), 32, generator=torch.Generator().manual_seed(step)
        )
        reference(x).pow(2).mean().backward()
        opt.step()
    diff = max_diff(gathered(engine.module.parameters()), list(reference.parameters()))
    return persistent, ops, diff


@pytest.mark.parametrize("swapped", [False, True], ids=["in memory", "sharded units on nvme"])
def test_step_gathers_the_persistent_units_in_one_collective(ranks, tmp_path, swapped):
    """After the optimizer step the persistent units (small modules kept whole, updated shard
    by shard) are all-gathered again, all three in one collective, each to its own values (the
    parameters equal one process's); the other gathers are the next step's prefetch of the
    three sharded units (and the all-reduce, the gradient norm's). Persistent units are never
    swapped, so with the sharded units' chunks on disk it is the same."""
    swap_dir = str(tmp_path) if swapped else None
    for persistent, ops, diff in ranks(2).run(gathers_in_step, swap_dir, timeout=TIMEOUT):
        assert persistent == 3
        expected = ["all_gather_coalesced", "all_reduce"] + ["ring_all_gather"] * 3
        assert sorted(ops) == expected, ops
        assert diff < 1e-5


def misses_after_evaluating_first() -> tuple[int, list[str]]:
    """An evaluation through the engine before the first training step: its forward-only step
    is the first record, which the training step after it goes on past."""
    engine, *_ = zerolap.initialize(model=chain(layers=4), config=config())
    with captured_logs() as caught:
        engine.eval()
        with torch.no_grad():
            engine(local_batch(0))
        engine.train()
        for step in range(3):
            train_step(engine, step)
    return engine.fetch_stats()["trace_misses"], [w for w in caught if w.startswith("WARNING")]


def test_a_training_step_extends_a_record_an_evaluation_made(ranks):
    for misses, warnings in ranks(2).run(misses_after_evaluating_first, timeout=TIMEOUT):
        assert (misses, warnings) == (0, [])


def gathers_per_step_around_a_generation_loop() -> list[int]:
    """All-gathers per training step; between the third and fourth step, a generation loop
    calls the model directly (``engine.module.generate``, as one calls a Hugging Face model's
    ``generate``), so its forwards land in the step that has just finished."""
    rank = dist.get_rank()
    engine, *_ = zerolap.initialize(model=Branchy(), config=config(lr=0.05))
    counts = []
    with captured_logs():  # the generation leaves the record: its warning is not shown
        for step in range(7):
            x = branchy_batch(step)
            dist.configure(enabled=True)
            dist.reset_log()
            try:
                engine.backward(engine(x[rank * 4 : rank * 4 + 4]).pow(2).mean())
                engine.step()
                counts.append([r.op for r in dist.COMMS_LOGGER.records].count("ring_all_gather"))
            finally:
                dist.configure(enabled=False)
                dist.reset_log()
            if step == 2:
                with torch.no_grad():
                    engine.module.generate(x, 3)
    return counts


def test_training_after_a_generation_loop_gathers_as_before(ranks):
    """Three units (the branch is not taken): the first step gathers each in forward and in
    backward, later steps only in forward (kept for backward), each gathered by the step()
    before (which prefetches the next step's first units: 6 + 3 in the first step). The
    generation's forwards must not stay in the record: once training steps follow again, they
    gather as before it."""
    for counts in ranks(2).run(gathers_per_step_around_a_generation_loop, timeout=TIMEOUT):
        assert counts[:3] == [9, 3, 3], counts
        assert counts[-2:] == [3, 3], (
            f"all-gathers per step {counts}: the record kept the generation"
        )


def check_different_modules_in_the_first_step(case: str) -> str:
    """Two units of the same size run in opposite orders on the two ranks (their gathers would
    pair up, on wrong values), or a module runs on rank 1 only (its gather would pair with
    another collective): the first forward names the difference on every rank."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 8), "b": torch.nn.Linear(8, 8)})
    if case == "order":
        order = ["a", "b"] if dist.get_rank() == 0 else ["b", "a"]
    elif case == "one rank only":
        order = ["a"] if dist.get_rank() == 0 else ["b", "a"]
    else:  # one more at the end, on rank 1: met by rank 0's end of the step
        order = ["a"] if dist.get_rank() == 0 else ["a", "b"]

    def run(x):
        for name in order:
            x = model[name](x)
        return x

    model.forward = run
    engine, *_ = zerolap.initialize(model=model, config=config())
    different = pytest.raises(RuntimeError, match="ran different modules in the first step")
    with different as error, torch.no_grad():
        engine(torch.randn(4, 8))
        engine(torch.randn(4, 8))  # the first step, forward only, ends here
    dist.barrier()  # the group is still usable
    return str(error.value)


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("order", "fetch #0, rank 0 'a', rank 1 'b'"),
        ("one rank only", "fetch #0, rank 0 'a', rank 1 'b'"),
        ("one more", "fetch #1, rank 0 at the end of its step, rank 1 'b'"),
    ],
)
def test_different_modules_across_ranks_raise_at_the_first_fetch(ranks, case, named):
    for message in ranks(2).run(check_different_modules_in_the_first_step, case, timeout=TIMEOUT):
        assert named in message, message


# -- GatheredParameters --------------------------------------------------------------------


def check_gathered_parameters() -> dict:
    rank = dist.get_rank()
    model = chain(layers=2)
    reference = chain(layers=2)
    engine, *_ = zerolap.initialize(model=model, config=config(lr=0.05))
    first = model[0]
    # Without modifier_rank: whole inside, sharded again after, changes dropped.
    with GatheredParameters(list(first.parameters())) as params:
        inside = [(p.ds_status, tuple(p.shape)) for p in params]
        equal_inside = torch.equal(first.weight, reference[0].weight)
        with torch.no_grad():
            first.weight.fill_(7.0)
    after = [(p.ds_status, p.data.numel()) for p in first.parameters()]
    dropped = torch.equal(gathered([first.weight])[0], reference[0].weight)
    # With modifier_rank=1: rank 1's values are kept on every rank.
    with GatheredParameters([first.weight], modifier_rank=1), torch.no_grad():
        first.weight.fill_(rank + 1.0)
    kept = gathered([first.weight])[0]
    # Training continues from the modified values.
    with torch.no_grad():
        reference[0].weight.fill_(2.0)
    opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.0)
    for step in range(2):
        train_step(engine, step)
        opt.zero_grad()
        x = torch.randn(
            4 * dist.get_world_size(), 32, generator=torch.Generator().manual_seed(step)
        )
        reference(x).pow(2).mean().backward()
        opt.step()
    diff = max_diff(gathered(model.parameters()), list(reference.parameters()))
    return {
        "inside": inside,
        "equal_inside": equal_inside,
        "after": after,
        "dropped": dropped,
        "kept": kept.unique().tolist(),
        "diff": diff,
    }


def test_gathered_parameters_gathers_reshards_and_keeps_the_modifier(ranks):
    for result in ranks(2).run(check_gathered_parameters, timeout=TIMEOUT):
        assert result["inside"] == [
            (ParamStatus.AVAILABLE, (32, 32)),
            (ParamStatus.AVAILABLE, (32,)),
        ]
        assert result["equal_inside"]
        assert result["after"] == [(ParamStatus.SHARDED, 0)] * 2
        assert result["dropped"], "a change made without modifier_rank must not survive"
        assert result["kept"] == [2.0]
        assert result["diff"] < 1e-5


def check_modifier_updates_the_bf16_master() -> dict:
    model = chain(layers=2)
    engine, *_ = zerolap.initialize(model=model, config=config(lr=1e-3, bf16=True))
    with GatheredParameters([model[0].weight], modifier_rank=0), torch.no_grad():
        model[0].weight.fill_(0.5 if dist.get_rank() == 0 else -3.0)
    store, optimizer = engine.param_store, engine.optimizer
    master_follows = all(
        torch.equal(
            optimizer.master[pos : pos + run.end - run.start],
            store.owned_view(run, pos).float(),
        )
        for run, pos in zip(optimizer.runs, optimizer.positions, strict=True)
    )
    train_step(engine, 0)
    weight = gathered([model[0].weight])[0].float()
    return {"master_follows": master_follows, "drift": (weight - 0.5).abs().max().item()}


def test_gathered_parameters_modifier_reaches_the_bf16_master(ranks):
    for result in ranks(2).run(check_modifier_updates_the_bf16_master, timeout=TIMEOUT):
        assert result["master_follows"]
        # One AdamW step of lr 1e-3 from 0.5 (plus bf16 rounding); the old weights are ~0.1.
        assert result["drift"] < 0.01


# -- save_16bit_model, empty_partition_cache ------------------------------------------------


class WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = chain(layers=2)
        self.norm = torch.nn.LayerNorm(32)  # persistent at threshold 100
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.body(x)) * self.scale


def check_save_16bit_model(save_dir: str, flag: bool, bf16: bool) -> dict:
    zero = {"stage3_param_persistence_threshold": 100}
    if flag:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = zerolap.initialize(model=WithBuffer(), config=config(bf16=bf16, **zero))
    train_step(engine, 0)
    with captured_logs() as caught:
        saved = engine.save_16bit_model(save_dir, save_filename="model.bin")
    names = [name for name, _ in engine.module.named_parameters()]
    expected = dict(zip(names, gathered(engine.module.parameters()), strict=True))
    result = {
        "saved": saved,
        "warnings": caught,
        "live": engine.param_store.live_numel(),
        "exists": (Path(save_dir) / "model.bin").exists(),
    }
    if saved and dist.get_rank() == 0:
        state = torch.load(Path(save_dir) / "model.bin", weights_only=True)
        plain = WithBuffer()
        plain.load_state_dict(state, strict=True)
        result["keys"] = list(state)
        result["dtypes"] = {k: v.dtype for k, v in state.items()}
        result["equal"] = all(torch.equal(state[k], v) for k, v in expected.items())
        # Buffers keep their dtype under bf16, as in DeepSpeed 0.19.8.
        result["buffer"] = torch.equal(state["scale"], torch.linspace(0.5, 1.5, 32))
    dist.barrier()
    return result


@pytest.mark.parametrize("bf16", [False, True])
def test_save_16bit_model_writes_the_whole_state_dict_on_rank_0(ranks, tmp_path, bf16):
    results = ranks(2).run(check_save_16bit_model, str(tmp_path), True, bf16, timeout=TIMEOUT)
    first = results[0]
    assert first["saved"] and first["exists"] and first["equal"] and first["buffer"]
    assert first["keys"] == list(WithBuffer().state_dict())
    dtype = torch.bfloat16 if bf16 else torch.float32
    assert {v for k, v in first["dtypes"].items() if k != "scale"} == {dtype}
    assert first["dtypes"]["scale"] == torch.float32
    assert all(r["live"] == 0 for r in results), "saving left parameters gathered"
    assert results[1]["saved"] and "keys" not in results[1]
    assert all(r["warnings"] == [] for r in results)


def test_save_16bit_model_needs_the_gather_flag_at_stage_3(ranks, tmp_path):
    results = ranks(2).run(check_save_16bit_model, str(tmp_path), False, False, timeout=TIMEOUT)
    assert [r["saved"] for r in results] == [False, False]
    assert not any(r["exists"] for r in results)
    assert len(results[0]["warnings"]) == 1
    assert "stage3_gather_16bit_weights_on_model_save" in results[0]["warnings"][0]
    assert results[1]["warnings"] == []  # rank 0 speaks for all


def check_empty_partition_cache() -> dict:
    engine, *_ = zerolap.initialize(model=chain(layers=4), config=config())
    for step in range(2):
        train_step(engine, step)
    engine.eval()
    with torch.no_grad():
        out = engine(local_batch(9))  # forward only: units stay kept for a backward to come
    live_before = engine.param_store.live_numel()
    engine.empty_partition_cache()
    result = {
        "live_before": live_before,
        "live_after": engine.param_store.live_numel(),
        "statuses": {p.ds_status for p in sharded_params(engine)},
        "data_numel": sum(p.data.numel() for p in sharded_params(engine)),
        "full_bytes": sum(f.untyped_storage().nbytes() for f in engine.param_store.full),
    }
    with torch.no_grad():
        result["diff"] = (engine(local_batch(9)) - out).abs().max().item()  # gathered again
    return result


def test_empty_partition_cache_frees_everything_gathered(ranks):
    for result in ranks(2).run(check_empty_partition_cache, timeout=TIMEOUT):
        assert result["live_before"] > 0, "nothing was gathered: the test would prove nothing"
        assert result["live_after"] == 0 and result["full_bytes"] == 0
        assert result["statuses"] == {ParamStatus.SHARDED} and result["data_numel"] == 0
        assert result["diff"] == 0.0


# -- tricky models: parity with one process --------------------------------------------------


class Reuse(torch.nn.Module):
    """A module called twice per step, a weight shared by two modules (each with its own bias),
    a module used on even steps only, one never used, and a buffer."""

    def __init__(self, vocab: int = 11, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width)
        self.twice = torch.nn.Linear(width, width)
        self.up = torch.nn.Linear(width, width)
        self.down = torch.nn.Linear(width, width)
        self.down.weight = self.up.weight  # shared by two modules
        self.even = torch.nn.Linear(width, width)
        self.never = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, width))

    def forward(self, tokens: torch.Tensor, even: bool) -> torch.Tensor:
        h = self.embed(tokens) * self.gain
        h = torch.tanh(self.twice(h))
        h = torch.tanh(self.up(h))
        if even:
            h = h + torch.tanh(self.even(h))
        h = torch.tanh(self.twice(h))  # second call, after other modules ran
        h = self.down(h)
        return self.head(self.norm(h))


def reuse_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 11, (size, 5), generator=g)
    return tokens, torch.roll(tokens, 1, dims=1)


def reuse_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))


def check_reuse_parity(threshold: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Reuse()
    with torch.no_grad():
        model.gain.add_(rank)  # rank 0's buffer must win
    cfg = config(lr=0.05, stage3_param_persistence_threshold=threshold)
    cfg["train_micro_batch_size_per_gpu"] = 2
    cfg["optimizer"]["params"]["weight_decay"] = 0.01
    engine, *_ = zerolap.initialize(model=model, config=cfg)
    reference = Reuse()
    opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.01)
    zero_grads(reference)
    for step in range(4):
        tokens, targets = reuse_batch(step, 2 * world)
        mine = slice(2 * rank, 2 * rank + 2)
        engine.backward(reuse_loss(engine(tokens[mine], even=step % 2 == 0), targets[mine]))
        engine.step()
        opt.zero_grad(set_to_none=False)
        reuse_loss(reference(tokens, even=step % 2 == 0), targets).backward()
        opt.step()
    assert torch.equal(model.gain, reference.gain)
    assert model.down.weight is model.up.weight
    got = gathered(engine.module.parameters())
    return max_diff(got, list(reference.parameters()))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("threshold", [0, 100])
def test_parity_with_reused_shared_and_unused_modules(ranks, world_size, threshold):
    for worst in ranks(world_size).run(check_reuse_parity, threshold, timeout=TIMEOUT):
        assert worst < 1e-5


# -- gradients reduced in runs of units -------------------------------------------------------


class OddUnits(torch.nn.Module):
    """Units of 192, 18, 40, 14 and 231 elements: padded at 2 ranks (231) and at 3 (40, 14),
    parameters cut at chunk boundaries, one unit unused (its gradient places are zeros), a
    LayerNorm that persists between them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(32, 7)
        self.norm = torch.nn.LayerNorm(7)
        self.b = torch.nn.Linear(7, 5)
        self.unused = torch.nn.Linear(5, 3)
        self.c = torch.nn.Linear(5, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.norm(self.a(x))).relu())


def check_coalesced_reductions(reduce_bucket_size: int, zero: dict, gas: int) -> dict:
    model = OddUnits()
    engine, *_ = zerolap.initialize(
        model=model,
        config=config(
            stage3_param_persistence_threshold=20, reduce_bucket_size=reduce_bucket_size, **zero
        )
        # Clipped: the norm reads every element of the shard, the padding's too.
        | {"gradient_accumulation_steps": gas, "gradient_clipping": 0.5},
    )
    dist.configure(enabled=True)
    dist.reset_log()
    losses = []
    try:
        for step in range(3 * gas):
            loss = engine(local_batch(step)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        ops = [r.op for r in dist.COMMS_LOGGER.records]
    finally:
        dist.configure(enabled=False)
        dist.reset_log()
    return {
        "losses": losses,
        "params": gathered(model.parameters()),
        "reductions": ops.count("ring_reduce_scatter") // (3 * gas),
    }


@pytest.mark.parametrize(
    "world_size, zero, gas",
    [(2, {}, 1), (3, {}, 1), (3, {"overlap_comm": False}, 1), (3, {}, 2)],
    ids=["2 ranks", "3 ranks", "3 ranks, no overlap", "3 ranks, accumulation"],
)
def test_gradients_reduced_in_runs_of_units_equal_one_collective_per_unit(
    ranks, world_size, zero, gas
):
    """reduce_bucket_size merges consecutive units' reductions into one reduce-scatter, their
    buffer laid out rank by rank: the parameters after three steps are bitwise those of one
    reduce-scatter per unit (each element is summed over the same ring in the same order)."""
    runs = {
        size: ranks(world_size).run(check_coalesced_reductions, size, zero, gas, timeout=TIMEOUT)
        for size in (1, 200, int(5e8))
    }
    for rank in range(world_size):
        alone, some, all_ = (runs[size][rank] for size in (1, 200, int(5e8)))
        # Units of 192, 18, 40, 14 (the LayerNorm, persistent) and 231 elements before padding,
        # in layout order: alone, in runs of at most 200 (192 | 18 40 14 | 231), all together.
        assert (alone["reductions"], some["reductions"], all_["reductions"]) == (5, 3, 1)
        for run in (some, all_):
            assert run["losses"] == alone["losses"]
            for got, want in zip(run["params"], alone["params"], strict=True):
                assert torch.equal(got, want)


# -- memory and wire volume against the formulas -----------------------------------------------


def check_memory(reduce_bucket_size: int) -> list[dict]:
    zero = dict(stage3_max_live_parameters=2 * 16512, reduce_bucket_size=reduce_bucket_size)
    engine, *_ = zerolap.initialize(model=chain(layers=6, width=128), config=config(**zero))
    train_step(engine, 0, width=128)  # optimizer state exists from here on
    rows = []

    def row(when: str) -> dict:
        steps = [t for s in engine.optimizer.state.values() for t in s.values() if t.dim() == 0]
        return engine.memory_breakdown().as_dict() | {
            "when": when,
            "live": engine.param_store.live_numel(),
            "step_counter_bytes": sum(t.numel() * t.element_size() for t in steps),
        }

    engine.backward(engine(local_batch(1, width=128)).pow(2).mean())
    rows.append(row("after backward"))
    engine.step()
    prefetched = engine.param_store.live_numel()  # the next step's first units, in flight
    engine.empty_partition_cache()
    rows.append(row("after step") | {"prefetched": prefetched})
    return rows


@pytest.mark.parametrize("units_per_bucket", [6, 2, 1], ids=lambda k: f"{k} units a bucket")
def test_memory_per_rank_matches_the_stage_3_formula(ranks, units_per_bucket):
    n, unit = 4, 16512
    # Gradients are reduced in runs of units up to reduce_bucket_size (the default, 5e8, puts
    # the six together).
    bucket = units_per_bucket * unit
    size = int(5e8) if units_per_bucket == 6 else bucket
    for rows in ranks(n).run(check_memory, size, timeout=TIMEOUT):
        for row in rows:
            psi = row["numel"]
            assert psi == 6 * unit and row["live"] == 0, row
            # step() starts gathering the next step's first units, within the live cap.
            assert row.get("prefetched", 2 * unit) == 2 * unit, row
            # Nothing else gathered: parameters, gradients and AdamW's two moments are each 1/N
            # (plus AdamW's 0-dim step counters).
            assert row["params_bytes"] == row["grads_bytes"] == psi * 4 / n, row
            assert row["optimizer_state_bytes"] - row["step_counter_bytes"] == psi * 8 / n, row
            assert row["master_bytes"] == 0, row
            assert row["expected_bytes"] == psi * 16 / n, row
            assert row["total_bytes"] == psi * 16 / n + row["step_counter_bytes"], row
            assert row["total_bytes"] <= row["zero_formula_bytes"] == psi * 20 / n, row
            # Besides model state: the reducer's pool of at most 4 bucket-sized gradient
            # buffers, no more than there are buckets, and over more than 2 ranks a unit's
            # staging buffer when units share a bucket.
            buffers = min(4, 6 // units_per_bucket)
            staging = unit * 4 if units_per_bucket > 1 else 0
            assert 0 < row["bucket_buffer_bytes"] <= buffers * bucket * 4 + staging, row
            # And the pool of released units' memory: never more than one whole model.
            assert 0 <= row["param_buffer_bytes"] <= psi * 4, row


def wire_bytes_of_step(zero: dict) -> tuple[int, set, int, int]:
    engine, *_ = zerolap.initialize(model=chain(layers=4, width=128), config=config(**zero))
    for step in range(2):  # recorded, then checked across ranks
        train_step(engine, step, width=128)
    dist.configure(enabled=True)
    dist.reset_log()
    try:
        train_step(engine, 2, width=128)
        # This step's first units were prefetched by the last one; the next one's, which
        # this step() started, are waited for (release does) and counted instead.
        engine.empty_partition_cache()
        sent = sum(r.wire_bytes for r in dist.COMMS_LOGGER.records)
        ops = {r.op for r in dist.COMMS_LOGGER.records}
    finally:
        dist.configure(enabled=False)
        dist.reset_log()
    last = engine.param_store.unit_of[id(engine.module[-2].weight)]  # the last Linear's unit
    return sent, ops, engine.param_store.numel[last], sum(engine.param_store.numel)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    ("zero", "volume"),
    [
        # Every unit all-gathered in forward and in backward, gradients reduce-scattered: 3 Psi.
        ({"stage3_max_reuse_distance": 0}, lambda psi, last: 3 * psi),
        # The last module is used again at once by backward: it stays, the others go.
        ({"stage3_max_reuse_distance": 1}, lambda psi, last: 3 * psi - last),
        # Defaults: everything fits under max_live_parameters and is kept for backward.
        ({}, lambda psi, last: 2 * psi),
    ],
    ids=["reuse 0", "reuse 1", "defaults"],
)
def test_wire_volume_per_step(ranks, world_size, zero, volume):
    n = world_size
    for sent, ops, last, psi in ranks(n).run(wire_bytes_of_step, zero, timeout=TIMEOUT):
        assert psi == 4 * 16512
        assert {"ring_all_gather", "ring_reduce_scatter"} <= ops
        assert ops <= {"ring_all_gather", "ring_reduce_scatter", "all_reduce"}, ops
        expected = volume(psi, last) * (n - 1) / n * 4
        assert sent == pytest.approx(expected, rel=0.05), (sent, expected)
