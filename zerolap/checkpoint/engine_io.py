"""``engine.save_checkpoint`` and ``engine.load_checkpoint``.

Every rank saves its optimizer shard and RNG; rank 0 saves the module (every rank holds full
parameters in stages 0-2), counters, scheduler, loss scaler and the client's state. Loading
reads the module, then fills each of this rank's optimizer runs from whichever saved shards
hold those parameter elements (``checkpoint.shards``): a checkpoint saved at one world size and
stage loads at any other, with no conversion step.
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
from zerolap.checkpoint.shards import (
    SegmentIndex,
    collect_runs,
    restore_rng,
    rng_state,
    segments_of,
)

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


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest=True) -> str:
    save_dir = Path(save_dir)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    staged = partial_dir(save_dir, tag)
    rank, world = dist.get_rank(), engine.world_size
    if rank == 0:
        staged.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    names = param_names(engine)
    owns_optimizer = engine.plan.shard_optimizer or rank == 0  # stage 0: one copy suffices
    write(
        {
            "rank": rank,
            "world_size": world,
            "runs": collect_runs(engine.optimizer, engine.layout, names) if owns_optimizer else [],
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
                "module": engine.module.state_dict(),
                "param_names": names,
                "param_shapes": {
                    n: tuple(p.shape) for n, p in zip(names, engine.params, strict=True)
                },
                "aliases": _aliases(engine),
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


def _check_same_model(engine, saved: dict, path: Path) -> None:
    names = param_names(engine)
    shapes = {n: tuple(p.shape) for n, p in zip(names, engine.params, strict=True)}
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


def _load_run(run, view, segments, index: SegmentIndex) -> dict:
    """Fill ``view`` (the run's parameters or master weights) and return its optimizer state,
    both gathered from the saved pieces of the same parameter elements."""
    numel = run.end - run.start
    values = torch.empty(numel, dtype=torch.float32)
    state: dict = {}
    source = None
    for segment in segments:

        def put(saved, src, dst, count, base=segment.run_offset):
            values[base + dst : base + dst + count] = saved["values"][src : src + count]
            for key, tensor in saved["state"].items():
                if _per_element(tensor, saved["values"].numel()):
                    target = state.setdefault(key, torch.zeros(numel, dtype=tensor.dtype))
                    target[base + dst : base + dst + count] = tensor[src : src + count]

        source = index.fill(segment.name, segment.param_start, segment.param_end, put) or source
    if source is not None:  # per-run entries such as Adam's step count
        for key, value in source["state"].items():
            if key not in state:
                state[key] = value.clone() if isinstance(value, torch.Tensor) else value
    with torch.no_grad():
        view.copy_(values.to(view.dtype))
    return {k: v.to(view.device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _load_optimizer(engine, shards: list[dict]) -> None:
    index = SegmentIndex(shards)
    names = param_names(engine)
    optimizer = engine.optimizer
    for run, view in zip(optimizer.runs, optimizer.views, strict=True):
        segments = segments_of(engine.layout, names, run.start, run.end)
        state = _load_run(run, view, segments, index)
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
    with torch.no_grad():
        engine.module.load_state_dict(saved["module"], strict=True)
    if load_module_only or not load_optimizer_states:
        engine.optimizer.reload_master()  # master weights follow the loaded parameters
    if load_module_only:
        return str(folder), saved["client_state"]
    shards = [
        read(folder / optim_file(r), what=f"optimizer shard of rank {r}")
        for r in range(saved["world_size"])
    ]
    if load_optimizer_states:
        _load_optimizer(engine, shards)
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
