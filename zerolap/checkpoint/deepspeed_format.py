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

* the pipeline engine (stages 0-1): the weights in one file per layer of the whole model
  (``layer_XX-model_states.pt``, that layer's own state dict; a tied module is in the file of
  each layer calling it without a ``forward_fn``), and per stage ``s`` a model-states file
  ``mp_rank_<s>_model_states.pt`` (``module: None``) and, at stage 1, the layouts above in
  ``zero_pp_rank_<d>_mp_rank_<s>_optim_states.pt``, named by the stage's ``param_shapes``. At
  stage 0 nothing names a stage's optimizer entries: they follow the stage module's
  parameters, its tied modules first, then its layers in order, so the layers each stage held
  are found again as the cut whose parameters fit every stage's entries. A layer's entries go
  under the name the loading model gives that layer (``PipelineModule.layer_prefixes``:
  ``"3."``, or ``"tied_modules.embed."``), or without a model under its index.

* mixture of experts (``deepspeed.moe`` with expert parallelism E): the experts are not in
  ``module`` but in one file per expert (``layer_<l>_expert_<j>_mp_rank_00_model_states.pt``,
  keys under the expert's global index j, as zerolap names experts). Their optimizer state is
  under each rank's *local* names (local copy i of expert-parallel rank e is expert e x L + i,
  L = the layer's experts / E): at stages 1-2 an expert group is partitioned over the ranks
  holding the same experts (``partition_count``: data-parallel ranks e, e + E, ...), at stage 0
  expert-parallel rank e's optimizer is ``expp_rank_<e>_mp_rank_00_optim_states.pt``.

DeepSpeed's FusedAdam keeps the true step count only on the last parameter of each group at
stage 0, so every parameter of a group takes the group's largest. The files pickle three
DeepSpeed classes; they are read with ``weights_only`` and look-alikes registered under those
names, so reading needs neither DeepSpeed nor arbitrary unpickling.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from zerolap.checkpoint.files import MODEL_FILE, CheckpointError
from zerolap.checkpoint.shards import Segment

__all__ = [
    "EXPERT_NAME",
    "LoadingModel",
    "files_by_rank",
    "frozen_pieces",
    "hyperparameters",
    "is_deepspeed_checkpoint",
    "load_file",
    "loss_scaler_of",
    "read_deepspeed",
    "zerolap_form",
]

ZERO3_MODEL_GLOB = "zero_pp_rank_*_mp_rank_00_model_states.pt"
OPTIM_GLOB = "*zero_pp_rank_*_mp_rank_00_optim_states.pt"  # "bf16_" prefixed under bf16
EXPERT_GLOB = "layer_*_expert_*_mp_rank_*_model_states.pt"
EXPERT_OPTIM_GLOB = "expp_rank_*_mp_rank_00_optim_states.pt"
EXPERT_NAME = re.compile(r"(.*\.deepspeed_experts\.)(\d+)(\..*)")

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


def load_file(path: Path) -> dict:
    try:
        with torch.serialization.safe_globals(_LOOK_ALIKES):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:
        raise CheckpointError(f"DeepSpeed checkpoint file {path} cannot be read: {err}") from None


def _rank_of(path: Path) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", path.name).group(1))


def files_by_rank(folder: Path, pattern: str) -> list[Path]:
    return sorted(folder.glob(pattern), key=_rank_of)


def is_deepspeed_checkpoint(folder: Path, model_states: dict | None = None) -> bool:
    """Whether ``folder`` holds a DeepSpeed checkpoint (``model_states``: its
    ``mp_rank_00_model_states.pt``, when already read)."""
    if model_states is not None:
        return "ds_version" in model_states
    return bool(files_by_rank(folder, ZERO3_MODEL_GLOB))


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


def _zero12(
    model: dict, optims: list[dict], local_experts: dict[str, int]
) -> list[tuple[int, str, torch.Tensor, dict]]:
    found = []
    world = len(optims)
    for g, shapes in enumerate(model["param_shapes"]):
        if isinstance(optims[0]["base_optimizer_state"], list):
            raise CheckpointError(
                "an elastic DeepSpeed checkpoint (zero_optimization.elastic_checkpoint) is not "
                "supported; save it without elastic_checkpoint"
            )
        # An expert group is partitioned over the ranks holding the same experts only.
        spread = optims[0].get("partition_count", [world] * (g + 1))[g]
        ep_size = world // spread
        if ep_size > 1 and not local_experts:
            raise CheckpointError(
                f"param group {g} of the DeepSpeed checkpoint is partitioned over {spread} of "
                f"its {world} ranks (experts spread over ranks), but no expert files "
                "name its experts: zerolap reads such groups only with DeepSpeed's "
                "per-expert files, outside pipelines"
            )
        for e in range(ep_size):
            held = optims[e::ep_size]
            flat = torch.cat([o["single_partition_of_fp32_groups"][g] for o in held])
            state = _concat_states([o["base_optimizer_state"]["state"][g] for o in held])
            paddings = held[0].get("param_alignment_paddings", [None] * (g + 1))[g]
            named = {_global_name(n, e, local_experts): v for n, v in shapes.items()}
            found += [(g, *piece) for piece in _pieces_of(flat, state, named, paddings)]
    return found


def _expert_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every expert file's entries (already under the experts' global names)."""
    out = {}
    for path in sorted(folder.glob(EXPERT_GLOB)):
        if not path.name.endswith("_mp_rank_00_model_states.pt"):
            raise CheckpointError(
                f"{folder} holds experts split by tensor parallelism ({path.name}), which are "
                "not read; zerolap reads DeepSpeed MoE checkpoints saved without it"
            )
        out.update(load_file(path))
    return out


def _local_experts(experts: dict[str, torch.Tensor], ep_size: int) -> dict[str, int]:
    """Per MoE layer (the prefix of its experts' names), the experts each expert-parallel rank
    held."""
    indices: dict[str, set[int]] = {}
    for key in experts:
        match = EXPERT_NAME.fullmatch(key)
        if match is not None:
            indices.setdefault(match.group(1), set()).add(int(match.group(2)))
    return {prefix: len(found) // ep_size for prefix, found in indices.items()}


def _global_name(name: str, ep_rank: int, local_experts: dict[str, int]) -> str:
    """``name`` as expert-parallel rank ``ep_rank`` called it, with its expert's global
    index."""
    match = EXPERT_NAME.fullmatch(name)
    if match is None or match.group(1) not in local_experts:
        return name
    prefix, local, rest = match.groups()
    return f"{prefix}{ep_rank * local_experts[prefix] + int(local)}{rest}"


def _ep_rank_groups(client_groups, ep_rank: int, local_experts: dict[str, int]):
    """The loading client's param groups as DeepSpeed's expert-parallel rank ``ep_rank``
    listed them: its experts (each layer's ``local_experts``, in module order) in place of the
    loading rank's, whatever their number here."""
    out = []
    for group in client_groups:
        # A layer's experts go where its first one was listed; each expert's parameters are
        # its first expert's ``rests`` (the name's tail after the index) in order.
        listed, rests = [], {}
        for name, trains in group:
            match = EXPERT_NAME.fullmatch(name)
            if match is None or match.group(1) not in local_experts:
                listed.append((name, trains))
                continue
            prefix, index, rest = match.groups()
            if prefix not in rests:
                rests[prefix] = (index, [])
                listed.append((prefix, None))
            if rests[prefix][0] == index:
                rests[prefix][1].append((rest, trains))
        group_out = []
        for name, trains in listed:
            if trains is not None:
                group_out.append((name, trains))
                continue
            count = local_experts[name]
            for i in range(count):
                for rest, rest_trains in rests[name][1]:
                    group_out.append((f"{name}{ep_rank * count + i}{rest}", rest_trains))
        out.append(group_out)
    return out


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


def _known_layout(saved: dict) -> bool:
    """Whether a stage-0 optimizer state is one read here: torch's, or DeepSpeed's fused 16-bit
    optimizer's (one flat fp32 buffer per group). The unfused fp16 one (an fp32 copy per
    parameter, ``fp32_groups``) is not."""
    return "param_groups" in saved or "fp32_groups_flat" in saved


def _zero0(
    model: dict, client_groups, saved: dict | None = None
) -> list[tuple[int, str, torch.Tensor, dict]]:
    """Stage 0: the optimizer's entries (``model``'s, or ``saved``) named by the client's param
    groups (names in order, each with whether it trains)."""
    saved = model["optimizer"] if saved is None else saved
    if client_groups is None or saved is None or not _known_layout(saved):
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


def _zero0_experts(
    model: dict, client_groups, folder: Path, local_experts: dict[str, int]
) -> list[tuple[int, str, torch.Tensor, dict]]:
    """Stage 0 under expert parallelism: each expert-parallel rank's optimizer file, named by
    the client's groups as that rank listed them (the dense entries, alike in every file,
    taken from the first)."""
    if client_groups is None:
        return []
    paths = sorted(
        folder.glob(EXPERT_OPTIM_GLOB), key=lambda p: int(re.search(r"expp_rank_(\d+)_", p.name)[1])
    )
    found = []
    for e, path in enumerate(paths):
        groups = _ep_rank_groups(client_groups, e, local_experts)
        entries = _zero0(model, groups, load_file(path)["optimizer"])
        found += [f for f in entries if e == 0 or EXPERT_NAME.fullmatch(f[1])]
    return found


def frozen_pieces(models: list[dict]) -> list[tuple[str, torch.Tensor]]:
    """Stage 3's frozen parameters, reassembled from every rank's fragments."""
    shapes = models[0].get("frozen_param_shapes") or {}
    out = []
    for name, shape in shapes.items():
        numel = math.prod(shape)
        parts = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
        out.append((name, torch.cat(parts)[:numel].float().clone()))
    return out


def loss_scaler_of(optims: list[dict]) -> dict | None:
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


def read_deepspeed(folder: Path, loading: LoadingModel | None = None) -> tuple[dict, list[dict]]:
    """The DeepSpeed checkpoint in ``folder`` as zerolap's (model states, [shard]), named with
    what the ``loading`` engine knows. Optimizer entries that cannot be named are left out and
    their files listed under ``unnamed``, with why, for ``load_checkpoint`` to refuse if it
    needs them."""
    loading = loading or LoadingModel()
    client_groups = loading.client_groups
    layers = _layer_files(folder)
    frozen, unnamed = [], []
    if layers:
        first, optims, stage, params, unnamed = _read_pipeline(folder, layers, loading)
    else:
        zero3_models = files_by_rank(folder, ZERO3_MODEL_GLOB)
        model_paths = zero3_models or [folder / MODEL_FILE]
        models = [load_file(path) for path in model_paths]
        first = models[0]
        experts = _expert_weights(folder)
        if experts:
            first = {**first, "module": {**first["module"], **experts}}
        optims = [
            load_file(path)["optimizer_state_dict"] for path in files_by_rank(folder, OPTIM_GLOB)
        ]
        local_experts = {}
        if experts:
            # The expert-parallel size: the experts' optimizer files (stage 0), or the ranks
            # over the partitions of a ZeRO expert group.
            counts = optims[0].get("partition_count", [len(optims)]) if optims else [1]
            ep_size = len(list(folder.glob(EXPERT_OPTIM_GLOB))) or len(optims) // min(counts)
            local_experts = _local_experts(experts, ep_size)
        if optims and int(optims[0].get("zero_stage", 1)) == 3:
            stage, params = 3, _zero3(first, optims)
            frozen = frozen_pieces(models)
        elif optims:
            stage = int(optims[0].get("zero_stage", 1))
            params = _zero12(first, optims, local_experts)
        elif experts:
            stage, params = 0, _zero0_experts(first, client_groups, folder, local_experts)
        else:
            stage, params = 0, _zero0(first, client_groups)
            if first.get("optimizer") is not None and not _known_layout(first["optimizer"]):
                unnamed = [f"{MODEL_FILE} (an optimizer layout not read: {_UNREAD_LAYOUT})"]
    return zerolap_form(
        first,
        params,
        frozen,
        stage=stage,
        loss_scaler=loss_scaler_of(optims),
        groups=_param_groups(first, optims),
        unnamed=unnamed,
    )


def zerolap_form(
    first: dict,
    params: list[tuple[int, str, torch.Tensor, dict]],
    frozen: list[tuple[str, torch.Tensor]],
    *,
    stage: int,
    loss_scaler: dict | None,
    groups: list[dict],
    unnamed: list[str] | None = None,
) -> tuple[dict, list[dict]]:
    """A DeepSpeed checkpoint as zerolap's (model states, [shard]): ``first`` its (first)
    model-states file, ``params`` (group, name, fp32 values, state) per whole trainable
    parameter, ``frozen`` (name, fp32 values) for stage 3's frozen ones."""
    runs = [
        {"group": g, "segments": [Segment(n, 0, v.numel(), 0)], "values": v, "state": s}
        for g, n, v, s in params
    ]
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
        "loss_scaler": loss_scaler,
        "client_state": {k: v for k, v in first.items() if k not in _DEEPSPEED_KEYS},
        "ds_config": config,
        "unnamed": unnamed or [],
    }
    return saved, [{"runs": runs, "param_groups": groups, "rng": None}]


# -- the pipeline engine's layout ----------------------------------------------------------------


@dataclass(frozen=True)
class LoadingModel:
    """What the loading engine knows that DeepSpeed's files leave unsaid: its client's param
    groups ((name, trains) per parameter, in the client's order), a pipeline model's name
    prefix for each layer's entries, this rank's pipeline stage among how many, and the
    names of its frozen parameters."""

    client_groups: list | None = None
    layer_prefixes: list[str] | None = None
    stage: int = 0
    stages: int = 1
    frozen: frozenset[str] = frozenset()


def _read_pipeline(folder: Path, layers: dict[int, Path], loading: LoadingModel):
    """A pipeline checkpoint as one engine's: (model states, the ZeRO files of the stage whose
    hyperparameters apply, the ZeRO stage, the parameter pieces, the stages whose optimizer
    entries could not be named)."""
    models = _stage_files(folder)
    prefixes = _prefixes(layers, loading.layer_prefixes)
    module = _layer_weights(layers, prefixes)
    optims = [_stage_optims(folder, s, model) for s, model in enumerate(models)]
    # The loading rank's own stage, when the pipeline is cut as it was saved: its param
    # groups' hyperparameters (stages may hold different groups) and its client's names.
    own = loading.stage if loading.stages == len(models) else None
    if any(optims):
        stage = int(optims[0][0].get("zero_stage", 1)) if optims[0] else 1
        pieces, unnamed = [], []
        for s, (model, found) in enumerate(zip(models, optims, strict=True)):
            if not found:
                unnamed.append(_stage_file(s, "no optimizer files"))
            elif "zero_stage" in found[0] and model.get("param_shapes"):
                pieces += _zero12(model, found, {})  # pipelines hold no expert files
            else:  # BF16_Optimizer without ZeRO: flat partitions that nothing names
                unnamed.append(_stage_file(s, "bf16 partitions without ZeRO, not read"))
        params = _first_of_each(pieces)
    else:
        stage = 0
        buffers = {n for model in models for n in model.get("buffer_names") or ()}
        params, unnamed = _pipeline_zero0(models, module, prefixes, buffers, loading, own)
    # Every stage's counters are the same; the weights are the layers', the names every
    # stage's and group's.
    shapes = {
        name: shape
        for model in models
        for group in model.get("param_shapes") or []
        for name, shape in group.items()
    }
    at = own if own is not None else 0
    first = {**models[at], "module": module, "param_shapes": [shapes]}
    return first, optims[at], stage, params, unnamed


def _stage_file(stage: int, why: str) -> str:
    return f"mp_rank_{stage:02d}_model_states.pt (pipeline stage {stage}: {why})"


_UNFIT = (
    "its entries fit no cut of this model's layers in module order, nor this rank's param "
    "groups at the same number of stages"
)
_UNREAD_LAYOUT = "DeepSpeed's unfused fp16 optimizer, an fp32 copy per parameter"

_LAYER_FILE = re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt")


def _layer_files(folder: Path) -> dict[int, Path]:
    """Layer index -> its file, for a pipeline checkpoint (empty for any other). Megatron's
    topology names a model axis even of size 1 (``layer_03-model_00-model_states.pt``)."""
    found = {}
    for path in folder.glob("layer_*-model_states.pt"):
        match = _LAYER_FILE.fullmatch(path.name)
        if match is None or int(match.group(2) or 0) != 0:
            raise CheckpointError(
                f"{folder} is a DeepSpeed pipeline checkpoint with tensor parallelism "
                f"({path.name}): its layers' tensor-parallel pieces are not read; zerolap reads "
                "DeepSpeed pipeline checkpoints saved without tensor parallelism"
            )
        found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def _stage_files(folder: Path) -> list[dict]:
    """Each pipeline stage's model states, in stage order, all of them."""
    numbered = sorted(
        (int(re.search(r"mp_rank_(\d+)_", p.name).group(1)), p)
        for p in folder.glob("mp_rank_*_model_states.pt")
    )
    numbers, paths = [n for n, _ in numbered], [p for _, p in numbered]
    models = [load_file(path) for path in paths]
    dims = (models[0].get("checkpoint_parallel_dimensions") or {}) if models else {}
    stages = dims.get("pp_degree", len(paths))
    if numbers != list(range(stages)):
        raise CheckpointError(
            f"{folder}: a DeepSpeed pipeline checkpoint of {stages} stages needs "
            f"mp_rank_00 to mp_rank_{stages - 1:02d}_model_states.pt; found "
            f"{[p.name for p in paths]}"
        )
    return models


def _stage_optims(folder: Path, stage: int, model: dict) -> list[dict]:
    """Pipeline stage ``stage``'s ZeRO optimizer files, in data-parallel rank order, all of
    them (one per data-parallel rank)."""
    paths = files_by_rank(folder, f"*zero_pp_rank_*_mp_rank_{stage:02d}_optim_states.pt")
    expected = model.get("dp_world_size", len(paths))
    if paths and len(paths) != expected:
        raise CheckpointError(
            f"{folder}: pipeline stage {stage} of this DeepSpeed checkpoint has "
            f"{len(paths)} optimizer files for {expected} data-parallel ranks"
        )
    return [load_file(path)["optimizer_state_dict"] for path in paths]


def _prefixes(layers: dict[int, Path], layer_prefixes: list[str] | None) -> list[str]:
    """Each layer's name prefix: the loading model's, or the layer's index."""
    if layer_prefixes is not None:
        if max(layers) >= len(layer_prefixes):
            raise CheckpointError(
                f"the DeepSpeed pipeline checkpoint has a file for layer {max(layers)}; the "
                f"model here has {len(layer_prefixes)} layers"
            )
        return layer_prefixes
    return [f"{index}." for index in range(1 + max(layers))]


def _layer_weights(layers: dict[int, Path], prefixes: list[str]) -> dict[str, torch.Tensor]:
    """The whole model's state dict from the layer files. A tied module is in the file of
    every layer that calls it without a ``forward_fn``, all equal: the first is kept."""
    module: dict[str, torch.Tensor] = {}
    for index, path in layers.items():
        for key, tensor in load_file(path).items():
            module.setdefault(prefixes[index] + key, tensor)
    return module


def _first_of_each(pieces):
    """Each parameter's first piece: a tied one is in every stage holding it, all equal."""
    seen: set[str] = set()
    out = []
    for piece in pieces:
        if piece[1] not in seen:
            seen.add(piece[1])
            out.append(piece)
    return out


def _stage_params(layer_names: list[list[str]], prefixes, start: int, stop: int) -> list[str]:
    """What a DeepSpeed stage holding layers ``start`` to ``stop`` lists as its parameters:
    its tied modules' first (``tied_modules`` is registered before the layers), then its
    layers', in order. ``layer_names[i]``: layer ``i``'s parameters."""
    tied, own = [], []
    for index in range(start, stop):
        if prefixes[index].startswith("tied_modules."):
            tied += [n for n in layer_names[index] if n not in tied]
        else:
            own += layer_names[index]
    return tied + own


def _fits(saved: dict, groups: list[list[str]], module: dict) -> bool:
    """Whether a stage's saved optimizer holds ``groups`` of parameters: as many groups and
    entries, each per-element state tensor shaped as its parameter (or, for DeepSpeed's
    16-bit optimizer, one flat buffer per group as long as its parameters). Other layouts
    (fp16's unfused optimizer) fit nothing."""
    flat = saved.get("fp32_groups_flat")
    inner = saved.get("optimizer_state_dict", saved) if flat is not None else saved
    if "param_groups" not in inner or len(inner["param_groups"]) != len(groups):
        return False
    if any(n not in module for names in groups for n in names):
        return False  # a parameter the layer files do not hold
    if flat is not None:
        return all(
            f.numel() == sum(module[n].numel() for n in names)
            for f, names in zip(flat, groups, strict=True)
        )
    for group, names in zip(inner["param_groups"], groups, strict=True):
        if len(group["params"]) != len(names):
            return False
        for i, name in zip(group["params"], names, strict=True):
            for value in inner["state"].get(i, {}).values():
                per_element = isinstance(value, torch.Tensor) and value.dim() > 0
                if per_element and value.shape != module[name].shape:
                    return False
    return True


def _split(saved: list, layer_names, prefixes, module, start: int = 0) -> list[int] | None:
    """Where each stage of ``saved`` (their optimizers, in stage order) ends, such that every
    stage's parameters from ``start`` on fit its entries; None when no cut does. A stage may
    end at any of several layers (those without parameters, or calling a tied module it holds
    already): every one is tried, so a wrong early cut cannot strand the later stages."""
    if not saved:
        return [] if start == len(prefixes) else None
    stops = [len(prefixes)] if len(saved) == 1 else range(start, len(prefixes) + 1)
    for stop in stops:
        held = _stage_params(layer_names, prefixes, start, stop)
        if _fits(saved[0], [held], module):
            rest = _split(saved[1:], layer_names, prefixes, module, stop)
            if rest is not None:
                return [stop, *rest]
    return None


def _pipeline_zero0(models, module, prefixes, buffers, loading: LoadingModel, own):
    """Stage 0: each pipeline stage's optimizer, its entries named by the layers the stage
    holds: the cut of the layers into stages whose parameters fit every stage's entries (one
    param group each). Failing that, the loading rank's own stage (``own``, when the pipeline
    is cut as saved) is named by its client's groups. Returns the pieces and the stages left
    unnamed; ``load_checkpoint`` refuses to leave a parameter it steps without its state."""
    layer_names = [
        [n for n in module if n.startswith(prefix) and n not in buffers] for prefix in prefixes
    ]
    saved = [model.get("optimizer") for model in models]
    ends = None if None in saved else _split(saved, layer_names, prefixes, module)
    if ends is None and loading.frozen:
        # A client that gave the optimizer its trainable parameters only (PEFT's way).
        layer_names = [[n for n in names if n not in loading.frozen] for names in layer_names]
        ends = None if None in saved else _split(saved, layer_names, prefixes, module)
    found, unnamed = [], []
    for s, optimizer in enumerate(saved):
        if ends is not None:
            held = _stage_params(layer_names, prefixes, ([0, *ends])[s], ends[s])
            groups = [[(n, True) for n in held]]
        elif s == own and optimizer is not None and loading.client_groups is not None:
            groups = loading.client_groups
            if not _fits(optimizer, [[n for n, _ in g] for g in groups], module):
                unnamed.append(_stage_file(s, _UNFIT))
                continue
        else:
            unnamed.append(_stage_file(s, _UNFIT if optimizer is not None else "no optimizer"))
            continue
        found += _zero0({"module": module, "optimizer": optimizer}, groups)
    return _first_of_each(found), unnamed


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
    return hyperparameters(inner.get("param_groups", []) if isinstance(inner, dict) else [])


def hyperparameters(groups: list[dict]) -> list[dict]:
    """Saved param groups without their parameter indices (and DeepSpeed's unused step)."""
    return [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups]
