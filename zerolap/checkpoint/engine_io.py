"""``engine.save_checkpoint`` and ``engine.load_checkpoint``.

Every rank saves its optimizer shard (fp32 values and state of the elements it owns) and RNG;
rank 0 saves the module states, counters, scheduler, loss scaler and the client's state. In
stages 0-2 the module states hold whole parameters, as every rank has them. Under stage 3 no
rank does: their entries are empty placeholders (or, with
``stage3_gather_16bit_weights_on_model_save``, the gathered 16-bit weights) and the optimizer
shards are the parameters' copy (``checkpoint.shards``).

Loading takes buffers and frozen parameters from the module states and every trainable
parameter element from whichever saved shards hold it (``SavedParams``): whole parameters in
stages 0-2, this rank's shard of each unit under stage 3. Then each optimizer run's state is
gathered the same way. A checkpoint saved at one world size and stage loads at any other, with
no conversion step.
"""

from __future__ import annotations

from pathlib import Path

import torch

import zerolap.comm as dist
from zerolap.checkpoint.files import (
    MODEL_FILE,
    CheckpointError,
    optim_file,
    partial_dir,
    publish,
    read,
    read_latest,
    write,
)
from zerolap.checkpoint.module_state import full_state_dict
from zerolap.checkpoint.shards import (
    SavedParams,
    SegmentIndex,
    collect_runs,
    collect_unoptimized,
    restore_rng,
    rng_state,
    segments_of,
)
from zerolap.zero.status import full_shape

__all__ = ["load_checkpoint", "param_names", "save_checkpoint"]


def param_names(engine) -> list[str]:
    """The name of each trainable parameter, in layout order (the first name of a tied one)."""
    names = {}
    for name, param in engine.module.named_parameters():
        names.setdefault(id(param), name)
    return [names[id(p)] for p in engine.params]


def _aliases(engine) -> dict[str, str]:
    """state_dict key -> trainable parameter name (tied weights have several keys)."""
    by_id = dict(zip((id(p) for p in engine.params), param_names(engine), strict=True))
    return {
        key: by_id[id(t)]
        for key, t in engine.module.state_dict(keep_vars=True).items()
        if id(t) in by_id
    }


def _shard_runs(engine, names: list[str], rank: int) -> list[dict]:
    """What this rank saves of the optimizer: its runs (stage 0: rank 0 alone, one copy
    suffices), and under stage 3 also its elements of parameters outside every run."""
    optimizer, layout = engine.optimizer, engine.layout
    if not engine.plan.shard_optimizer and rank != 0:
        return []
    runs = collect_runs(optimizer, layout, names)
    if engine.plan.shard_params:
        owned = layout.owned_ranges(dist.get_rank(engine.group))
        shard = engine.param_store.shard
        runs += collect_unoptimized(layout, names, optimizer.runs, owned, shard)
    return runs


def _module_states(engine, aliases: dict[str, str]) -> dict:
    """The module's state dict for rank 0 to save (a collective under stage 3 with
    ``stage3_gather_16bit_weights_on_model_save``, which saves the whole 16-bit weights)."""
    if not engine.plan.shard_params:
        return engine.module.state_dict()
    if engine.zero_gather_16bit_weights_on_model_save():
        return full_state_dict(engine.module)
    return {
        key: torch.empty(0, dtype=t.dtype) if key in aliases else t.detach()
        for key, t in engine.module.state_dict(keep_vars=True).items()
    }


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest=True) -> str:
    save_dir = Path(save_dir)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    staged = partial_dir(save_dir, tag)
    rank, world = dist.get_rank(), engine.world_size
    if rank == 0:
        staged.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    names = param_names(engine)
    aliases = _aliases(engine)
    module_states = _module_states(engine, aliases)
    write(
        {
            "rank": rank,
            "world_size": world,
            "runs": _shard_runs(engine, names, rank),
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups
            ],
            "rng": rng_state(),
        },
        staged / optim_file(rank),
    )
    if rank == 0:
        write(
            {
                "module": module_states,
                "param_names": names,
                "param_shapes": _shapes(engine, names),
                "aliases": aliases,
                "world_size": world,
                "zero_stage": engine.zero_optimization_stage(),
                "global_steps": engine.global_steps,
                "global_samples": engine.global_samples,
                "micro_steps": engine.micro_steps,
                "skipped_steps": engine.skipped_steps,
                "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
                "loss_scaler": engine.loss_scaler.state_dict(),
                "client_state": client_state or {},
                "ds_config": engine.config.model_dump(mode="json"),
            },
            staged / MODEL_FILE,
        )
    dist.barrier()
    if rank == 0:
        publish(save_dir, tag, save_latest=save_latest)
    dist.barrier()
    return str(save_dir / tag)


def _shapes(engine, names: list[str]) -> dict[str, tuple[int, ...]]:
    """Each trainable parameter's whole shape (stage 3's ``.data`` is empty)."""
    return {n: full_shape(p) for n, p in zip(names, engine.params, strict=True)}


def _check_same_model(engine, saved: dict, path: Path) -> None:
    names = param_names(engine)
    shapes = _shapes(engine, names)
    old = saved["param_shapes"]
    missing = sorted(set(shapes) - set(old))
    unexpected = sorted(set(old) - set(shapes))
    changed = sorted(
        f"{n}: saved {old[n]}, model {shapes[n]}"
        for n in set(shapes) & set(old)
        if tuple(old[n]) != shapes[n]
    )
    if missing or unexpected or changed:
        raise CheckpointError(
            f"{path} is a checkpoint of another model: parameters missing from it {missing}, "
            f"not in the model {unexpected}, shapes differing {changed}"
        )


def _per_element(value, numel: int) -> bool:
    """Optimizer state that has one entry per element (Adam's moments), not per run (step)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def _load_module_states(engine, saved: dict, path: Path) -> None:
    """Buffers and frozen parameters; trainable parameters come from ``SavedParams``."""
    entries = {k: v for k, v in saved["module"].items() if k not in saved["aliases"]}
    try:
        with torch.no_grad():
            missing, unexpected = engine.module.load_state_dict(entries, strict=False)
    except RuntimeError as err:  # a buffer of another shape
        raise CheckpointError(f"{path} does not fit the model's module states: {err}") from None
    missing = sorted(set(missing) - set(_aliases(engine)))
    if missing or unexpected:
        raise CheckpointError(
            f"{path} is a checkpoint of another model: module states missing from it "
            f"{missing}, not in the model {sorted(unexpected)}"
        )


def _load_params(engine, params: SavedParams, names: list[str]) -> None:
    """Stages 0-2: every parameter whole. Stage 3: this rank's chunk of every unit, into the
    parameter store's shard (gathered copies are refreshed by ``publish`` afterwards)."""
    with torch.no_grad():
        if not engine.plan.shard_params:
            for name, param in zip(names, engine.params, strict=True):
                params.fill(name, 0, param.numel(), param.data.view(-1))
            return
        layout, shard = engine.layout, engine.param_store.shard
        rank = dist.get_rank(engine.group)
        for bucket in layout.buckets:
            start, end = bucket.chunk(rank)
            base = layout.shard_offset(bucket.index)
            for seg in segments_of(layout, names, start, end):
                at = base + seg.run_offset
                params.fill(seg.name, seg.param_start, seg.param_end, shard[at : at + seg.numel])


def _load_master(engine, params: SavedParams, names: list[str]) -> None:
    """16-bit training: the fp32 master weights from the saved fp32 values, or with
    ``load_from_fp32_weights: false`` from the loaded 16-bit parameters (losing precision)."""
    optimizer = engine.optimizer
    if optimizer.master is None:
        return
    if not engine.config.zero_optimization.load_from_fp32_weights:
        optimizer.reload_master()
        return
    with torch.no_grad():
        for run, view in zip(optimizer.runs, optimizer.views, strict=True):
            for seg in segments_of(engine.layout, names, run.start, run.end):
                at = seg.run_offset
                params.fill(seg.name, seg.param_start, seg.param_end, view[at : at + seg.numel])


def _run_state(run, view, segments, index: SegmentIndex) -> dict:
    """The optimizer state of one run, gathered from the saved pieces of the same parameter
    elements: per-element tensors piece by piece, per-run entries (Adam's step) from one."""
    numel = run.end - run.start
    state: dict = {}
    source = None
    for segment in segments:

        def put(saved, src, dst, count, base=segment.run_offset):
            for key, tensor in saved["state"].items():
                if _per_element(tensor, saved["values"].numel()):
                    target = state.setdefault(key, torch.zeros(numel, dtype=tensor.dtype))
                    target[base + dst : base + dst + count] = tensor[src : src + count]

        source = index.fill(segment.name, segment.param_start, segment.param_end, put) or source
    if source is not None:
        for key, value in source["state"].items():
            if key not in state:
                state[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return {k: v.to(view.device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _load_optimizer_state(engine, index: SegmentIndex, shards: list[dict], names) -> None:
    optimizer = engine.optimizer
    for run, view in zip(optimizer.runs, optimizer.views, strict=True):
        segments = segments_of(engine.layout, names, run.start, run.end)
        state = _run_state(run, view, segments, index)
        if state:
            optimizer.inner.state[view] = state
    for group, saved in zip(optimizer.param_groups, shards[0]["param_groups"], strict=False):
        group.update(saved)


def load_checkpoint(
    engine,
    load_dir,
    tag=None,
    load_optimizer_states=True,
    load_lr_scheduler_states=True,
    load_module_only=False,
):
    load_dir = Path(load_dir)
    tag = str(tag) if tag is not None else read_latest(load_dir)
    folder = load_dir / tag
    if not folder.is_dir():
        raise CheckpointError(f"rank {dist.get_rank()}: tag {tag!r} not found in {load_dir}")
    saved = read(folder / MODEL_FILE, what="model states")
    _check_same_model(engine, saved, folder)
    shards = [
        read(folder / optim_file(r), what=f"optimizer shard of rank {r}")
        for r in range(saved["world_size"])
    ]
    index = SegmentIndex(shards)
    params = SavedParams(saved, index)
    names = param_names(engine)
    _load_module_states(engine, saved, folder)
    _load_params(engine, params, names)
    _load_master(engine, params, names)
    if load_optimizer_states and not load_module_only:
        _load_optimizer_state(engine, index, shards, names)
    if engine.plan.shard_params:
        engine.param_store.publish()  # persistent units gathered again from the new shards
    if load_module_only:
        return str(folder), saved["client_state"]
    if load_lr_scheduler_states and engine.lr_scheduler and saved["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    engine.loss_scaler.load_state_dict(saved["loss_scaler"])
    for counter in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
        setattr(engine, counter, saved[counter])
    rank = dist.get_rank()
    if rank < len(shards):
        restore_rng(shards[rank]["rng"])
    engine.zero_grad()
    dist.barrier()
    return str(folder), saved["client_state"]
