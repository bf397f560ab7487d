"""Checkpoints saved by DeepSpeed 0.19 (ZeRO stages 0-3), read into zerolap's form.

A run begun on DeepSpeed resumes on zerolap: ``engine.load_checkpoint`` and the consolidation
functions find DeepSpeed's files (a model-states file carrying ``ds_version``) and convert them
here to what they read from zerolap's own checkpoints: the model states (``module``, counters,
scheduler) and runs of named-parameter pieces, each with its fp32 values and Adam state
(``checkpoint.shards``). Every piece is a whole parameter, reassembled from DeepSpeed's shards,
so a checkpoint written at any data-parallel size loads at any other size and stage (DeepSpeed
itself insists on the same size).

DeepSpeed's layouts, per optimizer param group (stage 3: per sub-group):

* stages 1-2: the group's trainable parameters, in ``param_shapes`` order, flattened into one
  buffer (with ``param_alignment_paddings`` after each when set), zero-padded at the end to a
  multiple of 2 x world size and cut into equal rank partitions. The fp32 partitions are saved
  without the tail padding, the Adam moments with it; padding lies only at the global tail, so
  the ranks' pieces concatenated in rank order index both from 0.
* stage 3: each parameter is cut on its own into pieces of ceil(numel / world size) (the last
  padded with unspecified values), and a rank's flat buffer is its pieces in ``param_shapes``
  order. Frozen parameters are sharded the same way, in ``frozen_param_fragments``; tied
  aliases are in rank 0's ``shared_params``.
* stage 0: no file names the parameters. The optimizer state is torch's, numbered over the
  parameters as the client's param groups listed them (fp32), or one unpadded flat buffer per
  group of its trainable parameters (``FP16_Optimizer``, bf16/fp16); the engine supplies those
  lists (``client_groups``). Without them (consolidation) the whole weights in ``module`` serve.

DeepSpeed's FusedAdam keeps the true step count only on the last parameter of each group at
stage 0, so every parameter of a group takes the group's largest. The files pickle three
DeepSpeed classes; they are read with ``weights_only`` and look-alikes registered under those
names, so reading needs neither DeepSpeed nor arbitrary unpickling.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from zerolap.checkpoint.files import MODEL_FILE, CheckpointError
from zerolap.checkpoint.shards import Segment

__all__ = ["is_deepspeed_checkpoint", "read_deepspeed"]

ZERO3_MODEL_GLOB = "zero_pp_rank_*_mp_rank_00_model_states.pt"
OPTIM_GLOB = "*zero_pp_rank_*_mp_rank_00_optim_states.pt"  # "bf16_" prefixed under bf16

# Top-level keys of DeepSpeed's model-states file; every other key is the client's state.
_DEEPSPEED_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "frozen_param_fragments", "shared_params", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
    "ds_version", "universal_checkpoint_info",
}  # fmt: skip


class _ZeroStage(int):
    """Stands in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (pickled as a call)."""


class _Pickled:
    """Stands in for a DeepSpeed object pickled with its ``__dict__`` (loss scalers, fragment
    addresses): the attributes are kept, nothing runs."""


_LOOK_ALIKES = [
    (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_Pickled, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Pickled, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_Pickled, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def _load(path: Path) -> dict:
    try:
        with torch.serialization.safe_globals(_LOOK_ALIKES):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:
        raise CheckpointError(f"DeepSpeed checkpoint file {path} cannot be read: {err}") from None


def _rank_of(path: Path) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", path.name).group(1))


def _by_rank(folder: Path, pattern: str) -> list[Path]:
    return sorted(folder.glob(pattern), key=_rank_of)


def is_deepspeed_checkpoint(folder: Path, model_states: dict | None = None) -> bool:
    """Whether ``folder`` holds a DeepSpeed checkpoint (``model_states``: its
    ``mp_rank_00_model_states.pt``, when already read)."""
    if model_states is not None:
        return "ds_version" in model_states
    return bool(_by_rank(folder, ZERO3_MODEL_GLOB))


def _pieces_of(flat: torch.Tensor, state: dict, shapes: dict, paddings=None):
    """(name, fp32 values, per-parameter state) for consecutive parameters of ``flat``."""
    offset = 0
    for j, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(shape)
        piece_state = _slice_state(state, offset, numel, flat.numel())
        yield name, flat[offset : offset + numel].float().clone(), piece_state
        offset += numel + (paddings[j] if paddings else 0)


def _slice_state(state: dict, offset: int, numel: int, flat_numel: int) -> dict:
    """One parameter's optimizer state out of a flat group's: per-element tensors sliced, the
    step kept as an fp32 tensor (what torch's fused Adam expects)."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() >= flat_numel:
            out[key] = value[offset : offset + numel].clone()
        elif key == "step":
            out[key] = torch.tensor(float(value), dtype=torch.float32)
        else:
            out[key] = value
    return out


def _zero12(model: dict, optims: list[dict]) -> list[tuple[int, str, torch.Tensor, dict]]:
    found = []
    for g, shapes in enumerate(model["param_shapes"]):
        flat = torch.cat([o["single_partition_of_fp32_groups"][g] for o in optims])
        base = [o["base_optimizer_state"] for o in optims]
        if isinstance(base[0], list):
            raise CheckpointError(
                "an elastic DeepSpeed checkpoint (zero_optimization.elastic_checkpoint) is not "
                "supported; save it without elastic_checkpoint"
            )
        state = _concat_states([b["state"][g] for b in base])
        paddings = optims[0].get("param_alignment_paddings", [None] * (g + 1))[g]
        found += [(g, *piece) for piece in _pieces_of(flat, state, shapes, paddings)]
    return found


def _concat_states(states: list[dict]) -> dict:
    """The ranks' optimizer states of one flat group, per-element tensors concatenated."""
    out = {}
    for key, value in states[0].items():
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            out[key] = torch.cat([s[key] for s in states])
        else:
            out[key] = value
    return out


def _zero3(model: dict, optims: list[dict]) -> list[tuple[int, str, torch.Tensor, dict]]:
    world = len(optims)
    inner = optims[0]["optimizer_state_dict"]
    group_of = {i: g for g, pg in enumerate(inner["param_groups"]) for i in pg["params"]}
    found = []
    for i, shapes in enumerate(model["param_shapes"]):
        flats = [o["fp32_flat_groups"][i] for o in optims]
        states = [o["optimizer_state_dict"]["state"].get(i, {}) for o in optims]
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = -(-numel // world)
            values = torch.cat([f[offset : offset + part] for f in flats])[:numel]
            state = {}
            for key, value in states[0].items():
                if isinstance(value, torch.Tensor) and value.dim() == 1:
                    whole = torch.cat([s[key][offset : offset + part] for s in states])
                    state[key] = whole[:numel].clone()
                elif key == "step":
                    state[key] = torch.tensor(float(value), dtype=torch.float32)
                else:
                    state[key] = value
            found.append((group_of.get(i, 0), name, values.float().clone(), state))
            offset += part
    return found


def _zero0(model: dict, client_groups) -> list[tuple[int, str, torch.Tensor, dict]]:
    """Stage 0: the optimizer's entries named by the client's param groups (names in order,
    each with whether it trains)."""
    saved = model["optimizer"]
    if client_groups is None or saved is None:
        return []
    flat_groups = saved.get("fp32_groups_flat")
    inner = saved["optimizer_state_dict"] if flat_groups is not None else saved
    if len(inner["param_groups"]) != len(client_groups):
        raise CheckpointError(
            f"the stage-0 DeepSpeed checkpoint has {len(inner['param_groups'])} optimizer param "
            f"groups, the optimizer here {len(client_groups)}"
        )
    found = []
    for g, (saved_group, names) in enumerate(
        zip(inner["param_groups"], client_groups, strict=True)
    ):
        trainable = [n for n, trains in names if trains]
        if flat_groups is not None:  # FP16_Optimizer: one flat buffer of the trainable ones
            shapes = {n: model["module"][n].shape for n in trainable}
            state = inner["state"].get(g, {})
            found += [(g, *p) for p in _pieces_of(flat_groups[g], state, shapes)]
            continue
        ids = saved_group["params"]
        if len(ids) != len(names):
            raise CheckpointError(
                f"param group {g} of the stage-0 DeepSpeed checkpoint lists {len(ids)} "
                f"parameters, the optimizer here {len(names)}: pass the same parameters"
            )
        states = {
            n: inner["state"][i]
            for i, (n, _) in zip(ids, names, strict=True)
            if i in inner["state"]
        }
        steps = [float(s["step"]) for s in states.values() if "step" in s]
        for name, state in states.items():
            values = model["module"][name].float().reshape(-1).clone()
            flat = {
                k: v.reshape(-1) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for k, v in state.items()
            }
            piece = _slice_state(flat, 0, values.numel(), values.numel())
            if steps:  # FusedAdam counts only on the group's last parameter
                piece["step"] = torch.tensor(max(steps), dtype=torch.float32)
            found.append((g, name, values, piece))
    return found


def _frozen_pieces(models: list[dict]) -> list[tuple[str, torch.Tensor]]:
    """Stage 3's frozen parameters, reassembled from every rank's fragments."""
    shapes = models[0].get("frozen_param_shapes") or {}
    out = []
    for name, shape in shapes.items():
        numel = math.prod(shape)
        parts = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
        out.append((name, torch.cat(parts)[:numel].float().clone()))
    return out


def _loss_scaler(optims: list[dict]) -> dict | None:
    """DeepSpeed's fp16 loss-scaler state as zerolap's (None when static at 1)."""
    scaler = optims[0].get("loss_scaler") if optims else None
    attributes = getattr(scaler, "__dict__", {})
    if "cur_scale" not in attributes:
        return None
    state = {"cur_scale": float(attributes["cur_scale"])}
    for key in ("cur_iter", "last_overflow_iter", "cur_hysteresis"):
        if key in attributes:
            state[key] = attributes[key]
    return state if len(state) > 1 or state["cur_scale"] != 1.0 else None


def read_deepspeed(folder: Path, client_groups=None) -> tuple[dict, list[dict]]:
    """The DeepSpeed checkpoint in ``folder`` as zerolap's (model states, [shard])."""
    layers = sorted(folder.glob("layer_*-model_states.pt"))
    if layers:
        # DeepSpeed's pipeline engine keeps the weights in one file per layer (its model
        # states hold ``module: None``) and the optimizer per stage: not read here.
        raise CheckpointError(
            f"{folder} is a DeepSpeed pipeline checkpoint ({layers[0].name} and "
            f"{len(layers) - 1} more layer files): zerolap loads DeepSpeed's checkpoints of "
            "engines without a pipeline, and its own pipeline checkpoints, not DeepSpeed's "
            "pipeline layout"
        )
    zero3_models = _by_rank(folder, ZERO3_MODEL_GLOB)
    model_paths = zero3_models or [folder / MODEL_FILE]
    models = [_load(path) for path in model_paths]
    first = models[0]
    optims = [_load(path)["optimizer_state_dict"] for path in _by_rank(folder, OPTIM_GLOB)]
    if optims and int(optims[0].get("zero_stage", 1)) == 3:
        stage, params = 3, _zero3(first, optims)
    elif optims:
        stage, params = int(optims[0].get("zero_stage", 1)), _zero12(first, optims)
    else:
        stage, params = 0, _zero0(first, client_groups)
    runs = [
        {"group": g, "segments": [Segment(n, 0, v.numel(), 0)], "values": v, "state": s}
        for g, n, v, s in params
    ]
    frozen = _frozen_pieces(models) if stage == 3 else []
    runs += [
        {"group": -1, "segments": [Segment(n, 0, v.numel(), 0)], "values": v, "state": {}}
        for n, v in frozen
    ]
    shapes = {run["segments"][0].name: None for run in runs}
    shapes = {name: _shape_of(first, name) for name in shapes}
    aliases = {name: name for name in shapes}
    for alias, source in (first.get("shared_params") or {}).items():
        if source in shapes:
            aliases[alias] = source
    config = first.get("ds_config") if isinstance(first.get("ds_config"), dict) else {}
    accumulation = config.get("gradient_accumulation_steps")
    accumulation = accumulation if isinstance(accumulation, int) and accumulation > 0 else 1
    saved = {
        "module": first["module"],
        "param_names": list(shapes),
        "param_shapes": shapes,
        "aliases": aliases,
        "frozen": list(first.get("frozen_param_shapes") or {}),
        "world_size": 1,
        "zero_stage": stage,
        "global_steps": first["global_steps"],
        "global_samples": first.get("global_samples", 0),
        "micro_steps": first["global_steps"] * accumulation,
        "skipped_steps": first.get("skipped_steps", 0),
        "lr_scheduler": first.get("lr_scheduler"),
        "loss_scaler": _loss_scaler(optims),
        "client_state": {k: v for k, v in first.items() if k not in _DEEPSPEED_KEYS},
        "ds_config": config,
    }
    groups = _param_groups(first, optims)
    return saved, [{"runs": runs, "param_groups": groups, "rng": None}]


def _shape_of(model: dict, name: str) -> tuple[int, ...]:
    for shapes in model.get("param_shapes") or []:
        if name in shapes:
            return tuple(shapes[name])
    if name in (model.get("frozen_param_shapes") or {}):
        return tuple(model["frozen_param_shapes"][name])
    return tuple(model["module"][name].shape)


def _param_groups(model: dict, optims: list[dict]) -> list[dict]:
    """The optimizer's hyperparameters per param group (lr, betas, ...), without the params."""
    if optims:
        saved = optims[0]
        inner = saved.get("base_optimizer_state") or saved.get("optimizer_state_dict")
    else:
        inner = model.get("optimizer") or {}
        inner = inner.get("optimizer_state_dict", inner)
    groups = inner.get("param_groups", []) if isinstance(inner, dict) else []
    return [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups]
