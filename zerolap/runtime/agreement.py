"""Before anything else communicates, one collective checks that every rank was given the same
job: the same ds_config (what changes results: stage, precision, batch sizes, clipping, the
optimizer...) and the same model (parameter names, shapes, dtypes, which ones train).

Ranks that disagree would otherwise train on with diverging parameters, or hang in the first
collective whose sizes differ, or abort in gloo's C++ with no Python traceback. Each rank sends
two 64-bit digests (config, model); only when they differ are the descriptions themselves
gathered, to name the first difference, the key or parameter, and the ranks.

What may differ per rank is left out: where each rank logs and profiles, and its local paths
(``nvme_path``: hosts mount their disks where they like). A pipeline's stages hold different
layers: their parameters are compared between the ranks of one stage, and the whole layer
list and its split between all ranks. Experts spread over ranks (``moe.parallel``) are
different experts on each rank of an expert-parallel group under the same local names, which
a user may freeze one by one: they are compared between the ranks holding the same experts
(every E-th rank).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

import zerolap.comm as dist
from zerolap.config import ConfigError, ZerolapConfig
from zerolap.moe.parallel import expert_parallel_size
from zerolap.pipe.module import PipelineModule

__all__ = ["check_ranks_agree"]

# Top-level sections about one rank's own reporting, free to differ.
_RANK_LOCAL_SECTIONS = frozenset(
    {
        "comms_logger", "comet", "csv_monitor", "dump_state", "flops_profiler", "log_level",
        "memory_breakdown", "steps_per_print", "tensorboard", "timers", "wall_clock_breakdown",
        "wandb",
    }
)  # fmt: skip
_RANK_LOCAL_KEYS = frozenset({"nvme_path"})
# Compared with the config (on every rank alike), though it is the model's: a pipeline's layers.
_PIPELINE_LAYERS = "pipeline layers"


def _shared(value: Any) -> Any:
    """``value`` without its rank-local keys, at any depth."""
    if isinstance(value, dict):
        return {k: _shared(v) for k, v in value.items() if k not in _RANK_LOCAL_KEYS}
    if isinstance(value, list):
        return [_shared(v) for v in value]
    return value


def describe(config: ZerolapConfig, model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """What must be equal on every rank: the config's sections and the model's parameters."""
    sections = config.model_dump(mode="json")
    shared = {k: _shared(v) for k, v in sections.items() if k not in _RANK_LOCAL_SECTIONS}
    if isinstance(model, PipelineModule):
        shared[_PIPELINE_LAYERS] = {"list": model.layer_names(), "split": model.parts}
    described = {"model": {}, "experts": {}}
    spread = 1
    for name, p in model.named_parameters():
        size = expert_parallel_size(p)
        spread = max(spread, size)
        part = "experts" if size > 1 else "model"
        described[part][name] = [
            list(getattr(p, "ds_shape", p.shape)),
            str(p.dtype),
            p.requires_grad,
        ]
    return {
        "config": shared,
        "stage": model.stage_id if isinstance(model, PipelineModule) else 0,
        # Which experts this rank holds: its place in its expert-parallel group.
        "place": dist.get_rank() % spread if spread > 1 else 0,
        **described,
    }


def _digest(value: Any) -> int:
    text = json.dumps(value, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def check_ranks_agree(
    config: ZerolapConfig | None, model: torch.nn.Module, invalid: ConfigError | None = None
) -> None:
    """A ``ConfigError`` on every rank, naming the first difference and the ranks, unless all
    ranks have the same config and model. ``invalid``: this rank's ds_config did not parse
    (``config`` is None); every rank learns it here rather than waiting for the others in a
    collective. A collective over all ranks."""
    if dist.get_world_size() == 1:
        if invalid is not None:
            raise invalid
        return
    mine = None if invalid is not None else describe(config, model)
    digests = torch.tensor(
        [0] * 6
        if mine is None
        else [
            1,
            _digest(mine["config"]),
            _digest(list(mine["model"].items())),
            mine["stage"],
            _digest(list(mine["experts"].items())),
            mine["place"],
        ],
        dtype=torch.int64,
        device=dist.buffer_device(),
    )
    gathered = dist.all_gather(digests)
    broken = [r for r, g in enumerate(gathered) if g[0] == 0]
    if invalid is not None:
        raise invalid
    if broken:
        raise ConfigError(
            f"the ds_config of ranks {broken} is invalid (their own error says why); this "
            f"rank's (rank {dist.get_rank()}) is valid"
        )
    if all(torch.equal(g, _first_of_stage(gathered, g)) for g in gathered):
        return
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    raise ConfigError(_first_difference(everyone))


def _first_of_stage(gathered: list[torch.Tensor], digests: torch.Tensor) -> torch.Tensor:
    """Rank 0's digests, with the model's taken from the first rank of the same pipeline
    stage (every rank's, without a pipeline), and the experts' from the first rank of the
    same stage holding the same experts."""
    same = next(g for g in gathered if g[3] == digests[3])
    held = next(g for g in gathered if g[3] == digests[3] and g[5] == digests[5])
    return torch.stack([gathered[0][0], gathered[0][1], same[2], same[3], held[4], held[5]])


def _first_difference(everyone: list[dict[str, Any]]) -> str:
    first = everyone[0]
    odd = [r for r, d in enumerate(everyone) if d["config"] != first["config"]]
    if odd:
        where, ours, theirs = _where(first["config"], everyone[odd[0]]["config"], "config")
        what = "the ds_config"
        if where.startswith(_PIPELINE_LAYERS):  # not a config key: the PipelineModule's list
            what, where = "the PipelineModule", where.replace(_PIPELINE_LAYERS, "its layer", 1)
        return (
            f"the ranks were not given the same job: {what} differs at {where}: rank 0 "
            f"has {ours}, rank {odd[0]} has {theirs} (ranks differing from rank 0: {odd})"
        )
    reference = {d["stage"]: (r, d) for r, d in reversed(list(enumerate(everyone)))}
    odd = [r for r, d in enumerate(everyone) if d["model"] != reference[d["stage"]][1]["model"]]
    if odd:
        ref_rank, ref = reference[everyone[odd[0]]["stage"]]
        same = [r for r in odd if everyone[r]["stage"] == ref["stage"]]
        where, ours, theirs = _where(ref["model"], everyone[odd[0]]["model"], "model")
        return (
            f"the ranks were not given the same job: the model differs at {where}: rank "
            f"{ref_rank} has {ours}, rank {odd[0]} has {theirs} (ranks differing from rank "
            f"{ref_rank}: {same})"
        )
    holders = {(d["stage"], d["place"]): (r, d) for r, d in reversed(list(enumerate(everyone)))}
    odd = [
        r
        for r, d in enumerate(everyone)
        if d["experts"] != holders[d["stage"], d["place"]][1]["experts"]
    ]
    if odd:
        ref_rank, ref = holders[everyone[odd[0]]["stage"], everyone[odd[0]]["place"]]
        where, ours, theirs = _where(ref["experts"], everyone[odd[0]]["experts"], "model")
        return (
            f"the ranks were not given the same job: the experts differ at {where}: rank "
            f"{ref_rank} has {ours}, rank {odd[0]}, which holds the same experts, has {theirs}"
        )
    # Equal as mappings, so the model's parameters come in another order (another layout).
    odd = [
        r
        for r, d in enumerate(everyone)
        if list(d["model"]) != list(reference[d["stage"]][1]["model"])
        or list(d["experts"]) != list(holders[d["stage"], d["place"]][1]["experts"])
    ]
    return (
        "the ranks were not given the same job: the model's parameters are registered in "
        f"another order on ranks {odd} than on rank 0"
    )


def _where(ours: Any, theirs: Any, part: str, path: str = "") -> tuple[str, str, str]:
    """The first key (dotted) at which ``ours`` and ``theirs`` differ, and both values."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in [*ours, *(k for k in theirs if k not in ours)]:
            a, b = ours.get(key, _MISSING), theirs.get(key, _MISSING)
            if a == b:
                continue
            if part == "model":
                return f"parameter {key}", _show_parameter(a), _show_parameter(b)
            return _where(a, b, part, f"{path}.{key}" if path else key)
    return path, _show(ours), _show(theirs)


_MISSING = "<absent>"


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _show_parameter(value: Any) -> str:
    if value == _MISSING:
        return "no such parameter"
    shape, dtype, trains = value
    frozen = "" if trains else " (frozen)"
    return f"shape {tuple(shape)} {dtype.removeprefix('torch.')}{frozen}"
