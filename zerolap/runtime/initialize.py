"""``zerolap.initialize``: DeepSpeed's entry point, same arguments, same 4-tuple."""

from __future__ import annotations

import torch

import zerolap.comm as dist
from zerolap.config import ConfigError, load_config, parse_config, read_config
from zerolap.moe.utils import configure_moe_param_groups, is_moe_param
from zerolap.pipe.engine import PipelineEngine, check_pipeline_config
from zerolap.pipe.module import PipelineModule
from zerolap.runtime.agreement import check_ranks_agree
from zerolap.runtime.engine import ZerolapEngine
from zerolap.runtime.lr_schedules import build_scheduler
from zerolap.runtime.optimizers import build_optimizer
from zerolap.tensor_parallel.plan import parallelize, plan_from_config
from zerolap.topology import Mesh, build_mesh, mesh_from_mpu, use_mesh
from zerolap.utils import RepeatingLoader
from zerolap.utils.logging import logger

__all__ = ["initialize", "tp_model_init"]

# What ``tp_model_init`` recorded for the next ``initialize``: (tp_size, dtype, tp_group).
_tp_model_init: tuple[int, torch.dtype, object] | None = None


def tp_model_init(model, tp_size: int, dtype: torch.dtype, config=None, **kwargs):
    """DeepSpeed's AutoTP training entry point, which the Hugging Face Trainer calls before
    ``initialize`` when the ds_config has ``tensor_parallel.autotp_size`` > 1. As in DeepSpeed
    0.19, it only records ``tp_size``, ``dtype`` and an optional ``tp_group=`` (``config``, when
    given, must agree with ``tp_size``): the model is
    split at ``initialize``, where the record fills ``tensor_parallel.autotp_size`` when the
    ds_config lacks it and is an error when it disagrees with the ds_config. Returns ``model``
    unchanged."""
    global _tp_model_init
    unknown = sorted(set(kwargs) - {"tp_group"})
    if unknown:
        raise TypeError(f"tp_model_init() got unexpected keyword arguments {unknown}")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init(tp_size={tp_size!r}): a positive integer is needed")
    if config is not None:  # read, not ignored: it must not disagree with tp_size
        given = (read_config(config).get("tensor_parallel") or {}).get("autotp_size")
        if given not in (None, tp_size):
            raise ConfigError(
                f"tp_model_init(tp_size={tp_size}) but its config has "
                f"tensor_parallel.autotp_size={given}"
            )
    _tp_model_init = (tp_size, dtype, kwargs.get("tp_group"))
    return model


_DTYPE_KEYS = {torch.bfloat16: "bf16.enabled", torch.float16: "fp16.enabled"}


def _merge_tp_model_init(ds_config: dict, mpu) -> dict:
    """``ds_config`` with what ``tp_model_init`` recorded merged in (and the record consumed)."""
    global _tp_model_init
    if _tp_model_init is None:
        return ds_config
    (size, dtype, group), _tp_model_init = _tp_model_init, None
    section = dict(ds_config.get("tensor_parallel") or {})
    given = section.get("autotp_size")
    if given not in (None, size):
        raise ConfigError(
            f"tensor_parallel.autotp_size={given} but tp_model_init(tp_size={size}); make them "
            "agree"
        )
    wanted = _DTYPE_KEYS.get(dtype)
    enabled = {key for key in _DTYPE_KEYS.values() if _enabled(ds_config, key)}
    if enabled != ({wanted} if wanted else set()):
        raise ConfigError(
            f"tp_model_init(dtype={dtype}) but the ds_config enables "
            f"{', '.join(sorted(enabled)) or 'neither bf16 nor fp16 (fp32)'}"
        )
    if group is not None:
        if mpu is not None:
            raise ConfigError("tp_model_init(tp_group=...) and initialize(mpu=...): pass one")
        _check_tp_group(group, size)
    return {**ds_config, "tensor_parallel": {**section, "autotp_size": size}}


def _enabled(ds_config: dict, key: str) -> bool:
    section, _, field = key.partition(".")
    return (ds_config.get(section) or {}).get(field) is True


def _check_tp_group(group, size: int) -> None:
    """zerolap builds its own groups, with tensor ranks consecutive: a given group must be
    this rank's group of that layout."""
    ranks = dist.get_all_ranks_from_group(group)
    start = dist.get_rank() // size * size
    if ranks != list(range(start, start + size)):
        raise ConfigError(
            f"tp_model_init(tp_group=ranks {ranks}): zerolap's tensor groups are consecutive "
            f"ranks; rank {dist.get_rank()} would be in ranks {list(range(start, start + size))}"
        )


def _config_source(args, config, config_params):
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    given = config if config is not None else config_params
    if given is not None and from_args is not None:
        raise ConfigError(
            "a ds_config was given twice: as initialize(config=...) and as "
            f"--deepspeed_config {from_args}; pass one"
        )
    source = given if given is not None else from_args
    if source is None:
        raise ConfigError(
            "no ds_config: pass initialize(config=dict or JSON path) or --deepspeed_config"
        )
    return source


def _optimizer_factory(optimizer, model_parameters, cfg):
    """What builds the optimizer over the engine's parameters; None when there is none to
    build (no ``optimizer=`` and no ds_config ``optimizer``): the engine then runs forward
    only."""
    if optimizer is None and cfg.optimizer is None:
        return None

    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        wanted = model_parameters if model_parameters is not None else params
        if isinstance(optimizer, torch.optim.Optimizer):
            if cfg.optimizer is not None and dist.get_rank() == 0:
                logger.warning(
                    "the optimizer passed to initialize() overrides ds_config's "
                    f"optimizer.type={cfg.optimizer.type}"
                )
            return optimizer
        if callable(optimizer):
            return optimizer(wanted)
        return build_optimizer(cfg.optimizer.type, cfg.optimizer.params, _expert_groups(wanted))

    return make


def _expert_groups(model_parameters):
    """``model_parameters`` with the experts in optimizer groups of their own, as DeepSpeed
    builds a ds_config optimizer for a model with experts (so the param groups, a scheduler's
    ``base_lrs`` and a checkpoint's groups line up with DeepSpeed's); as given otherwise, and
    for groups without the ``name`` the split copies (DeepSpeed fails on those; the engine
    reduces experts by their mark whatever their group)."""
    listed = list(model_parameters)
    groups = [item for item in listed if isinstance(item, dict)]
    params = [p for g in groups for p in g["params"]]
    params += [item for item in listed if not isinstance(item, dict)]
    if not any(is_moe_param(p) for p in params) or any("name" not in g for g in groups):
        return listed
    return configure_moe_param_groups(listed)


def _scheduler_factory(lr_scheduler, cfg):
    def make(inner: torch.optim.Optimizer):
        if lr_scheduler is not None and not callable(getattr(lr_scheduler, "step", None)):
            return lr_scheduler(inner)  # a factory
        if lr_scheduler is not None:
            return lr_scheduler
        if cfg.scheduler is not None:
            return build_scheduler(cfg.scheduler.type, cfg.scheduler.params, inner)
        return None

    return make


def _mesh(tp, mpu, model) -> tuple[Mesh, dict[int, torch.nn.Parameter]]:
    """The job's mesh, and the model split for tensor parallelism when the ds_config asks;
    with the split parameters that replaced dense ones, by ``id`` of the dense one."""
    if isinstance(model, PipelineModule):
        mesh = build_mesh(tp.size, pipe=model.num_stages)
    elif mpu is None:
        mesh = build_mesh(tp.size)
    else:
        mesh = mesh_from_mpu(mpu)
        if tp.size > 1 and mesh.dims.sequence > 1:
            raise ConfigError(
                f"tensor_parallel.autotp_size={tp.autotp_size} with sequence parallelism (the "
                f"mpu's sequence-parallel size is {mesh.dims.sequence}): zerolap's sequence "
                "parallelism runs with data parallelism only"
            )
        if tp.size > 1 and tp.size != mesh.dims.tensor:
            raise ConfigError(
                f"tensor_parallel.autotp_size={tp.autotp_size} but the mpu's model-parallel size "
                f"is {mesh.dims.tensor}"
            )
    if tp.size == 1:
        return mesh, {}
    dense = dict(model.named_parameters(remove_duplicate=False))
    if isinstance(model, PipelineModule):
        _split_stages(model, mesh, tp)
    else:
        parallelize(model, mesh.tensor_group, plan_from_config(tp, model), overlap=tp.overlap_mode)
    split = dict(model.named_parameters(remove_duplicate=False))
    return mesh, {id(dense[n]): p for n, p in split.items() if dense.get(n) is not p}


def _split_stages(model: PipelineModule, mesh: Mesh, tp) -> None:
    """Each pipeline stage split by the plan; the stages agree on the outcome before going on
    (a stage may match nothing, the whole model must match something, and one stage's error
    is every stage's)."""
    problem = None
    try:
        plan = plan_from_config(tp, model)
        parallelize(model, mesh.tensor_group, plan, overlap=tp.overlap_mode, match_required=False)
    except ValueError as err:
        problem = str(err)
    pieces = sum(1 for p in model.parameters() if getattr(p, "tp_split", None) is not None)
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, (problem, pieces))
    for rank, (why, _) in enumerate(views):
        if why is not None:
            raise ConfigError(f"tensor parallelism on pipeline rank {rank}: {why}")
    if not any(count for _, count in views):
        raise ConfigError(
            "tensor parallelism: the plan matched no module of any pipeline stage; give "
            "tensor_parallel.partition_config.layer_specs naming its layers' weights"
        )


def _to_split(model_parameters, optimizer, replaced: dict[int, torch.nn.Parameter]):
    """``model_parameters`` and an optimizer instance, both made before ``initialize`` split
    the model (the Hugging Face Trainer makes them so), pointed at the split parameters."""
    if not replaced:
        return model_parameters
    if isinstance(optimizer, torch.optim.Optimizer):
        if any(id(p) in replaced for p in optimizer.state):
            raise ConfigError(
                "the optimizer passed to initialize() already holds state for parameters that "
                "tensor parallelism splits; pass it before its first step"
            )
        for group in optimizer.param_groups:
            group["params"] = [replaced.get(id(p), p) for p in group["params"]]
    if model_parameters is None:
        return None
    out = []
    for item in model_parameters:
        if isinstance(item, dict):  # a parameter group
            item = {**item, "params": [replaced.get(id(p), p) for p in item["params"]]}
        else:
            item = replaced.get(id(item), item)
        out.append(item)
    return out


def initialize(
    args=None,
    model: torch.nn.Module | None = None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: int = 29500,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
):
    """Wrap ``model`` in a ``ZerolapEngine``; returns ``(engine, optimizer, training_dataloader,
    lr_scheduler)`` (the last two None when not asked for).

    ``optimizer`` and ``lr_scheduler`` may be instances or callables (called with the model
    parameters and with the optimizer); given ones override the ds_config's. With neither an
    optimizer passed nor one in the ds_config, the engine runs forward only (evaluation,
    reference models); ``engine.optimizer`` is then None.

    Tensor parallelism comes from the ds_config (``tensor_parallel.autotp_size``: the model is
    split here, by its plan) or from a Megatron-style ``mpu`` whose groups describe a model the
    caller split already; ZeRO then works over the data-parallel group only. ``mesh_param``
    (DeepSpeed's DeviceMesh shape) is not supported and must be None.
    """
    if model is None:
        raise ValueError("initialize() needs model=")
    if mesh_param is not None:
        raise ValueError(
            "initialize(mesh_param=...): zerolap takes its mesh from tensor_parallel.autotp_size "
            "or an mpu; pass mesh_param=None"
        )
    if not dist.is_initialized():
        if dist_init_required is False:
            raise RuntimeError(
                "dist_init_required=False but no process group exists: call "
                "zerolap.init_distributed() first"
            )
        dist.init_distributed(distributed_port=distributed_port, verbose=False)
    source = _config_source(args, config, config_params)
    ds_config = read_config(source)
    merged = _merge_tp_model_init(ds_config, mpu)
    if merged is not ds_config:
        source = ds_config = merged
    try:
        parsed, invalid = parse_config(source), None
    except ConfigError as error:
        parsed, invalid = None, error
    check_ranks_agree(parsed, model, invalid)  # before any collective the job shapes
    check_pipeline_config(parsed, model, mpu)
    mesh, replaced = _mesh(parsed.tensor_parallel, mpu, model)
    model_parameters = _to_split(model_parameters, optimizer, replaced)
    cfg = load_config(source, world_size=mesh.dims.data)
    dist.configure(cfg.comms_logger)
    engine_class = PipelineEngine if isinstance(model, PipelineModule) else ZerolapEngine
    engine = engine_class(
        module=model,
        config=cfg,
        ds_config=ds_config,
        make_optimizer=_optimizer_factory(optimizer, model_parameters, cfg),
        optimizer_name=cfg.optimizer.type.lower() if optimizer is None and cfg.optimizer else None,
        make_scheduler=_scheduler_factory(lr_scheduler, cfg),
        mesh=mesh,
    )
    use_mesh(mesh)
    engine.collate_fn = collate_fn
    loader = None
    if training_data is not None and isinstance(engine, PipelineEngine):
        # A pipeline reads the data in order and returns a loader that starts over when it
        # ends, as DeepSpeed's pipeline engine does (its other engines shuffle).
        in_order = torch.utils.data.DistributedSampler(
            training_data,
            num_replicas=engine.dp_world_size,
            rank=engine.get_data_parallel_rank(),
            shuffle=False,
        )
        loader = RepeatingLoader(engine.deepspeed_io(training_data, data_sampler=in_order))
        engine.set_dataiterator(iter(loader))  # train_batch() without data_iter
    elif training_data is not None:
        loader = engine.deepspeed_io(training_data)
    return engine, engine.optimizer, loader, engine.lr_scheduler
