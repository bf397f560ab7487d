"""DeepSpeed's "universal" checkpoints, the layout its ``ds_to_universal`` converter writes.

DeepSpeed loads a checkpoint only at the data-parallel size it was saved at; to change it, its
users convert the checkpoint (``python -m deepspeed.checkpoint.ds_to_universal --input_folder
ckpt/global_step100 --output_folder ckpt/global_step100_universal``) and resume with ds_config's
``checkpoint.load_universal``. The converted folder holds every parameter whole::

    <save_dir>/latest_universal              the converted tag (``load_universal`` reads it)
    <tag>/mp_rank_00_model_states.pt         the model states, copied (stage 3: each rank's
                                             zero_pp_rank_<r>_mp_rank_00_model_states.pt)
    <tag>/zero/optimizer_state.pt            the optimizer's scalars: param groups, loss scaler,
                                             ZeRO stage (stage 3: rank 0's whole optimizer file)
    <tag>/zero/<name>/fp32.pt                the parameter's fp32 values, and one file per Adam
    <tag>/zero/<name>/exp_avg.pt             state, each ``{"param": tensor, "cat_dim": 0}``
    <tag>/zero/<name>/exp_avg_sq.pt          (stages 1-2, shaped) or a bare flat tensor (stage 3)
    <tag>/zero/<name>/step.pt                the step count (stages 1-2; at stage 3 it is in
                                             optimizer_state.pt, per sub-group)

zerolap reads it like DeepSpeed's own layout (``checkpoint.deepspeed_format``): each parameter
is already whole, so it loads at any world size and stage. The universal checkpoints of pipeline
or Megatron tensor-parallel runs (a model-states file per stage or rank) are refused by name.

``write_universal`` (``python -m deepspeed.checkpoint.ds_to_universal`` under the shim) writes
the layout from any checkpoint zerolap reads, its own included, so that real DeepSpeed resumes
a zerolap run at any data-parallel size (``load_universal``), at ZeRO stages 1-3 with its own
optimizers and at stages 1-2 with a client's torch optimizer. The files are
what both of DeepSpeed's loaders look for: the model states under the stage-1/2 name and the
stage-3 one, the step beside each parameter (stages 1-2, a tensor as torch's Adam needs) and
in ``optimizer_state.pt`` (stage 3, an int: DeepSpeed hands that one object to every
sub-group). What DeepSpeed does not take back: its loss-scaler object (an fp16 run restarts
its dynamic scale), frozen parameters and buffers (its universal load leaves them as the model
has them), and at stage 3 the param groups' own hyperparameters (it gives every group the
first one's) and a client's torch optimizer (which refuses the int step); the conversion warns
about these two.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import shutil
import socket
import sys
import uuid
from pathlib import Path

import torch

from zerolap.aliases import DEEPSPEED_API
from zerolap.checkpoint.deepspeed_format import (
    EXPERT_NAME,
    ZERO3_MODEL_GLOB,
    files_by_rank,
    frozen_pieces,
    hyperparameters,
    load_file,
    loss_scaler_of,
    zerolap_form,
)
from zerolap.checkpoint.files import (
    MODEL_FILE,
    CheckpointError,
    logger,
    read_checkpoint,
    try_write,
    write_checksums,
    write_text,
)
from zerolap.checkpoint.shards import SavedParams, Segment, SegmentIndex, gather_state

__all__ = ["LATEST_UNIVERSAL", "is_universal_checkpoint", "read_universal", "write_universal"]

LATEST_UNIVERSAL = "latest_universal"
ZERO3_MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # the name stage 3 loads
STATES_DIR = "zero"
GLOBAL_STATE = "optimizer_state.pt"
_VALUES, _STEP = "fp32", "step"


def is_universal_checkpoint(folder: Path) -> bool:
    return (folder / STATES_DIR / GLOBAL_STATE).is_file()


def _tensor(path: Path, numel: int) -> torch.Tensor:
    """One per-element state of a parameter, flat, checked against the parameter's size."""
    loaded = load_file(path)
    tensor = loaded.get("param") if isinstance(loaded, dict) else loaded
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"{path} holds no tensor (expected a tensor or {{'param': tensor}})")
    if tensor.numel() != numel:
        raise CheckpointError(
            f"{path} holds {tensor.numel()} elements; the parameter has {numel}: the file is "
            "from another model, or the checkpoint from a tensor-parallel run (not read)"
        )
    return tensor.reshape(-1)


def _parameter(folder: Path, name: str, shape, step) -> tuple[torch.Tensor, dict]:
    """A parameter's fp32 values and optimizer state from ``zero/<name>/`` (``step``: the
    step count stage 3 keeps outside the parameter's folder, else None)."""
    where = folder / STATES_DIR / name
    numel = math.prod(shape)
    if not (where / f"{_VALUES}.pt").is_file():
        raise CheckpointError(
            f"universal checkpoint {folder}: {where / f'{_VALUES}.pt'} is missing"
        )
    values = _tensor(where / f"{_VALUES}.pt", numel).float().clone()
    state = {}
    for path in sorted(where.glob("*.pt")):
        if path.stem not in (_VALUES, _STEP):
            state[path.stem] = _tensor(path, numel).float().clone()
    if (where / f"{_STEP}.pt").is_file():
        step = load_file(where / f"{_STEP}.pt")
    if state:
        if step is None:
            raise CheckpointError(
                f"universal checkpoint {folder}: {where} has optimizer state but no step count"
            )
        state[_STEP] = torch.tensor(float(step), dtype=torch.float32)
    return values, state


def _frozen(folder: Path, first: dict, models: list[dict], stage: int):
    """The frozen parameters: from ``zero/`` where the converter wrote them (DeepSpeed's at
    stages 1-2, zerolap's always), else stage 3's fragments in the model files; at stages 1-2
    without files, the copied module holds them whole."""
    shapes = first.get("frozen_param_shapes") or {}
    found = [n for n in shapes if (folder / STATES_DIR / n / f"{_VALUES}.pt").is_file()]
    if stage == 3 and len(found) < len(shapes):
        return frozen_pieces(models)
    return [
        (n, _tensor(folder / STATES_DIR / n / f"{_VALUES}.pt", math.prod(shapes[n])).float())
        for n in found
    ]


def _required(saved: dict, key: str, path: Path):
    if key not in saved:
        raise CheckpointError(f"universal checkpoint file {path} has no {key!r}")
    return saved[key]


def read_universal(folder: Path) -> tuple[dict, list[dict]]:
    """The universal checkpoint in ``folder`` as zerolap's (model states, [shard])."""
    zero3_models = files_by_rank(folder, ZERO3_MODEL_GLOB)
    model_paths = zero3_models or [folder / MODEL_FILE]
    if not model_paths[0].is_file():
        raise CheckpointError(
            f"universal checkpoint {folder}: neither {MODEL_FILE} nor {ZERO3_MODEL_GLOB} is there "
            "(ds_to_universal copies the model states beside zero/)"
        )
    if any("_mp_rank_00_" not in f"_{p.name}" for p in folder.glob("*mp_rank_*_model_states.pt")):
        raise CheckpointError(
            f"universal checkpoint {folder} has one model-states file per pipeline stage or "
            "tensor-parallel rank (mp_rank_01_...): such checkpoints are not read"
        )
    models = [load_file(path) for path in model_paths]
    first = models[0]
    shapes = _required(first, "param_shapes", model_paths[0])
    if first.get("module") is None:
        raise CheckpointError(f"universal checkpoint file {model_paths[0]} holds no module")
    path = folder / STATES_DIR / GLOBAL_STATE
    scalars = load_file(path)
    stage = int(scalars.get("zero_stage", 3 if zero3_models else 2))
    params = []
    if stage == 3:
        # param_shapes lists sub-groups; the optimizer's groups list the sub-groups they hold.
        inner = _required(scalars, "optimizer_state_dict", path)
        group_of = {i: g for g, pg in enumerate(inner["param_groups"]) for i in pg["params"]}
        for i, sub_group in enumerate(shapes):
            step = inner["state"].get(i, {}).get(_STEP)
            for name, shape in sub_group.items():
                params.append((group_of.get(i, 0), name, *_parameter(folder, name, shape, step)))
    else:
        for g, group in enumerate(shapes):
            for name, shape in group.items():
                params.append((g, name, *_parameter(folder, name, shape, None)))
    groups = scalars.get("param_groups") or scalars.get("optimizer_state_dict", {}).get(
        "param_groups", []
    )
    return zerolap_form(
        first,
        params,
        _frozen(folder, first, models, stage),
        stage=stage,
        loss_scaler=loss_scaler_of([scalars]),
        groups=hyperparameters(groups),
    )


# -- writing ----------------------------------------------------------------------------------


def _groups_of(saved: dict, shards: list[dict]) -> list[dict[str, torch.Size]]:
    """The trainable parameters' shapes per optimizer param group, in the checkpoint's order
    (DeepSpeed's ``param_shapes``)."""
    group_of = {}
    for shard in shards:
        for run in shard["runs"]:
            if run["group"] >= 0:
                group_of.update((segment.name, run["group"]) for segment in run["segments"])
    groups: list[dict[str, torch.Size]] = [
        {} for _ in range(max(group_of.values(), default=-1) + 1)
    ]
    for name in saved["param_names"]:
        if name in group_of:
            groups[group_of[name]][name] = torch.Size(saved["param_shapes"][name])
    return groups


def _model_states(saved: dict, groups: list[dict], shapes: dict) -> dict:
    """DeepSpeed's model-states file for ``saved``: what its engine reads back (counters,
    scheduler, client state) and what describes the model (shapes, ties, buffers). The
    module is the source's as saved (DeepSpeed's universal load does not read it, zerolap's
    reads its buffers)."""
    aliases = {k: v for k, v in saved["aliases"].items() if k != v}
    params = set(saved["aliases"]) | set(saved["frozen"])
    return {
        **saved["client_state"],
        "module": saved["module"],
        "buffer_names": [key for key in saved["module"] if key not in params],
        "param_shapes": groups,
        "frozen_param_shapes": {n: torch.Size(shapes[n]) for n in saved["frozen"]},
        "shared_params": aliases,
        "lr_scheduler": saved["lr_scheduler"],
        "global_steps": saved["global_steps"],
        "global_samples": saved["global_samples"],
        "skipped_steps": saved["skipped_steps"],
        "dp_world_size": saved["world_size"],
        "mp_world_size": 1,
        "ds_config": saved.get("ds_config") or {},
        "ds_version": DEEPSPEED_API,
    }


class _Files:
    """The conversion's files under ``root``, each written whole (``try_write``: a full disk is
    named with the bytes short), their digests kept for ``checksums.json``, which zerolap's
    loads verify as they do for its own checkpoints."""

    def __init__(self, root: Path, what: str) -> None:
        self.root, self.what, self.digests = root, what, {}

    def put(self, obj, name: str) -> None:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        found, problem = try_write(obj, path)
        if problem is not None:
            raise CheckpointError(f"{self.what}: {problem}")
        self.digests[name] = found


def _write_parameter(files: _Files, name: str, values: torch.Tensor, state: dict) -> int | None:
    """``zero/<name>/``: the fp32 values and each per-element state, shaped, as DeepSpeed's
    converter writes them (``cat_dim`` on those the optimizer steps); the step count
    (returned) beside them, as a tensor: torch's Adam requires one, and DeepSpeed's fused Adam
    takes one too."""
    where = f"{STATES_DIR}/{name}"
    files.put({"param": values, **({"cat_dim": 0} if state else {})}, f"{where}/{_VALUES}.pt")
    step = None
    for key, value in state.items():
        if key == _STEP:
            step = int(value.item() if isinstance(value, torch.Tensor) else value)
            files.put(torch.tensor(float(step)), f"{where}/{_STEP}.pt")
        elif isinstance(value, torch.Tensor) and value.numel() == values.numel():
            files.put(
                {"param": value.float().view(values.shape), "cat_dim": 0}, f"{where}/{key}.pt"
            )
    return step


def _refuse(folder: Path, saved: dict, groups: list[dict]) -> None:
    """Sources whose conversion DeepSpeed would misread, or that have nothing to convert."""
    if saved.get("unnamed") or not groups:
        raise CheckpointError(
            f"{folder} holds no optimizer state named by parameter: it was saved without an "
            "optimizer, or by DeepSpeed at stage 0, whose files list it by position only (load "
            "that into a zerolap engine, save, and convert the save)"
        )
    experts = [name for name in saved["param_names"] if EXPERT_NAME.fullmatch(name)]
    if experts:
        raise CheckpointError(
            f"{folder} holds mixture-of-experts parameters ({experts[0]}, ...): DeepSpeed's "
            "universal load looks experts up by each rank's local names, not these global ones"
        )


def _stage3_warnings(saved: dict, hyper: list[dict]) -> list[str]:
    """What DeepSpeed's ZeRO-3 universal load would change in this run: it gives every param
    group the first group's hyperparameters, and every sub-group one step count, an int,
    which torch's Adam refuses (DeepSpeed's own optimizers take it)."""
    found = []
    first = {k: v for k, v in hyper[0].items() if k != "params"}
    for g, group in enumerate(hyper[1:], 1):
        changed = sorted(k for k, v in group.items() if k != "params" and first.get(k) != v)
        if changed:
            found.append(
                f"param group {g} differs from group 0 in {changed}: DeepSpeed's ZeRO-3 "
                "universal load gives every group group 0's hyperparameters; resume it at "
                "stage 1 or 2, or set them again after the load"
            )
            break
    if not (saved.get("ds_config") or {}).get("optimizer"):
        found.append(
            "the run stepped its client's own optimizer: DeepSpeed resumes a torch optimizer "
            "from this at ZeRO stages 1-2; its ZeRO-3 universal load gives the step as an int, "
            "which torch's Adam refuses"
        )
    return found


def write_universal(folder: Path, output: Path) -> None:
    """The checkpoint in ``folder`` (zerolap's or DeepSpeed's) in the universal layout at
    ``output``, then ``latest_universal`` beside it naming it. Files are read memory-mapped
    and one parameter is assembled at a time. The output appears whole or not at all; call
    it from one process."""
    folder, output = Path(folder), Path(output)
    if output.exists():
        raise CheckpointError(f"{output} exists: name a new folder for the universal checkpoint")
    saved, shards = read_checkpoint(folder)
    index = SegmentIndex(shards)
    params = SavedParams(saved, index)
    groups = _groups_of(saved, shards)
    _refuse(folder, saved, groups)
    hyper = [{**group, "params": [g]} for g, group in enumerate(shards[0]["param_groups"])]
    for warning in _stage3_warnings(saved, hyper):
        logger.warning(f"{output}: {warning}")
    staged = None
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        staged = _staging_folder(output)
        files = _Files(staged, f"converting {folder} to {output}")
        steps, written = [], set()
        for name in dict.fromkeys([*saved["param_names"], *saved["frozen"]]):
            if params.has(name):
                values = params.whole_fp32(name)
                segments = [Segment(name, 0, values.numel(), 0)]
                state = gather_state(values.numel(), torch.float32, segments, index)
                steps.append(_write_parameter(files, name, values, state))
                written.add(name)
        # As DeepSpeed's converter: every other module entry's values too (tied aliases,
        # buffers), which its loaders ignore.
        for key, tensor in saved["module"].items():
            source = saved["aliases"].get(key)
            if key in written or (source is None and not isinstance(tensor, torch.Tensor)):
                continue
            values = params.whole_fp32(source) if source in written else tensor.float()
            files.put({"param": values}, f"{STATES_DIR}/{key}/{_VALUES}.pt")
        step = max((s for s in steps if s is not None), default=0)
        scalars = {
            "zero_stage": 2,  # the layout of param_shapes and step.pt, whatever stage saved it
            "param_groups": hyper,
            "ds_version": DEEPSPEED_API,
            # DeepSpeed's stage 3 takes the step and hyperparameters from here, and hands
            # this one object to every sub-group: an int, which each increments on its own (a
            # tensor would be incremented in place once per sub-group).
            "optimizer_state_dict": {
                "state": {g: {_STEP: step} for g in range(len(hyper))},
                "param_groups": hyper,
            },
        }
        files.put(scalars, f"{STATES_DIR}/{GLOBAL_STATE}")
        files.put(_model_states(saved, groups, params.shapes), MODEL_FILE)
        try:  # the name stage 3 reads
            os.link(staged / MODEL_FILE, staged / ZERO3_MODEL_FILE)
        except OSError:  # a filesystem without hard links
            shutil.copyfile(staged / MODEL_FILE, staged / ZERO3_MODEL_FILE)
        files.digests[ZERO3_MODEL_FILE] = files.digests[MODEL_FILE]
        identity = {"id": uuid.uuid4().hex, "tag": output.name, "step": saved["global_steps"]}
        write_checksums(staged, identity, files.digests)
        if output.exists():  # (a rename onto an empty folder would replace it silently)
            raise CheckpointError(f"{output} appeared while this conversion ran; nothing written")
        os.rename(staged, output)
    except BaseException as err:
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
        # A folder that cannot be written (OSError), a full disk (torch.save's RuntimeError).
        if isinstance(err, (OSError, RuntimeError)) and not isinstance(err, CheckpointError):
            raise CheckpointError(f"converting {folder} to {output}: {err}") from err
        raise
    try:
        write_text(output.parent / LATEST_UNIVERSAL, output.name)
    except OSError as err:
        raise CheckpointError(
            f"{output} is written, but {output.parent / LATEST_UNIVERSAL} could not be: {err}; "
            "load it by its tag"
        ) from err


def _staging_folder(output: Path) -> Path:
    """A new folder beside ``output`` for this conversion to write into, named with this host,
    this process and a random part; the folders of killed conversions of ``output`` on this
    host are removed (those of running ones, or of other hosts, are left alone)."""
    host, prefix = socket.gethostname(), f".{output.name}.partial-"
    for stale in output.parent.glob(f"{glob.escape(prefix)}*"):
        owner = stale.name.removeprefix(prefix).rsplit("-", 2)  # host names may hold "-"
        mine = len(owner) == 3 and owner[0] == host and owner[1].isdigit()
        if mine and not _alive(int(owner[1])):
            shutil.rmtree(stale, ignore_errors=True)
    staged = output.parent / f"{prefix}{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staged.mkdir()
    return staged


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def main(argv: list[str] | None = None) -> None:
    """``python -m deepspeed.checkpoint.ds_to_universal --input_folder ckpt/global_step100
    --output_folder ckpt/global_step100_universal``, with DeepSpeed's options."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--input_folder", type=Path, required=True, help="a checkpoint's tag")
    parser.add_argument("--output_folder", type=Path, required=True, help="a new folder")
    tuning = "DeepSpeed's option; zerolap converts in one pass, one parameter at a time"
    parser.add_argument("--num_extract_workers", type=int, help=tuning)
    parser.add_argument("--num_merge_workers", type=int, help=tuning)
    parser.add_argument("--keep_temp_folder", action="store_true", help=tuning)
    parser.add_argument(
        "--no_strict",
        action="store_true",
        help="DeepSpeed's option on Megatron's tensor-parallel layout notes; zerolap reads none",
    )
    parser.add_argument(
        "--inject_missing_state",
        action="store_true",
        help="DeepSpeed's option for checkpoints without Megatron's layout notes; zerolap "
        "needs none",
    )
    args = parser.parse_args(argv)
    moot = [
        f"--{key}"
        for key in ("num_extract_workers", "num_merge_workers", "keep_temp_folder", "no_strict")
        if getattr(args, key) not in (None, False)
    ]
    if moot:
        print(f"{', '.join(moot)}: no effect on zerolap's conversion", file=sys.stderr)
    write_universal(args.input_folder, args.output_folder)
    print(f"{args.output_folder}: written; {LATEST_UNIVERSAL} names it")


if __name__ == "__main__":
    main()
