"""``engine.save_checkpoint`` and ``engine.load_checkpoint``.

Every rank saves its optimizer shard (fp32 values and state of the elements it owns) and RNG;
rank 0 saves the module states, counters, scheduler, loss scaler and the client's state.

*Managed* parameters are those whose values the checkpoint keeps as pieces: the trainable ones
in stages 0-2 (the optimizer shards hold their fp32 values), and under stage 3 every sharded
parameter, frozen ones included (no rank holds them whole: their module-state entries are
empty placeholders, or with ``stage3_gather_16bit_weights_on_model_save`` the gathered 16-bit
weights, and each rank saves the elements it owns).

Loading takes buffers and unmanaged parameters from the module states and every managed
parameter element from whichever saved pieces or whole tensors hold it (``SavedParams``):
whole parameters in stages 0-2, this rank's shard of each unit under stage 3. Then each
optimizer run's state is gathered the same way. A checkpoint saved at one world size and stage
loads at any other, with no conversion step; one saved by DeepSpeed 0.19 is read into the same
form first (``checkpoint.deepspeed_format``).

Under tensor parallelism a managed parameter is a piece of a whole one; its saved segments
name ranges of the *whole* parameter (``Split.full_ranges``), each tensor rank saving its own
pieces, so a checkpoint resumes at another tensor-parallel size (or none) and consolidates to
the dense model's state dict.

Under expert parallelism a rank's experts are named by their global index
(``moe.parallel.global_expert_names``): each rank saves its own experts' pieces, rank 0's
model states merge its expert-parallel group's experts, and a run resumes at another
``ep_size`` (or none) and consolidates to the state dict of the model with every expert in one
process.

A pipeline's stages hold different layers under the whole model's names (``zerolap.pipe``):
each saves its own pieces, rank 0's model states merge every stage's, and a load checks the
checkpoint against the whole model, so a pipeline run resumes at another number of stages, or
in one stage, and consolidates to the whole model's state dict.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import torch

import zerolap.comm as dist
from zerolap.checkpoint.deepspeed_format import LoadingModel
from zerolap.checkpoint.files import (
    LATEST,
    MODEL_FILE,
    CheckpointError,
    find_latest,
    no_latest,
    optim_file,
    partial_dir,
    publish,
    read_checkpoint,
    saved_identity,
    tag_folder,
    tag_identity,
    try_write,
    verify,
    write_checksums,
)
from zerolap.checkpoint.module_state import full_state_dict
from zerolap.checkpoint.shards import (
    SavedParams,
    SegmentIndex,
    collect_runs,
    collect_unoptimized,
    gather_state,
    param_segments,
    restore_rng,
    rng_state,
    segments_of,
)
from zerolap.checkpoint.universal import LATEST_UNIVERSAL
from zerolap.moe.parallel import global_expert_names
from zerolap.utils.logging import logger
from zerolap.zero.status import full_shape


def _dense_shape(param) -> tuple[int, ...]:
    """The shape of the whole parameter: gathered under stage 3, joined over the tensor group
    under tensor parallelism."""
    split = getattr(param, "tp_split", None)
    return split.full_shape if split is not None else full_shape(param)


def _splits(engine, names: list[str]) -> dict:
    """Managed parameter name -> its tensor-parallel ``Split`` (pieces only)."""
    pairs = zip(names, _managed(engine), strict=True)
    return {n: p.tp_split for n, p in pairs if getattr(p, "tp_split", None) is not None}


__all__ = ["load_checkpoint", "managed_names", "save_checkpoint"]


def _managed(engine) -> list[torch.nn.Parameter]:
    """The parameters the checkpoint keeps as pieces, in the order of the store's layout."""
    if engine.plan.shard_params:
        return [] if engine.param_store is None else engine.param_store.params
    return engine.params


def _first_names(engine) -> dict[int, str]:
    renamed = global_expert_names(engine.module)
    names = {}
    for name, param in engine.module.named_parameters():
        names.setdefault(id(param), renamed.get(name, name))
    return names


def _states(engine) -> dict[str, torch.Tensor]:
    """The module's state dict (tensors as they are), experts under their global names."""
    renamed = global_expert_names(engine.module)
    return {renamed.get(k, k): t for k, t in engine.module.state_dict(keep_vars=True).items()}


def managed_names(engine) -> list[str]:
    """The name of each managed parameter, in layout order (the first name of a tied one)."""
    names = _first_names(engine)
    return [names[id(p)] for p in _managed(engine)]


def _aliases(engine) -> dict[str, str]:
    """state_dict key -> managed parameter name (tied weights have several keys)."""
    by_id = dict(zip((id(p) for p in _managed(engine)), managed_names(engine), strict=True))
    return {key: by_id[id(t)] for key, t in _states(engine).items() if id(t) in by_id}


def _client_groups(engine) -> list[list[tuple[str, bool]]] | None:
    """Per client param group, (name, trains) of each parameter in the client's order."""
    if engine.optimizer is None:
        return None
    names = _first_names(engine)
    return [
        [(names.get(id(p), "<not in the model>"), p.requires_grad) for p in group]
        for group in engine.optimizer.client_groups
    ]


def _frozen(param) -> bool:
    return isinstance(param, torch.nn.Parameter) and not param.requires_grad


def _frozen_keys(engine) -> list[str]:
    """state_dict keys of frozen parameters (consolidation can leave them out)."""
    return [key for key, tensor in _states(engine).items() if _frozen(tensor)]


def _shard_runs(engine, names: list[str], exclude_frozen: bool) -> list[dict]:
    """What this rank saves of the parameters: its optimizer runs (stage 0: data-parallel rank
    0 alone, one copy per tensor rank suffices, the first piece's rank under sequence
    parallelism, and under expert parallelism the first rank holding each set of experts,
    those), and under stage 3 also its elements of managed parameters outside every run
    (frozen ones, unless excluded)."""
    runs = []
    optimizer = engine.optimizer
    splits = _splits(engine, names)
    first = engine.mesh.data_rank == 0 and engine.mesh.get_sequence_parallel_rank() == 0
    if optimizer is not None and (engine.plan.shard_optimizer or first):
        runs = collect_runs(optimizer, engine.layout, names, splits)
    elif optimizer is not None and engine.mesh.data_rank < engine.ep_size:
        # Stage 0 under expert parallelism: the first rank holding each set of experts.
        buckets = engine.layout.buckets
        experts = {i for i, r in enumerate(optimizer.runs) if buckets[r.bucket].stride > 1}
        runs = collect_runs(optimizer, engine.layout, names, splits, only=experts)
    if engine.plan.shard_params:
        store = engine.param_store
        owned = store.layout.owned_ranges(dist.get_rank(engine.group))
        optimized = optimizer.runs if optimizer is not None else []
        pieces = collect_unoptimized(
            store.layout, names, optimized, owned, store.shard_slice, splits
        )
        if exclude_frozen:
            frozen = {n for n, p in zip(names, store.params, strict=True) if _frozen(p)}
            pieces = [r for r in pieces if r["segments"][0].name not in frozen]
        runs += pieces
    return runs


def _refuse_frozen_pieces(engine) -> None:
    """Below stage 3 frozen parameters are saved whole from rank 0's module states, which
    cannot hold a tensor-parallel piece of the other ranks."""
    if engine.plan.shard_params:
        return
    for name, param in engine.module.named_parameters():
        if _frozen(param) and getattr(param, "tp_split", None) is not None:
            raise CheckpointError(
                f"save_checkpoint: {name} is a frozen tensor-parallel piece, which ZeRO stages "
                "0-2 cannot save; train it, or use stage 3, which saves frozen pieces"
            )


def _module_states(engine, aliases: dict[str, str], exclude_frozen: bool) -> dict:
    """The module's state dict for rank 0 to save (a collective under stage 3 with
    ``stage3_gather_16bit_weights_on_model_save``, which saves the whole 16-bit weights).
    Tensor-parallel pieces are empty placeholders: the optimizer shards hold them."""
    if not engine.plan.shard_params:
        states = _states(engine)
        return {
            k: torch.empty(0, dtype=t.dtype) if getattr(t, "tp_split", None) else t.detach()
            for k, t in states.items()
            if not (exclude_frozen and _frozen(t))
        }
    if engine.zero_gather_16bit_weights_on_model_save():
        return full_state_dict(engine.module, exclude_frozen=exclude_frozen)
    return {
        key: torch.empty(0, dtype=t.dtype) if key in aliases else t.detach()
        for key, t in _states(engine).items()
        if not (exclude_frozen and _frozen(t))
    }


def _holders(engine):
    """The group whose ranks hold the other parts of this rank's copy of the model: its
    pipeline, or the expert-parallel group holding the other experts; None when it holds it
    all."""
    if engine.ep_size > 1:
        return engine.mesh.expert_groups(engine.ep_size).expert_group
    return engine.mesh.pipe_group


def _own_experts(engine, parts: dict) -> dict:
    """``parts`` cut to this rank's experts (what the first rank of its expert-parallel group
    lacks)."""
    mine = set(global_expert_names(engine.module).values())
    return {
        "module": {k: v for k, v in parts["module"].items() if k in mine},
        "names": [n for n in parts["names"] if n in mine],
        "shapes": {n: v for n, v in parts["shapes"].items() if n in mine},
        "aliases": {k: n for k, n in parts["aliases"].items() if k in mine},
        "frozen": [k for k in parts["frozen"] if k in mine],
    }


def _whole_model(engine, parts: dict) -> list[dict] | None:
    """``parts`` (what this rank knows of the model) from every stage of rank 0's pipeline, or
    every expert-parallel rank of its group, gathered on rank 0 (None elsewhere); just
    ``[parts]`` when rank 0 holds it all."""
    group = _holders(engine)
    if group is None:
        return [parts] if dist.get_rank() == 0 else None
    if engine.ep_size > 1:
        if engine.mesh.data_rank >= engine.ep_size:
            return None  # another copy of the same experts
        gathered = [None] * engine.ep_size if dist.get_rank() == 0 else None
        sent = parts if dist.get_rank() == 0 else _own_experts(engine, parts)
        dist.gather_object(sent, gathered, dst=0, group=group)
        return gathered
    if engine.mesh.data_rank != 0 or engine.mesh.tensor_rank != 0:
        return None  # another pipeline's copy of the same layers
    gathered: list | None = [None] * engine.mesh.dims.pipe if dist.get_rank() == 0 else None
    dist.gather_object(parts, gathered, dst=0, group=group)
    return gathered


def _merged(stages: list[dict]) -> dict:
    """One description of the model from its stages' (a tied weight, held by several, once)."""
    out = {"module": {}, "names": [], "shapes": {}, "aliases": {}, "frozen": []}
    for part in stages:
        out["module"].update(part["module"])
        out["names"] += [n for n in part["names"] if n not in out["shapes"]]
        out["shapes"].update(part["shapes"])
        out["aliases"].update(part["aliases"])
        out["frozen"] += [k for k in part["frozen"] if k not in out["frozen"]]
    return out


def _model_shapes(engine) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The whole model's parameter shapes and state_dict keys (every stage's, in a pipeline,
    every expert's under expert parallelism: one small all-gather over the ranks holding the
    other parts)."""
    module = engine.module
    renamed = global_expert_names(module)
    shapes = {
        renamed.get(n, n): _dense_shape(p)
        for n, p in module.named_parameters(remove_duplicate=False)
    }
    keys = set(_states(engine))
    group = _holders(engine)
    if group is None:
        return shapes, keys
    stages: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, (shapes, keys), group=group)
    return {n: s for part, _ in stages for n, s in part.items()}, set().union(
        *(k for _, k in stages)
    )


def _optimizer_groups(engine) -> list[dict]:
    if engine.optimizer is None:
        return []
    return [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]


def _agreed_tag(tag: str, validation: str) -> str:
    """The tag every rank saves under: rank 0's. Given different tags, the ranks would write
    pieces of one checkpoint into different folders; ds_config's ``checkpoint.tag_validation``
    makes that an error on every rank ("FAIL"), a warning ("WARN", the default) or neither."""
    tags: list = [None] * dist.get_world_size()
    dist.all_gather_object(tags, tag)
    if len(set(tags)) == 1:
        return tag
    given = ", ".join(f"rank {rank} {name!r}" for rank, name in enumerate(tags))
    if validation == "FAIL":
        raise CheckpointError(
            f"save_checkpoint: the ranks were given different tags ({given}), and "
            "checkpoint.tag_validation is 'Fail'; a tag must not hold anything rank-specific"
        )
    if validation == "WARN" and dist.get_rank() == 0:
        logger.warning(
            f"save_checkpoint: the ranks were given different tags ({given}); every rank saves "
            f"under rank 0's, {tags[0]!r} (checkpoint.tag_validation 'Ignore' silences this)"
        )
    return tags[0]


def save_checkpoint(
    engine, save_dir, tag=None, client_state=None, *, save_latest=True, exclude_frozen=False
) -> str:
    dist.check_in("save_checkpoint")  # one rank alone fails fast instead of hanging
    save_dir = Path(save_dir)
    tag = _agreed_tag(
        str(tag) if tag is not None else f"global_step{engine.global_steps}",
        engine._config.checkpoint.tag_validation,
    )
    staged = partial_dir(save_dir, tag)
    rank, world = dist.get_rank(), dist.get_world_size()  # every rank saves a file
    # The save's identity, in every file: a file from another save cannot pass for this one's.
    # Whatever fails on one rank fails the save on all of them alike (rank 0's verdicts are
    # broadcast), so that no rank is left waiting in a collective the others skipped.
    begun = [{"id": uuid.uuid4().hex, "tag": tag, "step": engine.global_steps}, None]
    if rank == 0:
        try:
            shutil.rmtree(staged, ignore_errors=True)  # what a killed save of this tag left
            staged.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            begun[1] = f"rank 0: could not create {staged}: {err}"
    dist.broadcast_object_list(begun, src=0)
    save, failure = begun
    if failure is not None:
        raise CheckpointError(f"checkpoint {tag!r} not saved: {failure}")
    names = managed_names(engine)
    _refuse_frozen_pieces(engine)
    aliases = _aliases(engine)
    module_states = _module_states(engine, aliases, exclude_frozen)
    if exclude_frozen:
        frozen = {n for n, p in zip(names, _managed(engine), strict=True) if _frozen(p)}
        names_saved = [n for n in names if n not in frozen]
        aliases = {k: n for k, n in aliases.items() if n not in frozen}
    else:
        names_saved = names
    shapes = dict(zip(names, (_dense_shape(p) for p in _managed(engine)), strict=True))
    stages = _whole_model(
        engine,
        {
            "module": module_states,
            "names": names_saved,
            "shapes": {n: shapes[n] for n in names_saved},
            "aliases": aliases,
            "frozen": _frozen_keys(engine) if not exclude_frozen else [],
        },
    )
    try:
        shard_digest, failure = try_write(
            {
                "rank": rank,
                "world_size": world,
                "runs": _shard_runs(engine, names, exclude_frozen),
                "param_groups": _optimizer_groups(engine),
                "rng": rng_state(),
                "save": save,
            },
            staged / optim_file(rank),
        )
    except Exception as err:  # reading swapped state, say: the save fails, on every rank
        shard_digest, failure = None, f"could not save its shard: {err!r}"
    written: list | None = [None] * world if rank == 0 else None
    dist.gather_object((shard_digest, failure), written, dst=0)
    outcome = [None]  # rank 0's verdict for all: None, or why the save failed
    if rank == 0:
        failed = [f"rank {r}: {why}" for r, (_, why) in enumerate(written) if why is not None]
        if failed:
            outcome = ["; ".join(failed)]
        else:
            try:
                model = _merged(stages)
                model_states = {
                    "module": model["module"],
                    "param_names": model["names"],
                    "param_shapes": model["shapes"],
                    "aliases": model["aliases"],
                    "frozen": model["frozen"],
                    "world_size": world,
                    "zero_stage": engine.zero_optimization_stage(),
                    "global_steps": engine.global_steps,
                    "global_samples": engine.global_samples,
                    "micro_steps": engine.micro_steps,
                    "micro_in_step": engine.micro_in_step,
                    "skipped_steps": engine.skipped_steps,
                    "lr_scheduler": engine.lr_scheduler.state_dict()
                    if engine.lr_scheduler
                    else None,
                    "loss_scaler": engine.loss_scaler.state_dict(),
                    "client_state": client_state or {},
                    "ds_config": engine._config.model_dump(mode="json"),
                    "save": save,
                }
                outcome = [_finish_files(staged, save, model_states, [d for d, _ in written])]
            except Exception as err:  # a scheduler or client_state that cannot be saved
                outcome = [f"rank 0: could not save the model states: {err!r}"]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        # Every rank fails alike, the partial files go, the previous checkpoint stays.
        if rank == 0:
            shutil.rmtree(staged, ignore_errors=True)
        dist.barrier()
        raise CheckpointError(f"checkpoint {tag!r} not saved: {outcome[0]}")
    published = [None]
    if rank == 0:
        try:
            publish(save_dir, tag, save_latest=save_latest)
        except OSError as err:
            published = [f"rank 0: could not publish it in {save_dir}: {err}"]
    dist.broadcast_object_list(published, src=0)
    if published[0] is not None:
        raise CheckpointError(f"checkpoint {tag!r} not saved: {published[0]}")
    return str(save_dir / tag)


def _finish_files(staged: Path, save: dict, model_states: dict, digests: list) -> str | None:
    """Rank 0's model-states file, then ``checksums.json``; why they could not be written, or
    None."""
    model_digest, failure = try_write(model_states, staged / MODEL_FILE)
    if failure is not None:
        return f"rank 0: {failure}"
    files = {optim_file(r): d for r, d in enumerate(digests)} | {MODEL_FILE: model_digest}
    try:
        write_checksums(staged, save, files)
    except OSError as err:
        return f"rank 0: could not write {staged / 'checksums.json'}: {err}"
    return None


def _resume_accumulation(engine, saved: dict) -> None:
    """The next micro-batch starts a step, of this run's accumulation count (another
    data-parallel size for the same global batch accumulates over another). A checkpoint
    holds no gradients accumulated towards an unfinished step."""
    engine.micro_in_step = 0
    into = saved.get("micro_in_step", 0)  # absent: saved by DeepSpeed or an older zerolap
    if into:
        logger.warning(
            f"the checkpoint was saved {into} micro-batch(es) into step "
            f"{saved['global_steps'] + 1}, whose accumulated gradients a checkpoint does not "
            "hold: that step starts afresh"
        )


# A load retries this many times when the checkpoint was re-saved while it read.
READ_ATTEMPTS = 3


def _loading_model(engine) -> LoadingModel:
    """What a DeepSpeed checkpoint's files leave to the loading model to say: the client's
    param groups, and a pipeline's layer names and this rank's stage."""
    prefixes = getattr(engine.module, "layer_prefixes", None)
    return LoadingModel(
        client_groups=_client_groups(engine),
        layer_prefixes=prefixes() if callable(prefixes) else None,
        stage=getattr(engine, "stage_id", 0),
        stages=getattr(engine, "num_stages", 1),
        frozen=frozenset(_frozen_keys(engine)),
    )


def _unnamed_state(engine, saved: dict, shards: list[dict]) -> str | None:
    """The parameters this rank steps whose optimizer state is in the checkpoint's entries
    that could not be named (a DeepSpeed pipeline stage's, or a layout not read), said as an
    error; None if none."""
    if not saved.get("unnamed") or engine.optimizer is None:
        return None
    index, names = SegmentIndex(shards), managed_names(engine)
    splits = _splits(engine, names)
    lacking = sorted(
        {
            seg.name
            for run in engine.optimizer.runs
            for seg in segments_of(engine.layout, names, run.start, run.end, splits)
            if index.covered(seg.name) == 0
        }
    )
    if not lacking:
        return None
    return (
        f"rank {dist.get_rank()}: the optimizer state of {lacking[:5]}"
        f"{' and more' if len(lacking) > 5 else ''} is in DeepSpeed checkpoint entries that "
        f"cannot be named: {'; '.join(saved['unnamed'])}. Load with "
        "load_optimizer_states=False to take the weights alone"
    )


def _latest_file(engine, load_dir: Path, say: bool) -> str:
    """The file naming the tag to load when none is given: ``latest``, or under ds_config's
    ``checkpoint.load_universal`` the ``latest_universal`` that DeepSpeed's converter writes.
    Without that file, ``latest`` serves (every checkpoint zerolap reads loads at any world
    size), with a line saying so when ``say``; with neither, an error naming it."""
    if not engine._config.checkpoint.load_universal:
        return LATEST
    if (load_dir / LATEST_UNIVERSAL).is_file():
        return LATEST_UNIVERSAL
    if (load_dir / LATEST).is_file():
        if say and dist.get_rank() == 0:
            logger.info(
                f"checkpoint.load_universal: {load_dir} has no {LATEST_UNIVERSAL} file; loading "
                f"the tag its {LATEST!r} names, which loads at any world size and stage as it is"
            )
        return LATEST
    raise CheckpointError(
        f"checkpoint.load_universal is set, but {load_dir / LATEST_UNIVERSAL} does not exist: "
        "convert a checkpoint with `python -m deepspeed.checkpoint.ds_to_universal`, or pass "
        "its tag"
    )


def _read_whole(
    engine, load_dir: Path, tag, optimizer_wanted: bool = True
) -> tuple[Path, dict, list[dict]] | None:
    """The checkpoint's folder, model states and shards, all of one save, on every rank (None
    on every rank when ``tag`` is None and ``load_dir`` names no checkpoint).

    The ranks split hashing the files and agree on one verdict, so that every rank raises the
    same error (and none goes on to a collective alone). Another job re-saving the tag (or
    moving ``latest``) while this one reads can replace the folder between two files: the
    files then disagree with one another or with ``checksums.json``. When the save a rank
    sees has changed since it began, all ranks read again the save now published (a save is
    visible only whole); when none has, a disagreement is damage, and an error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for attempt in range(READ_ATTEMPTS):
        name = folder = saved = shards = problem = began = None
        latest = LATEST
        try:
            if tag is None:
                latest = _latest_file(engine, load_dir, say=attempt == 0)
            name = str(tag) if tag is not None else find_latest(load_dir, latest)
            if name is not None:
                folder = tag_folder(load_dir, name, who=f"rank {rank}: ")
                began = saved_identity(folder)
                verify(folder, share=(rank, world))
                saved, shards = read_checkpoint(folder, _loading_model(engine), hashed=True)
                if optimizer_wanted:
                    problem = _unnamed_state(engine, saved, shards)
        except Exception as err:
            # Any error, not only a CheckpointError: raised here, it would leave the other ranks
            # waiting in the gather below. A file that vanished between two reads (an OSError,
            # as a re-save moved the folder aside) is one.
            problem = str(err)
        try:
            now = find_latest(load_dir, latest) if tag is None else name
            moved = now != name or (now is not None and tag_identity(load_dir, now) != began)
            # Read from ``<tag>.old`` while a re-save was between its two renames: what failed
            # there was being moved away.
            moved = moved or (problem is not None and folder is not None and folder.name != name)
        except (CheckpointError, OSError, ValueError):
            # ``latest`` unreadable: rewritten by a non-atomic writer (or damaged). Having
            # named a tag before, the checkpoint moved; unreadable both times, it may be caught
            # mid-write twice, so it is read again a little later, and what the last attempt
            # finds is the error.
            moved, unreadable = name is not None, name is None
        else:
            unreadable = False
        views: list = [None] * world
        # "Nothing to load" only when finding it raised nothing (an error names what is wrong).
        found = (name is None and problem is None, problem, moved, began, unreadable)
        dist.all_gather_object(views, found)
        if all(view[0] for view in views):
            return None
        if any(view[2] for view in views):
            logger.warning(
                f"rank {rank}: checkpoint {name!r} in {load_dir} was re-saved while it was "
                "read; reading the new save"
            )
            continue
        if any(view[4] for view in views) and attempt + 1 < READ_ATTEMPTS:
            time.sleep(0.05 * (attempt + 1))
            continue
        for r, (nothing, problem, *_) in enumerate(views):
            if nothing:
                raise CheckpointError(f"rank {r} finds no 'latest' file in {load_dir}")
            if problem is not None:
                raise CheckpointError(problem)
        if len({repr(view[3]) for view in views}) > 1:
            seen = "; ".join(f"rank {r}: {view[3]}" for r, view in enumerate(views))
            raise CheckpointError(
                f"the ranks found different saves of {name!r} in {load_dir} ({seen}): is it on "
                "a filesystem every rank shares?"
            )
        return folder, saved, shards
    which = repr(tag) if tag is not None else f"named by {latest!r}"
    raise CheckpointError(
        f"the checkpoint {which} in {load_dir} changed during each of {READ_ATTEMPTS} attempts "
        "to read it" + (f"; the last attempt: {problem}" if problem else "")
    )


def _saved_shapes(saved: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter and buffer the checkpoint can give, by state_dict key, with its shape."""
    shapes = {k: tuple(t.shape) for k, t in saved["module"].items()}
    for key, name in saved["aliases"].items():
        shapes[key] = tuple(saved["param_shapes"][name])
    return shapes


def _check_same_model(engine, saved: dict, path: Path, strict: bool, params: dict) -> None:
    """Every parameter of the model (``params``: name -> shape) must be in the checkpoint with
    its shape (a missing one only when ``strict`` is off: a checkpoint saved without frozen
    parameters, say)."""
    have = _saved_shapes(saved)
    changed = sorted(
        f"{n}: saved {have[n]}, model {shape}"
        for n, shape in params.items()
        if n in have and have[n] != shape and have[n] != (0,)
    )
    missing = sorted(n for n in params if n not in have)
    unexpected = sorted(set(saved["param_shapes"]) - set(params))
    if changed or unexpected or (missing and strict):
        raise CheckpointError(
            f"{path} is a checkpoint of another model: parameters missing from it {missing}, "
            f"not in the model {unexpected}, shapes differing {changed}"
        )
    # A checkpoint saved without its frozen parameters (the Trainer's, of a PEFT model) is
    # expected to lack them: said once, briefly; a trainable one missing is worth a warning.
    # Each rank speaks of the parameters it holds (another stage's, or another rank's experts,
    # are theirs to report).
    held = set(_first_names(engine).values())
    missing = [n for n in missing if n in held]
    frozen = set(_frozen_keys(engine))
    trainable = [n for n in missing if n not in frozen]
    if trainable:
        logger.warning(f"{path}: parameters not in the checkpoint keep their values: {trainable}")
    if len(trainable) < len(missing) and dist.get_rank(engine.group) == 0:  # once a stage
        logger.info(
            f"{path}: {len(missing) - len(trainable)} frozen parameters are not in the "
            "checkpoint (saved without them) and keep their values"
        )


def _load_module_states(
    engine, saved: dict, path: Path, strict: bool, custom_load_fn, model_keys: set[str]
) -> None:
    """Buffers and unmanaged parameters; managed ones come from ``SavedParams``. Another
    pipeline stage's entries (in ``model_keys`` but not this module's) are its to load."""
    aliases = _aliases(engine)
    own = set(_states(engine))
    # Experts are saved under their global names, and loaded under this rank's local ones.
    renamed = global_expert_names(engine.module)
    local = {g: k for k, g in renamed.items()}
    entries = {
        local.get(k, k): v
        for k, v in saved["module"].items()
        if k not in saved["aliases"] and k not in aliases and (k in own or k not in model_keys)
    }
    if custom_load_fn is not None:
        custom_load_fn(src=entries, dst=engine.module)
        return
    try:
        with torch.no_grad():
            missing, unexpected = engine.module.load_state_dict(entries, strict=False)
    except RuntimeError as err:  # a buffer of another shape
        raise CheckpointError(f"{path} does not fit the model's module states: {err}") from None
    missing = sorted({renamed.get(k, k) for k in missing} - set(aliases) - set(saved["aliases"]))
    unexpected = sorted(renamed.get(k, k) for k in unexpected)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{path} is a checkpoint of another model: module states missing from it "
            f"{missing}, not in the model {sorted(unexpected)}"
        )


def _load_params(engine, params: SavedParams, names: list[str]) -> None:
    """Stages 0-2: every managed parameter whole. Stage 3: this rank's chunk of every unit,
    into the parameter store's shard (gathered copies are refreshed by ``publish``)."""
    splits = _splits(engine, names)
    with torch.no_grad():
        if not engine.plan.shard_params:
            for name, param in zip(names, engine.params, strict=True):
                if not params.has(name):
                    continue
                flat = param.data.view(-1)
                for seg in param_segments(name, param.numel(), splits.get(name)):
                    out = flat[seg.run_offset : seg.run_offset + seg.numel]
                    params.fill(name, seg.param_start, seg.param_end, out)
            return
        store = engine.param_store
        store.settle()  # no gather still reads the chunks written below
        rank = dist.get_rank(engine.group)
        for bucket in store.layout.buckets:
            start, end = bucket.chunk(rank)
            base = store.layout.shard_offset(bucket.index)
            for seg in segments_of(store.layout, names, start, end, splits):
                if params.has(seg.name):
                    at = base + seg.run_offset
                    out = store.shard_slice(at, seg.numel, write=True)
                    params.fill(seg.name, seg.param_start, seg.param_end, out)


def _load_master(engine, params: SavedParams, names: list[str]) -> None:
    """16-bit training (or an optimizer offloaded from an accelerator): the fp32 master weights
    from the saved fp32 values, or with ``load_from_fp32_weights: false`` from the loaded 16-bit
    parameters (losing precision)."""
    optimizer = engine.optimizer
    if optimizer is None or not any(optimizer.apart):
        return
    if not engine._config.zero_optimization.load_from_fp32_weights:
        optimizer.reload_master()
        return
    splits = _splits(engine, names)
    with torch.no_grad():
        for i, values, _ in optimizer.visit_runs(write=True):
            run = optimizer.runs[i]
            for seg in segments_of(engine.layout, names, run.start, run.end, splits):
                at = seg.run_offset
                params.fill(seg.name, seg.param_start, seg.param_end, values[at : at + seg.numel])


def _load_optimizer_state(engine, index: SegmentIndex, shards: list[dict], names) -> None:
    optimizer = engine.optimizer
    splits = _splits(engine, names)
    for i, values, state in optimizer.visit_runs(write=True):
        run = optimizer.runs[i]
        segments = segments_of(engine.layout, names, run.start, run.end, splits)
        state.clear()
        found = gather_state(run.end - run.start, values.dtype, segments, index)
        state.update(
            (k, v.to(values.device) if isinstance(v, torch.Tensor) else v) for k, v in found.items()
        )
    saved_groups = shards[0]["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        # Saved before empty param groups were dropped (as DeepSpeed drops them): the groups
        # no run belongs to go, so the others line up with this optimizer's.
        used = {run["group"] for shard in shards for run in shard["runs"]}
        saved_groups = [g for i, g in enumerate(saved_groups) if i in used]
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=False):
        group.update({k: v for k, v in saved.items() if k in group})  # this optimizer's keys


def load_checkpoint(
    engine,
    load_dir,
    tag=None,
    *,
    load_module_strict=True,
    load_optimizer_states=True,
    load_lr_scheduler_states=True,
    load_module_only=False,
    custom_load_fn=None,
):
    dist.check_in("load_checkpoint")
    load_dir = Path(load_dir)
    optimizer = engine.optimizer
    wanted = optimizer is not None and load_optimizer_states and not load_module_only
    found = _read_whole(engine, load_dir, tag, wanted)
    if found is None:
        logger.warning(f"nothing loaded: {no_latest(load_dir)}")
        return None, None
    folder, saved, shards = found
    shapes, model_keys = _model_shapes(engine)
    _check_same_model(engine, saved, folder, load_module_strict, shapes)
    index = SegmentIndex(shards)
    params = SavedParams(saved, index)
    names = managed_names(engine)
    _load_module_states(engine, saved, folder, load_module_strict, custom_load_fn, model_keys)
    _load_params(engine, params, names)
    _load_master(engine, params, names)
    if wanted:
        _load_optimizer_state(engine, index, shards, names)
    if engine.plan.shard_params:
        engine.param_store.publish(frozen_too=True)  # persistent units from the new shards
    if load_module_only:
        return str(folder), saved["client_state"]
    if load_lr_scheduler_states and engine.lr_scheduler and saved["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    if saved["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(saved["loss_scaler"])
    for counter in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
        setattr(engine, counter, saved[counter])
    _resume_accumulation(engine, saved)
    engine.nonfinite.reset()  # a rollback starts a fresh count of skips in a row
    rank = dist.get_rank()
    if rank < len(shards) and shards[rank].get("rng") is not None:
        restore_rng(shards[rank]["rng"])
    if optimizer is not None:
        engine.zero_grad()
    dist.barrier()
    return str(folder), saved["client_state"]
