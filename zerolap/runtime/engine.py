"""``ZerolapEngine``: DeepSpeed's engine interface, orchestrating and nothing else.

Data flows one way: the model's parameters are laid out in flat buckets (``zero.layout``), the
reducer's hooks move gradients into buckets and launch their collectives during backward
(``zero.reducer``), the sharded optimizer steps on the owned elements and all-gathers the result
(``zero.optimizer``). The stage decides which components are built (``zero.stages``), once.

An engine without an optimizer (none passed to ``initialize`` and none in the ds_config, or a
model with nothing to train) runs forward only: evaluation, prediction, and the reference,
reward and EMA models of RLHF trainers. It builds no gradient buffers, reducer or optimizer;
under stage 3 it still shards every parameter and gathers each module's just in time.
"""

from __future__ import annotations

import contextlib
import json
import time
import weakref
from collections import OrderedDict
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import zerolap.accelerator as accelerator
import zerolap.comm as dist
from zerolap import checkpointing
from zerolap.accelerator import get_accelerator
from zerolap.config import ConfigError, ZerolapConfig
from zerolap.config.precision import torch_dtype
from zerolap.moe.parallel import (
    expert_buffers,
    expert_parallel_size,
    set_up_expert_parallelism,
)
from zerolap.offload import plan_offload
from zerolap.offload.states import NEEDED, OffloadStateTypeEnum, ParkedGuard
from zerolap.runtime import python_gc
from zerolap.runtime.buffer_dtypes import fp32_buffers
from zerolap.runtime.flops_profiling import StepFlopsProfile
from zerolap.runtime.inputs import check_same_inputs
from zerolap.runtime.loss_scaler import build_loss_scaler
from zerolap.runtime.memory import MemoryBreakdown, measure_memory
from zerolap.runtime.monitoring import TrainingEvents, start_monitors
from zerolap.runtime.nonfinite import NonFiniteGuard
from zerolap.runtime.norm_share import counted_in_norm
from zerolap.runtime.release import Attachments, take_over
from zerolap.runtime.throughput import ThroughputTimer
from zerolap.runtime.timers import WallClockBreakdown
from zerolap.runtime.utils import see_memory_usage
from zerolap.topology import Mesh, build_mesh
from zerolap.utils.data import ROUTE_TRAIN, make_loader
from zerolap.utils.logging import logger, set_log_level_from_string
from zerolap.zero.external import ensure_registry
from zerolap.zero.fetcher import ParamFetcher
from zerolap.zero.flat_params import FlatParams
from zerolap.zero.grad_storage import FullGradients, ShardGradients
from zerolap.zero.in_flight import ForwardWaits
from zerolap.zero.layout import FlatLayout, build_layout, coalesce, layout_from_groups
from zerolap.zero.leaf_modules import apply_granularity_threshold, apply_leaf_config
from zerolap.zero.optimizer import ZeroOptimizer
from zerolap.zero.param_access import ParamAccess
from zerolap.zero.reducer import GradReducer
from zerolap.zero.reductions import AllReduceBuckets, ReduceScatterBuckets, scale_factors
from zerolap.zero.sharded_params import ShardedParams
from zerolap.zero.stages import plan_stage
from zerolap.zero.status import is_sharded
from zerolap.zero.step_behind import can_defer
from zerolap.zero.units import plan_units

__all__ = ["DeepSpeedEngine", "ZerolapEngine"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _runs_of_a_kind(items, kind) -> list[list]:
    """``items`` cut into maximal runs of consecutive items of the same ``kind(item)``."""
    runs: list[list] = []
    for item in items:
        if runs and kind(runs[-1][-1]) == kind(item):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


class _PhaseRecorders(list):
    """The engine's phase recorders, called as one. Parts that report phases (the fetcher)
    get this list, not a bound method of the engine: the model reaches those parts through
    its hooks, and must not keep a dropped engine alive."""

    def __call__(self, phase: str, start: float, end: float, compute: bool = True) -> None:
        for recorder in self:
            recorder.record(phase, start, end, compute)


def trainable_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters that train, deduplicated (tied weights once), in the order their gradients
    are expected in backward: the reverse of registration."""
    return [p for p in reversed(list(module.parameters())) if p.requires_grad]


class _Entry(torch.autograd.Function):
    """Identity on the engine's outputs; in backward, the point where gradients enter the
    model, once each, whatever depends on what inside it (a model's loss output computed from
    its logits output): scaled there by ``engine._entry_factor()``."""

    @staticmethod
    def forward(ctx, engine, *tensors):
        ctx.engine = engine
        ctx.set_materialize_grads(False)
        # New tensors sharing storage and version counter, not views: a client may change an
        # output in place (the Trainer scales its loss with ``loss *= ...``), which autograd
        # forbids on the views a multi-output Function returns.
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        factor = ctx.engine._entry_factor()
        scaled = (g if g is None or factor == 1.0 else g * factor for g in grads)
        return (None, *scaled)


def _through_entry(engine, out):
    """``out`` with each tensor that requires grad passed through one ``_Entry``."""
    leaves, spec = tree_flatten(out)
    wanted = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wanted:
        return out
    entered = _Entry.apply(engine, *(leaves[i] for i in wanted))
    for i, tensor in zip(wanted, entered, strict=True):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)


_SHARD_BY_DATA_RANK = (
    "shard the data over the data-parallel ranks (engine.mpu.get_data_parallel_rank() / "
    "get_data_parallel_world_size())"
)


class ZerolapEngine(torch.nn.Module):
    def __init__(
        self,
        *,
        module: torch.nn.Module,
        config: ZerolapConfig,
        make_optimizer,
        make_scheduler,
        ds_config: dict | None = None,
        optimizer_name: str | None = None,
        mesh: Mesh | None = None,
    ) -> None:
        super().__init__()
        take_over(module)
        self.module = module
        # Which ranks form which groups (zerolap.topology): ZeRO works over the data-parallel
        # group (with sequence parallelism, every rank holding a piece of its sequences too);
        # tensor parallelism's pieces agree over the tensor group. DeepSpeed's clients read it
        # as ``engine.mpu``.
        self.mesh = mesh if mesh is not None else build_mesh(1)
        self.mpu = self.mesh
        group = self.mesh.zero_group
        self._inputs_checked = self.mesh.tensor_group is None
        self._config = config
        # What clients read as ``engine.config``: the ds_config as given (DeepSpeed's engine
        # keeps the dict it was passed; the Trainer reads engine.config["zero_optimization"]).
        self.config = ds_config if ds_config is not None else config.model_dump(mode="json")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.global_rank = dist.get_rank()
        self.local_rank = dist.get_local_rank()
        self.device = get_accelerator().device(self.local_rank)
        self.plan = plan_stage(
            config.zero_optimization.stage, reduce_scatter=config.zero_optimization.reduce_scatter
        )
        if config.log_level is not None:
            set_log_level_from_string(config.log_level)
        self._warn_unsupported()
        # DeepSpeed's engine.monitor; built first, so a missing package fails every rank
        # before any collective. Rank 0 alone has monitors to write to, and events to write.
        self.monitor = start_monitors(config)
        self._events = None
        if self.monitor.monitors:
            # DeepSpeed sends its timers to the monitors with either of these on.
            timed = config.wall_clock_breakdown or config.flops_profiler.enabled
            self._events = TrainingEvents(self.monitor, timed=timed)
        # Expert parallelism: each MoE layer's groups, and the size of its experts' own
        # partition (their buckets are reduced and sharded over the ranks holding the same
        # experts, every ep_size-th data-parallel rank).
        self.ep_size = set_up_expert_parallelism(
            module, self.mesh, stage=config.zero_optimization.stage
        )
        self.offload = plan_offload(
            config.zero_optimization, device=self.device, rank=self.global_rank
        )
        if self.global_rank == 0:
            for note in self.offload.notes:
                logger.info(note)
        self._configure_activation_checkpointing()
        self._unshard_unmanaged()
        self._place_module()
        trains = make_optimizer is not None and bool(trainable_params(module))
        if make_optimizer is not None and not trains:
            logger.info("the model has no trainable parameter: the engine runs forward only")
        zero = config.zero_optimization
        self.units = None  # stage 3's fetch units (zero.units.UnitPlan)
        if self.plan.shard_params:
            apply_leaf_config(module, zero.leaf_module)
            if zero.module_granularity_threshold:
                apply_granularity_threshold(module, zero.module_granularity_threshold)
            for submodule in module.modules():
                ensure_registry(submodule)  # ds_external_parameters() on every module
            self.units = plan_units(
                module,
                persistence_threshold=zero.param_persistence_threshold,
                model_persistence_threshold=zero.model_persistence_threshold,
                bucket_numel=zero.reduce_bucket_size,
            )
            self.params = self.units.trainable_params if trains else []
        else:
            self.params = self._in_bucket_order(trainable_params(module)) if trains else []
        self._check_one_dtype()
        self._build_buffers()
        self._broadcast_initial_state()
        self.reducer = self.grads = self.optimizer = self.lr_scheduler = None
        # Who hears about phases (forward, backward, waits, optimizer): wall_clock_breakdown's
        # timers, profilers. Empty costs one loop over nothing per phase.
        self._phase_recorders = _PhaseRecorders()
        # Stages 1-2: the step's parameter gathers are waited by the modules that use them.
        self._forward_waits = None
        if isinstance(self.param_store, FlatParams) and self.param_store.defer:
            self._forward_waits = ForwardWaits(
                module,
                self.params,
                [slot.bucket for slot in self.layout.slots],
                self.param_store,
                record=self._phase_recorders,
            )
        if trains:
            self._build_reducer()
        self.fetcher = self._build_fetcher() if self.plan.shard_params else None
        self.loss_scaler = build_loss_scaler(config.fp16)
        self.nonfinite = NonFiniteGuard(config.nonfinite_gradients)
        self._param_access = None
        if trains:
            self.optimizer = self._build_optimizer(make_optimizer(self.params))
            if self.optimizer.host_grads is not None:
                self.reducer.on_delivered.append(self.optimizer.delivered)
            swapped, buffers = self.optimizer.swapped_bytes(), self.optimizer.buffer_bytes()
            if self.global_rank == 0 and 0 < swapped <= buffers:
                size = config.zero_optimization.sub_group_size
                logger.warning(
                    f"zero_optimization.offload_optimizer.device 'nvme': its buffers "
                    f"({buffers / 2**20:,.2f} MiB, each the largest sub-group's state) are as "
                    f"large as the swapped state ({swapped / 2**20:,.2f} MiB), so offloading "
                    "saves no memory here: "
                    + (
                        f"lower zero_optimization.sub_group_size (now {size:,}), or "
                        if size
                        else ""
                    )
                    + "set offload_optimizer.buffer_count below the number of sub-groups"
                )
            if self.plan.shard_params:
                self.param_store.after_write_back.append(self.optimizer.reload_master)
            self.lr_scheduler = make_scheduler(self.optimizer.inner)
            self._param_access = ParamAccess(self.optimizer, self.params, self._bucket_groups())
            self.optimizer.parameter_offload = self.fetcher  # DeepSpeed's name (TRL reads it)
        self._optimizer_name = optimizer_name
        self.destroyed = False
        self.collate_fn = None  # the loaders' default (initialize's collate_fn, as DeepSpeed)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        # Micro-batches of the step under way (the boundary is counted on this, not on
        # micro_steps, so a step is whole when the accumulation count changes between steps:
        # set_train_batch_size, a checkpoint loaded at another data-parallel size).
        self.micro_in_step = 0
        self.skipped_steps = 0
        self._no_sync = False
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's override
        # "engine" or "torch" from a backward's opening to its closing (a plain loss.backward()
        # opens when autograd reaches the first output)
        self._backward_kind: str | None = None
        self._torch_backward_start = 0.0
        self._loss_scaled = False  # engine.scale() applied the loss scale to the next backward
        self._cycle_fresh = True  # the next backward starts a new accumulation cycle
        module._zerolap_engine = weakref.ref(self)
        # Dropped without destroy(), the engine's hooks come off the model (runtime.release).
        self._attachments = Attachments(
            module,
            self.params,
            self._param_access,
            self.optimizer,
            self.reducer,
            self.fetcher,
            self.param_store,
            self._forward_waits,
        )
        if self.optimizer is not None:  # the model's own entries refused while it is parked
            self._attachments.hooks.append(
                ParkedGuard(self.optimizer.parked, module, self.param_store)
            )
        self._release_on_drop = weakref.finalize(self, self._attachments.release, gather=False)
        self._release_on_drop.atexit = False  # at exit the model goes too: nothing to give back
        self.tput_timer = ThroughputTimer(
            config.timers.throughput,
            batch_size=config.train_batch_size,
            steps_per_output=config.print_interval,
        )
        if config.wall_clock_breakdown:
            self.add_phase_recorder(
                WallClockBreakdown(steps_per_print=config.print_interval, rank=self.global_rank)
            )
        if self._events is not None and self._events.timed:
            self.add_phase_recorder(self._events)
        self._flops = None  # rank 0's flops profile (ds_config's flops_profiler)
        if config.flops_profiler.enabled and self.global_rank == 0 and self.optimizer is None:
            logger.warning(
                "flops_profiler.enabled on an engine without an optimizer: it profiles a "
                "training step, and this engine takes none; profile the model with "
                "zerolap.profiling.flops.get_model_profile"
            )
        elif config.flops_profiler.enabled and self.global_rank == 0:
            engine = weakref.ref(self)  # the model's hooks reach the phase recorders

            def sizes() -> dict:
                this = engine()
                return {
                    "samples": this.train_batch_size(),
                    "world_size": dist.get_world_size(),
                    "data_parallel_size": this.dp_world_size,
                    "model_parallel_size": this.mesh.dims.tensor,
                    "micro_batch_size": this.train_micro_batch_size_per_gpu(),
                }

            self._flops = StepFlopsProfile(module, config.flops_profiler, sizes)
            self.add_phase_recorder(self._flops)
        self._gc_given_back = None
        if config.disable_python_gc:
            python_gc.acquire()
            self._gc_given_back = weakref.finalize(self, python_gc.release)
        if config.dump_state and self.global_rank == 0:
            logger.info(self._state_text())
        see_memory_usage("Engine after initialize", force=config.memory_breakdown)

    # -- construction steps -------------------------------------------------------------------

    def _state_text(self) -> str:
        """ds_config's ``dump_state``: the resolved config (every key, defaults filled in) and
        what the engine built from it."""
        dims = self.mesh.dims
        facts = {
            "ZeRO stage": self.plan.stage,
            "ranks (data x tensor x pipeline x sequence)": (
                f"{dist.get_world_size()} ({dims.data} x {dims.tensor} x {dims.pipe} x "
                f"{dims.sequence})"
            ),
            "trainable parameters": sum(getattr(p, "ds_numel", p.numel()) for p in self.params),
            # Stage 3 gathers by unit (small persistent ones share a bucket) and reduces runs
            # of those buckets: both counts.
            "gathered buckets": len(self.layout.buckets) if self.units is not None else None,
            "gradient buckets": len(self.reducer.buckets) if self.reducer is not None else None,
            "optimizer": type(self.optimizer.inner).__name__ if self.optimizer else None,
            "lr scheduler": type(self.lr_scheduler).__name__ if self.lr_scheduler else None,
            "optimizer state on disk": self.offload.optimizer is not None,
            "parameters on disk": self.offload.params is not None,
            "optimizer step on the host, apart from the accelerator": self.offload.host is not None,
        }
        config = json.dumps(self._config.model_dump(mode="json"), indent=2, sort_keys=True)
        lines = [f"  {name}: {value}" for name, value in facts.items() if value is not None]
        return "engine state (ds_config dump_state):\n" + config + "\n" + "\n".join(lines)

    def collect_python_gc(self) -> int:
        """One cyclic garbage collection now (with ``disable_python_gc``, where the training
        loop chooses); the number of objects found."""
        return python_gc.collect()

    def _warn_unsupported(self) -> None:
        """One warning per kind of ds_config entry that loads but does nothing here."""
        if self.global_rank != 0:
            return
        config = self._config
        if keys := config.unknown_keys():
            logger.warning(f"unknown ds_config keys, ignored: {', '.join(keys)}")
        if keys := config.unsupported_keys():
            logger.warning(
                "zerolap does not implement these ds_config keys; they are accepted and have no "
                f"effect: {', '.join(keys)}"
            )
        for note in config.advice():
            logger.warning(f"ds_config {note}")

    def _configure_activation_checkpointing(self) -> None:
        """A ds_config ``activation_checkpointing`` block is put in force for
        ``zerolap.checkpointing`` (``deepspeed.checkpointing``) unless the script configured
        that module itself, which then wins, as in DeepSpeed. A block that cannot be put in
        force (contiguous memory without ``number_checkpoints``) is said, not failed on:
        DeepSpeed too reads it only when the script calls ``configure``."""
        if "activation_checkpointing" not in self._config.model_fields_set:
            return
        if checkpointing.is_configured():
            return
        try:
            checkpointing.configure_from_config(self._config.activation_checkpointing)
        except ConfigError as err:
            if self.global_rank == 0:
                logger.warning(f"activation_checkpointing not put in force: {err}")

    def _unshard_unmanaged(self) -> None:
        """Parameters that ``zero.Init`` sharded become whole again below stage 3, which does
        not shard parameters."""
        if self.plan.shard_params:
            return
        for param in self.module.parameters():
            if is_sharded(param):
                param.ds_owner.unshard(param)

    def _place_module(self) -> None:
        """The model on the engine's device, its floating-point parameters in the training
        dtype (DeepSpeed moves and casts it too). Buffers keep their dtype unless
        ``data_types.buffer_dtype`` says otherwise: a rotary embedding's ``inv_freq`` cast to
        bf16 would shift every position's angle (DeepSpeed 0.19.8 keeps them too)."""
        dtype = _DTYPES[self._config.precision]
        if dtype != torch.float32:
            for param in self.module.parameters():
                if param.is_floating_point() and param.dtype != dtype:
                    param.data = param.data.to(dtype)
            buffer_dtype = torch_dtype(self._config.data_types.buffer_dtype)
            if buffer_dtype is not None:
                kept = fp32_buffers(
                    self.module, self._config.data_types.keep_in_fp32_modules, dtype
                )
                for name, buffer in self.module.named_buffers():
                    if not buffer.is_floating_point():
                        continue
                    target = buffer_dtype
                    if name in kept:  # raised to fp32 if it came lower, else left as it is
                        low = buffer.dtype in (torch.float16, torch.bfloat16)
                        target = torch.float32 if low else buffer.dtype
                    if buffer.dtype != target:
                        buffer.data = buffer.data.to(target)
        self.module.to(self.device)

    def _names_by_id(self) -> dict[int, str]:
        """Each parameter's name in the model, by ``id`` (for messages)."""
        return {id(p): n for n, p in self.module.named_parameters()}

    def _check_one_dtype(self) -> None:
        managed = self.units.params if self.units is not None else self.params
        if not managed:
            return
        names = self._names_by_id()
        first = managed[0]
        for p in managed:
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError(
                    f"parameter {names.get(id(p), '?')} is {p.dtype} on {p.device} but "
                    f"{names.get(id(first), '?')} is {first.dtype} on {first.device}: all "
                    "parameters the engine manages must share one dtype and device"
                )

    def _src_rank(self) -> int:
        """Global rank of the group's first member: where initial weights come from."""
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def _build_buffers(self) -> None:
        """``self.param_store``: the flat buffer of trainable parameters (stages 0-2) or every
        parameter's shard (stage 3); ``self.layout``: what the reducer and optimizer address."""
        zero = self._config.zero_optimization
        rank = dist.get_rank(self.group)
        native = dist.get_backend(self.group) == "nccl"
        if self.units is not None:
            full = layout_from_groups(self.units.groups, world_size=self.world_size)
            self.layout = full.prefix(self.units.trainable_buckets if self.params else 0)
            self.param_store = ShardedParams(
                self.units.params,
                full,
                self.units.persistent,
                trainable_buckets=self.units.trainable_buckets,
                dtype=self.units.params[0].dtype,
                device=self.device,
                group=self.group,
                rank=rank,
                src_rank=self._src_rank(),
                native=native,
                swap=self.offload.params,
                host=self.offload.param_host,
                unit_names=self.units.names,
            )
            return
        strides = [expert_parallel_size(p) for p in self.params]
        kinds = self._bucket_kinds()
        if self.ep_size > 1:  # experts in buckets of their own
            kinds = [(k, s) for k, s in zip(kinds or [None] * len(strides), strides, strict=True)]
        self.layout = build_layout(
            [p.numel() for p in self.params],
            bucket_numel=zero.reduce_bucket_size,
            world_size=self.world_size,
            kinds=kinds,
            strides=strides,
        )
        self.param_store = None
        if self.params:
            self.param_store = FlatParams(
                self.params,
                self.layout,
                groups=self._bucket_groups(),
                rank=rank,
                native=native,
                sharded=self.plan.shard_optimizer and self.world_size > 1,
                defer=zero.overlap_param_gather,
            )

    def _experts_group(self):
        """The ranks holding the same experts as this one (None without expert parallelism)."""
        return self.mesh.expert_groups(self.ep_size).data_group if self.ep_size > 1 else None

    def _bucket_groups(self, layout: FlatLayout | None = None) -> list:
        """Per bucket of ``layout`` (the engine's by default), the group its chunks are spread
        over: the data-parallel group, or for experts the ranks holding the same experts."""
        experts = self._experts_group()
        buckets = (layout or self.layout).buckets
        return [experts if b.stride > 1 else self.group for b in buckets]

    def _broadcast_initial_state(self) -> None:
        """Every rank starts from rank 0's weights and buffers, as DeepSpeed and DDP do (stage
        3's parameters were broadcast unit by unit as they were sharded); experts spread over
        ranks from the first rank holding the same ones."""
        if self.world_size == 1:
            return
        src = self._src_rank()
        experts = self._experts_group()

        def send(tensor, expert: bool) -> None:
            if not expert:
                dist.broadcast(tensor, src=src, group=self.group)
            elif dist.get_world_size(experts) > 1:
                dist.broadcast(tensor, src=dist.get_global_rank(experts, 0), group=experts)

        if isinstance(self.param_store, FlatParams):
            flat, buckets = self.param_store.flat, self.layout.buckets
            for run in _runs_of_a_kind(buckets, lambda b: b.stride > 1):
                send(flat[run[0].start : run[-1].end], run[0].stride > 1)
        managed = {id(p) for p in self.params}
        for param in self.module.parameters():
            if id(param) not in managed and not is_sharded(param):
                send(param.data, expert_parallel_size(param) > 1)
        held = expert_buffers(self.module)
        for buffer in self.module.buffers():
            send(buffer.data, id(buffer) in held)

    def _build_fetcher(self) -> ParamFetcher:
        zero = self._config.zero_optimization
        total = sum(getattr(p, "ds_numel", p.numel()) for p in self.units.params)
        moved = self.offload.params is not None or self.offload.param_host is not None
        if moved and zero.max_live_parameters >= total and self.global_rank == 0:
            # DeepSpeed's default (1e9) lets a model that size stay gathered from one use to the
            # next, so the shard is all that leaves memory: said, since it is not what the key
            # is usually set for.
            logger.warning(
                f"zero_optimization.offload_param: stage3_max_live_parameters "
                f"({zero.max_live_parameters:,}) covers the whole model ({total:,} elements), "
                "so every gathered unit may stay in memory between its uses and only the shard "
                "is offloaded; lower stage3_max_live_parameters and stage3_max_reuse_distance "
                "to keep less gathered"
            )
        return ParamFetcher(
            self.param_store,
            self.module,
            self.units.fetch,
            self.units.names,
            prefetch_numel=zero.prefetch_bucket_size,
            max_live_numel=zero.max_live_parameters,
            max_reuse_distance=zero.max_reuse_distance,
            record=self._phase_recorders,
        )

    def _build_reducer(self) -> None:
        param_dtype = self.param_store.dtype
        sequence_parallel = self.mesh.dims.sequence > 1
        comm_dtype = self._config.reduction_dtype(sequence_parallel) or param_dtype
        device = self.param_store.device
        rank = dist.get_rank(self.group)
        # Averaged over every rank ZeRO works over. With sequence parallelism the S ranks of a
        # sequence each hold S times their share of its gradient (the Trainer's loss is
        # all-gathered, whose backward sums over them), so this gives the gradient of the
        # loss itself, at every stage; DeepSpeed's stages 0-2 divide by D only and apply S
        # times it (its stage 3 gives the gradient, as here).
        pre, post = scale_factors(
            self.world_size,
            predivide=self._config.gradient_predivide_factor,
            prescale=self._config.prescale_gradients,
            grad_dtype=param_dtype,
            comm_dtype=comm_dtype,
        )
        layout = self.layout
        if self.units is not None:
            # Stage 3 gathers unit by unit, but reduces runs of units up to
            # reduce_bucket_size with one collective each (the shard is laid out the same).
            layout = coalesce(layout, self._config.zero_optimization.reduce_bucket_size)
        if self.plan.shard_gradients:
            # The shard accumulates in fp32 for an fp32 master, in bf16 for a bf16 one.
            master_dtype = param_dtype if self._config.bf16.bf16_master_weights_and_grads else None
            self.grads = ShardGradients(
                layout,
                rank,
                dtype=master_dtype or torch.float32,
                comm_dtype=comm_dtype,
                device=device,
                pre=pre,
            )
        else:
            self.grads = FullGradients(
                layout, dtype=param_dtype, comm_dtype=comm_dtype, device=device, pre=pre
            )
        groups = self._bucket_groups(layout)
        names = self._names_by_id()
        if self.plan.reduce_scatter:
            native = dist.get_backend(self.group) == "nccl"
            reduction = ReduceScatterBuckets(groups, rank, post=post, native=native)
        else:
            reduction = AllReduceBuckets(groups, post=post)
        self.reducer = GradReducer(
            self.params,
            layout,
            self.grads,
            reduction,
            overlap=self._config.zero_optimization.overlap_comm,
            in_place=self._accumulates_in_place(pre),
            # Stage 3's buckets are made of modules' units, whose gradients come in that
            # module's backward: each unit is written when its last one comes, in one
            # multi-tensor copy.
            batched=self.plan.shard_params,
            names=[names.get(id(p), "?") for p in self.params],
        )

    def _accumulates_in_place(self, pre: float) -> bool:
        """Whether autograd accumulates the gradients in the storage's buffer itself, with no
        hook per parameter (``GradReducer``'s ``in_place``): on an accelerator, at stages 0-2
        without ``overlap_comm`` (nothing is launched during backward), where the buffer
        costs no more memory than the hooks' (stage 2: one buffer of every bucket against
        the pool's; stage 3's parameters are not whole between their uses), with every
        gradient stored as it comes (no pre factor; the buffer in the parameters' dtype:
        at stage 2 the communication's),
        nothing offloaded, outside a pipeline, and with unused parameters allowed (no hook
        sees which got no gradient)."""
        zero = self._config.zero_optimization
        return (
            accelerator.runs_apart(self.param_store.device)
            and not self.plan.shard_params
            and self.grads.in_place_costs_no_memory()
            and not zero.overlap_comm
            and pre == 1.0
            and all(p.dtype == self.grads.in_place_dtype for p in self.params)
            and self.offload.host is None
            and self.offload.optimizer is None
            and self._bucket_kinds() is None
            and zero.ignore_unused_parameters
        )

    def _build_optimizer(self, inner: torch.optim.Optimizer) -> ZeroOptimizer:
        rank = dist.get_rank(self.group)
        sharded = self.plan.shard_optimizer and self.world_size > 1
        model_group = self.mesh.model_group
        counted = counted_in_norm(self.params, self.mesh, copies=self._tied_copies())
        if self.ep_size > 1 and not sharded:
            # Every rank steps all it holds, and its experts are its expert-parallel group's
            # alone: the norm sums over that group, the other parameters counted once in it.
            experts = self.mesh.expert_groups(self.ep_size)
            model_group = experts.expert_group
            counted = [
                c and (experts.expert_rank == 0 or expert_parallel_size(p) > 1)
                for c, p in zip(counted, self.params, strict=True)
            ]
        if self.plan.shard_optimizer:
            owned = self.layout.owned_ranges(rank)
            shard_numel = self.layout.shard_numel
            to_shard = self.layout.shard_position
        else:
            owned = [(b.start, b.end) for b in self.layout.buckets]
            shard_numel = self.layout.numel
            to_shard = lambda bucket, flat: flat  # noqa: E731  (the "shard" is everything)
        return ZeroOptimizer(
            inner,
            params=self.params,
            layout=self.layout,
            param_store=self.param_store,
            grads=self.grads,
            owned_ranges=owned,
            to_shard=to_shard,
            shard_numel=shard_numel,
            sharded=sharded,
            group=self.group,
            clip=self._config.gradient_clipping,
            loss_scaler=self.loss_scaler,
            compute_norm=self._config.zero_optimization.compute_grad_norm,
            check_finite=self._config.precision != "bf16" or self._config.bf16.check_grad_overflow,
            sub_group_size=self._config.zero_optimization.sub_group_size,
            swap=self.offload.optimizer,
            host=self.offload.host,
            model_group=model_group,
            counted=counted,
            low_precision_master=self._config.bf16.bf16_master_weights_and_grads,
            defer_step=self._defers_step(inner, model_group),
        )

    def _defers_step(self, inner: torch.optim.Optimizer, model_group) -> bool:
        """``offload_optimizer.defer_step``: whether the swapped sub-groups step in the
        gathers after ``step()`` (``zero.step_behind``). The same answer on every rank: it
        follows from the config, the model's groups and the optimizer's class (a step that
        runs inside ``step()`` after all, for its hooks, issues the same collectives)."""
        opt = self._config.zero_optimization.offload_optimizer
        if self.offload.optimizer is None or not opt.defer_step:
            return False
        store = self.param_store
        why = None
        if not isinstance(store, FlatParams) or not store.defer:
            why = (
                "it needs stage 1 or 2 on more than one rank, overlap_param_gather, and "
                "parameters of the plain nn.Parameter class"
            )
        elif store.native or self.offload.host is not None:
            why = "it needs the gathers on gloo's ring, on a CPU-only host"
        elif model_group is not None or any(g is not self.group for g in store.groups):
            why = "it needs every bucket gathered over the data-parallel group alone"
        elif not can_defer(inner):
            why = (
                f"it steps torch's and zerolap's optimizers only (not {type(inner).__name__}, "
                "which may write its param groups' entries)"
            )
        if why is None:
            return True
        if self.global_rank == 0 and "defer_step" in opt.model_fields_set:  # asked for
            logger.info(
                "zero_optimization.offload_optimizer.defer_step: the swapped sub-groups step "
                f"inside step() here: {why}"
            )
        return False

    def _tied_copies(self) -> frozenset[int]:
        """Ids of parameters that are copies of a weight another pipeline stage holds too
        (counted there, not here, in the global norm); none outside a pipeline."""
        return frozenset()

    def _in_bucket_order(self, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """The managed parameters in the order the flat buffers hold them: the order their
        gradients are expected in (``trainable_params``), outside a pipeline."""
        return params

    def _bucket_kinds(self) -> list | None:
        """Per managed parameter, its kind: a gradient bucket holds one kind only (all alike
        outside a pipeline)."""
        return None

    def _reduce_scope(self) -> frozenset[int] | None:
        """The buckets the coming backward reduces, when it reduces: all (None) outside a
        pipeline."""
        return None

    # -- training -----------------------------------------------------------------------------

    def add_phase_recorder(self, recorder) -> None:
        """``recorder.record(phase, start, end, compute=True)`` is called for every phase."""
        self._phase_recorders.append(recorder)

    def remove_phase_recorder(self, recorder) -> None:
        self._phase_recorders.remove(recorder)

    def _require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(
                f"engine.{what}() needs an optimizer, and this engine has none: initialize() got "
                "no optimizer and the ds_config has no 'optimizer' section, or the model has no "
                "trainable parameter. It runs forward only."
            )

    def forward(self, *inputs, **kwargs):
        self._refuse_if_parked("forward")
        start = time.perf_counter()
        self.tput_timer.start()
        if self.fetcher is not None:
            self.fetcher.begin_step()
        self._check_inputs_once(inputs, kwargs)
        see_memory_usage("Engine before forward", force=self._config.memory_breakdown)
        if self._flops is not None:
            self._flops.before_forward(self.global_steps)
        try:
            with self._autocast():
                out = self.module(*inputs, **kwargs)
        except BaseException:
            if self._flops is not None:
                self._flops.abandon()  # the profiling hooks come off; this forward is not used
            raise
        if self._flops is not None:
            self._flops.after_forward()
        see_memory_usage("Engine after forward", force=self._config.memory_breakdown)
        if self.optimizer is not None and torch.is_grad_enabled():
            out = _through_entry(self, out)
        self._phase_recorders("forward", start, time.perf_counter())
        return out

    def _autocast(self):
        """``torch.autocast`` as the ds_config's ``torch_autocast`` asks (the one the caller
        may have opened around the engine is replaced, as in DeepSpeed), or nothing."""
        section = self._config.torch_autocast
        if not section.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=section.torch_dtype)

    def _check_inputs_once(self, inputs: tuple, kwargs: dict) -> None:
        """At the first forward, that the tensor group's ranks were fed the same batch."""
        if not self._inputs_checked:
            check_same_inputs(self.mesh.tensor_group, inputs, kwargs, advice=_SHARD_BY_DATA_RANK)
            self._inputs_checked = True

    def _entry_factor(self) -> float:
        """Called by autograd where a backward enters the model's outputs: a plain
        ``loss.backward()`` (torch's style, which DeepSpeed supports) opens the engine's
        backward here, and its gradients are scaled as ``engine.backward`` scales the loss
        (fp16 loss scale over accumulation steps); the backward's end is called back by
        autograd itself."""
        if self._backward_kind == "engine":  # the loss was scaled already
            return 1.0
        if self._backward_kind is None:
            self._refuse_if_parked("backward")
            self._open_backward("torch")
            self._torch_backward_start = time.perf_counter()
            torch.autograd.Variable._execution_engine.queue_callback(self._close_torch_backward)
        loss_scale = 1.0 if self._loss_scaled else self.loss_scaler.loss_scale
        return loss_scale / self.gradient_accumulation_steps()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale, for ``engine.scale(loss).backward()``
        (DeepSpeed's manual backward); the gradients are still divided by the accumulation
        steps where they enter the model. A plain ``loss.backward()`` needs no call: it is
        scaled there too."""
        self._require_optimizer("scale")
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.grad_fn):
            raise ValueError(
                "engine.scale(loss) needs a one-element loss tensor with a grad_fn; for "
                "another tensor call tensor.backward(gradient) directly"
            )
        self._loss_scaled = True
        scale = self.loss_scaler.loss_scale
        return loss if scale == 1.0 else loss * scale

    def _close_torch_backward(self) -> None:
        self._close_backward(self._torch_backward_start)

    def _open_backward(self, kind: str) -> None:
        """What precedes every backward's autograd: a new accumulation cycle if one is due,
        and the reducer told whether this micro-batch reduces."""
        if self.optimizer is not None:
            # A step still running behind the last one (offload_optimizer.defer_step) reads
            # the gradients this backward is about to reset: done and agreed first.
            self.optimizer.finish_step()
        self._backward_kind = kind
        if self._cycle_fresh:
            self.reducer.begin_cycle()
            self._cycle_fresh = False
        reduce = self.plan.reduce_every_micro_batch or (
            self.is_gradient_accumulation_boundary() and not self._no_sync
        )
        self.reducer.begin_backward(reduce, scope=self._reduce_scope() if reduce else None)
        if self.is_gradient_accumulation_boundary():
            self.optimizer.prefetch()  # swapped state is read while this backward runs

    def _close_backward(self, start: float) -> None:
        """What follows every backward's autograd: the one wait for the reductions."""
        autograd_end = time.perf_counter()
        if self.fetcher is not None:
            self.fetcher.end_first_step()  # before the reducer's last collectives
        unused = self.reducer.finish_backward()
        if self.fetcher is not None:
            self.fetcher.finish_backward()
        self._phase_recorders("backward", start, autograd_end)
        self._phase_recorders("backward_wait", autograd_end, time.perf_counter(), compute=False)
        self._expose_grads()
        self._backward_kind = None
        self._loss_scaled = False
        at_boundary = self.reducer.reducing and self.is_gradient_accumulation_boundary()
        if not self._config.zero_optimization.ignore_unused_parameters and at_boundary:
            self._refuse_unused(unused)

    def _refuse_unused(self, unused: list[torch.nn.Parameter]) -> None:
        """``ignore_unused_parameters: false``: a parameter that got no gradient in a whole
        accumulation cycle is an error, on every rank alike (the count is agreed first, so that
        no rank goes on to the next collective alone)."""
        count = torch.tensor([float(len(unused))], device=dist.buffer_device())
        dist.all_reduce(count, op="max")
        if count.item() == 0:
            return
        missing = {id(p) for p in unused}
        mine = [n for n, p in self.module.named_parameters() if id(p) in missing]
        where = f"on rank {self.global_rank}: {', '.join(mine[:5])}" if mine else "on other ranks"
        more = f" and {len(mine) - 5} more" if len(mine) > 5 else ""
        raise RuntimeError(
            f"parameters got no gradient in this accumulation cycle ({where}{more}) and "
            "zero_optimization.ignore_unused_parameters is false; set it true to allow them, "
            "or set requires_grad=False on them before initialize()"
        )

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch ends an accumulation cycle: its backward reduces and
        ``step()`` updates. Counted from ``gradient_accumulation_steps`` unless
        ``set_gradient_accumulation_boundary`` decided it."""
        if self._boundary is not None:
            return self._boundary
        return self.micro_in_step + 1 >= self.gradient_accumulation_steps()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Decide the boundary from outside, before each backward (Accelerate does, and calls
        ``step()`` only at the boundary): the next backward reduces and the next ``step()``
        updates exactly when ``is_boundary``, whatever ``gradient_accumulation_steps`` says."""
        self._boundary = bool(is_boundary)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backpropagate ``loss`` (divided by ``gradient_accumulation_steps`` unless
        ``scale_wrt_gas`` is false, and multiplied by the fp16 loss scale) and reduce gradients
        when this micro-batch is due to. Returns the loss as divided, as DeepSpeed does."""
        self._require_optimizer("backward")
        self._refuse_if_parked("backward")
        see_memory_usage("Engine before backward", force=self._config.memory_breakdown)
        self._open_backward("engine")
        gas = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        start = time.perf_counter()
        try:
            self.nonfinite.observe_loss(loss)
            if self._events is not None:
                self._events.observe_loss(loss)
            scaled = loss.float() * (self.loss_scaler.loss_scale / gas)
            scaled.backward(retain_graph=retain_graph)
        except BaseException:
            self._backward_kind = None
            raise
        self._close_backward(start)
        see_memory_usage("Engine after backward", force=self._config.memory_breakdown)
        return loss / gas if scale_wrt_gas else loss

    def _expose_grads(self) -> None:
        """Full gradients all-reduced (stage 0, or stage 1 without reduce_scatter) are shown as
        ``param.grad`` views, as DDP does: the average at the accumulation boundary. Between
        micro-batches they show this rank's sum so far, already multiplied by 1 / world size
        when the division rides on the copy into the buffer (fp32 gradients and
        communication: ``reductions.scale_factors``), where DDP's ``no_sync`` shows the bare sum.
        After a reduce-scatter only the own chunks hold the average, so ``param.grad`` stays
        None, as in DeepSpeed. With in-place gradients (``GradReducer.in_place``) each
        ``param.grad`` is its place in the buffer already; after a reduce-scatter, or at
        stage 2, it is cleared, as the hooks' path leaves it."""
        if self.reducer.in_place and (self.plan.reduce_scatter or self.plan.shard_gradients):
            for param in self.params:  # their places hold this rank's own sums, not the result
                param.grad = None
            return
        if self.plan.reduce_scatter:
            return
        if self.reducer.in_place and not self.reducer.later_round:
            return  # each param.grad is its place already
        for slot, param in enumerate(self.params):
            grad = self.grads.param_grad(slot)
            if grad is not None:
                param.grad = grad.view_as(param)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Call after every micro-batch (or, with ``set_gradient_accumulation_boundary``, at
        the boundary only); the optimizer runs at the accumulation boundary."""
        self._require_optimizer("step")
        self._refuse_if_parked("step")
        see_memory_usage("Engine before step", force=self._config.memory_breakdown)
        boundary = self.is_gradient_accumulation_boundary()
        stop = None  # a NonFiniteGradientError to raise once the step is counted
        if boundary and self._cycle_fresh:
            # No gradient since the last step: AdamW would still move every parameter (its
            # moments and weight decay), and the schedule would count a step that learnt nothing.
            raise RuntimeError(
                f"step() at step {self.global_steps} with no backward() since the last step "
                "(or zero_grad()): call engine.backward(loss) first"
            )
        if boundary:
            for param in self.params:
                param.grad = None
            start = time.perf_counter()
            applied = self.optimizer.update()
            updated = time.perf_counter()
            if applied:
                self.optimizer.publish()
            if self.fetcher is not None:
                self.fetcher.prefetch_next_step()
            # A skip the device decided is known from here: after the step's launches.
            applied = self.optimizer.confirm()
            end = time.perf_counter()
            self._phase_recorders("optimizer", start, updated)
            self._phase_recorders("allgather_wait", updated, end, compute=False)
            self._phase_recorders("step_end", end, end)
            if not applied:
                self.skipped_steps += 1
                if not self.loss_scaler.dynamic:
                    shard_finite = self.optimizer.shard_finite()
                    stop = self.nonfinite.skipped(
                        self.global_steps, shard_finite, self.skipped_steps
                    )
            else:
                self.nonfinite.applied()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self._cycle_fresh = True
            self._report_progress()
            if self._events is not None:
                self._events.step(
                    samples=self.global_samples,
                    lr=float(self.get_lr()[0]),
                    loss_scale=self.loss_scaler.loss_scale if self.fp16_enabled() else None,
                )
            self.micro_in_step = 0
        else:
            self.micro_in_step += 1
        self.micro_steps += 1
        self.tput_timer.stop(global_step=boundary, report_speed=self.global_rank == 0)
        see_memory_usage("Engine after step", force=self._config.memory_breakdown)
        if stop is not None:
            raise stop  # after the step's bookkeeping: a caller that goes on starts clean

    def _report_progress(self) -> None:
        """Every ``steps_per_print`` optimizer steps, rank 0 logs where training is."""
        interval = self._config.print_interval
        if interval and self.global_steps % interval == 0 and self.global_rank == 0:
            lrs = ", ".join(f"{lr:.3e}" for lr in self.get_lr())
            logger.info(f"step={self.global_steps}, skipped={self.skipped_steps}, lr=[{lrs}]")

    def zero_grad(self) -> None:
        """Forget accumulated gradients; the next backward starts from zero."""
        for param in self.params:
            param.grad = None
        self._cycle_fresh = True
        self.nonfinite.reset()

    def all_ranks_have_data(self, has_data: bool) -> bool:
        """Uneven inputs: call once per step with whether this rank got a batch; True while
        every rank did. One one-element all-reduce; a rank that runs out of data first makes
        all of them stop together instead of leaving the others waiting in the step's
        collectives until the timeout::

            batches = iter(loader)
            while engine.all_ranks_have_data((batch := next(batches, None)) is not None):
                engine.backward(engine(batch)); engine.step()
        """
        flag = torch.tensor([1.0 if has_data else 0.0], device=dist.buffer_device())
        dist.all_reduce(flag, op="min")
        return bool(flag.item())

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally without reducing them (stages 0 and 1)."""
        if self.plan.reduce_every_micro_batch:
            raise RuntimeError(
                f"no_sync is not possible with ZeRO stage {self.plan.stage}: it keeps only its "
                "gradient shard, so every micro-batch must be reduce-scattered"
            )
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def destroy(self) -> None:
        """Give the model back as it was before ``initialize``: every hook removed, stage-3
        parameters whole again, and the engine's buffers, gradients and optimizer state
        dropped. A collective under stage 3 (parameters are gathered): call on every rank.
        An engine dropped without it takes its hooks off but leaves stage-3 parameters
        sharded (``runtime.release``). A failed optimizer step still running behind the last
        ``step()`` (``offload_optimizer.defer_step``) is raised once all that is done."""
        failure = None
        if self.optimizer is not None and self.optimizer.parked.active:
            # The parameters parked by offload_states() come back before anything is let go:
            # without device memory for them this raises, and destroy() may be called again.
            self.optimizer.reload_states(include=[OffloadStateTypeEnum.lp_params])
        if self.optimizer is not None:
            try:
                failure = self.optimizer.wait_behind()
            except Exception as error:  # everything is still released first
                failure = error
        self._release_on_drop.detach()
        self._attachments.release(gather=True)
        self.reducer = self.grads = self.optimizer = self.lr_scheduler = None
        self.fetcher = self.param_store = self._param_access = self._forward_waits = None
        self.params = []
        self._phase_recorders.clear()
        self.monitor.close()
        if self._flops is not None:
            self._flops.close()
        if self._gc_given_back is not None:
            self._gc_given_back()
        self.destroyed = True
        if failure is not None:
            raise failure

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None) -> None:
        """``torch.compile`` the wrapped module's forward in place (DeepSpeed's signature;
        Accelerate calls it when a dynamo backend is set). The engine's module hooks run
        inside the compiled forward; dynamo breaks the graph where they wait for
        communication, so results are those of the eager forward."""
        self.module.compile(backend=backend, **(compile_kwargs or {}))

    # -- DeepSpeed's accessors ----------------------------------------------------------------

    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def _check_accumulation(self, count: int) -> None:
        """Whether ``count`` micro-batches per step can run (any count can here; a pipeline
        needs at least one per stage)."""

    def deepspeed_io(
        self,
        dataset: torch.utils.data.Dataset,
        batch_size: int | None = None,
        route: str = ROUTE_TRAIN,
        pin_memory: bool = True,
        data_sampler: torch.utils.data.Sampler | None = None,
        collate_fn=None,
        num_local_io_workers: int | None = None,
    ) -> torch.utils.data.DataLoader:
        """DeepSpeed's loader for this rank: micro-batches of ``batch_size`` (the micro-batch
        size by default) from its share of ``dataset`` (``utils.data.make_loader``: in order
        for ``route='eval'`` and ``'predict'``, shuffled for ``'train'`` and ``'encode'``,
        unless ``data_sampler`` is given), a last short batch dropped with ds_config's
        ``dataloader_drop_last``, and batches made by ``collate_fn`` (``initialize``'s by
        default). The ranks of a tensor-parallel group get the same batches.
        Under sequence parallelism every rank draws batches of its own, which
        ``UlyssesSPDataLoaderAdapter`` gathers and cuts (its peers' batches are its
        micro-batches). Loads in this process unless ``num_local_io_workers`` says otherwise
        (DeepSpeed starts 2 workers)."""
        if collate_fn is None:
            collate_fn = self.collate_fn
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TypeError(
                "deepspeed_io() needs a map-style dataset (with __getitem__ and __len__, which "
                f"its sampler splits over the ranks), got {type(dataset).__name__}"
            )
        sampled = self.mesh.data_group if self.mesh.dims.sequence == 1 else self.mesh.zero_group
        return make_loader(
            dataset,
            batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            replicas=dist.get_world_size(sampled),
            rank=dist.get_rank(sampled),
            route=route,
            drop_last=self._config.dataloader_drop_last,
            data_sampler=data_sampler,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            num_workers=num_local_io_workers or 0,
        )

    def dataloader_drop_last(self) -> bool:
        return self._config.dataloader_drop_last

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """A new global batch, by another number of micro-batches per step (the micro-batch
        stays ``train_micro_batch_size_per_gpu``), from the next step on: what batch-size
        ramp-up schedules call between steps (Megatron-DeepSpeed's)."""
        per_micro_batch = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size < 1 or train_batch_size % per_micro_batch:
            raise ValueError(
                f"set_train_batch_size({train_batch_size}): the global batch must be a positive "
                f"multiple of train_micro_batch_size_per_gpu x data-parallel size = "
                f"{self.train_micro_batch_size_per_gpu()} x {self.dp_world_size}"
            )
        if self.micro_in_step:
            raise RuntimeError(
                f"set_train_batch_size() {self.micro_in_step} micro-batch(es) into step "
                f"{self.global_steps + 1}: call it between steps"
            )
        count = train_batch_size // per_micro_batch
        self._check_accumulation(count)
        self._config = self._config.model_copy(
            update={"train_batch_size": train_batch_size, "gradient_accumulation_steps": count}
        )
        self.tput_timer.batch_size = train_batch_size  # samples/s counts the new batch

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def zero_optimization(self) -> bool:
        return self.plan.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.plan.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.plan.shard_gradients

    def zero_optimization_partition_weights(self) -> bool:
        return self.plan.shard_params

    def fp16_enabled(self) -> bool:
        return self._config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self._config.precision == "bf16"

    def torch_autocast_enabled(self) -> bool:
        return self._config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype:
        return self._config.torch_autocast.torch_dtype

    def optimizer_name(self) -> str | None:
        """The ds_config's ``optimizer.type`` in lower case when the engine built the
        optimizer from it, else the class name of the optimizer passed to ``initialize``."""
        if self.optimizer is None or self._optimizer_name is not None:
            return self._optimizer_name
        return type(self.optimizer.inner).__name__

    @property
    def data_parallel_group(self):
        """The ranks seeing distinct batches, whose gradients are averaged (with sequence
        parallelism ZeRO works over ``seq_data_parallel_group``: these and their peers)."""
        return self.mesh.get_data_parallel_group()

    @property
    def dp_world_size(self) -> int:
        return self.mesh.dims.data

    @property
    def sequence_parallel_size(self) -> int:
        """S: ranks sharing each sequence (``zerolap.sequence_parallel``); 1 without."""
        return self.mesh.dims.sequence

    @property
    def seq_data_parallel_group(self):
        """The ranks ZeRO works over: the data-parallel ones and their sequence peers."""
        return self.mesh.get_sequence_data_parallel_group()

    @property
    def seq_dp_world_size(self) -> int:
        """D x S."""
        return self.mesh.get_sequence_data_parallel_world_size()

    @property
    def seq_parallel_group(self):
        """The ranks sharing this rank's sequences; None without sequence parallelism."""
        return self.mesh.sequence_group

    def get_sequence_parallel_group(self):
        """``seq_parallel_group`` (DeepSpeed's accessor)."""
        return self.mesh.sequence_group

    @property
    def mp_world_size(self) -> int:
        return self.mesh.dims.tensor

    def get_data_parallel_rank(self) -> int:
        return self.mesh.data_rank

    def get_tensor_parallel_rank(self) -> int:
        return self.mesh.tensor_rank

    get_model_parallel_rank = get_tensor_parallel_rank

    def communication_data_type(self) -> torch.dtype:
        own = self._config.reduction_dtype(self.mesh.dims.sequence > 1)
        return own or _DTYPES[self._config.precision]

    def steps_per_print(self) -> int | None:
        return self._config.print_interval

    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    def get_lr(self) -> list[float]:
        self._require_optimizer("get_lr")
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Each parameter group's momentum as DeepSpeed reports it: ``momentum`` for SGD and
        RMSprop, ``betas`` for the others (0.0 for a group without the key)."""
        self._require_optimizer("get_mom")
        name = (self.optimizer_name() or "").lower()
        key = "momentum" if name in ("sgd", "rmsprop") else "betas"
        return [group.get(key, 0.0) for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return None if self.optimizer is None else self.optimizer.last_norm

    def was_step_applied(self) -> bool:
        return self.optimizer is not None and self.optimizer.last_applied

    # -- checkpoints and state dicts ------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir,
        tag=None,
        client_state=None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """Every rank writes its shard under ``save_dir/tag`` (default ``global_step<N>``);
        ``latest`` names the tag once all are complete. Call on all ranks."""
        from zerolap.checkpoint.engine_io import save_checkpoint

        self._refuse_if_parked("save_checkpoint")
        return save_checkpoint(
            self,
            save_dir,
            tag,
            client_state,
            save_latest=save_latest,
            exclude_frozen=exclude_frozen_parameters,
        )

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn=None,
    ):
        """Resume from ``load_dir/tag`` (default: ``latest``), saved by zerolap at any world
        size and stage or by DeepSpeed 0.19 (stages 0-3); returns ``(load_path,
        client_state)``, or ``(None, None)`` with a warning when ``load_dir`` holds no
        ``latest`` and no tag was given. ``custom_load_fn(src=state_dict, dst=module)``
        replaces the module's ``load_state_dict``. Call on all ranks."""
        from zerolap.checkpoint.engine_io import load_checkpoint

        self._refuse_if_parked("load_checkpoint")
        return load_checkpoint(
            self,
            load_dir,
            tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            custom_load_fn=custom_load_fn,
        )

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self._config.zero_optimization.gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The whole state dict in the training dtype, on CPU, on rank 0 (None on the others):
        gathered one module at a time under stage 3. Call on every rank."""
        if not self.plan.shard_params:
            raise ValueError("_zero3_consolidated_16bit_state_dict needs ZeRO stage 3")
        return self._consolidated_16bit_state_dict(exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """``_zero3_consolidated_16bit_state_dict`` at any stage. Call on every rank."""
        from zerolap.checkpoint.module_state import full_state_dict

        state = full_state_dict(self.module, exclude_frozen=exclude_frozen_parameters)
        return OrderedDict(state) if self.global_rank == 0 else None

    def save_16bit_model(
        self, save_dir, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters=False
    ) -> bool:
        """Rank 0 writes the model's whole state dict (parameters in their training dtype) to
        ``save_dir/save_filename``, loadable into the plain model. Under stage 3 this needs
        ``stage3_gather_16bit_weights_on_model_save``, as in DeepSpeed; without it nothing is
        written and False is returned. Call on all ranks."""
        from zerolap.checkpoint.module_state import full_state_dict

        if self.units is not None and not self.zero_gather_16bit_weights_on_model_save():
            if self.global_rank == 0:
                logger.warning(
                    "save_16bit_model did not save: under ZeRO stage 3 it needs "
                    "zero_optimization.stage3_gather_16bit_weights_on_model_save: true"
                )
            return False
        state = full_state_dict(self.module, exclude_frozen=exclude_frozen_parameters)
        if self.global_rank == 0:
            path = Path(save_dir) / save_filename
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
        if self.world_size > 1:
            dist.barrier(group=self.group)
        return True

    def wait_in_flight(self) -> None:
        """Wait for the parameter all-gathers the engine leaves running past ``step()``:
        stages 1-2's (every bucket's, otherwise waited by the next forward) and stage 3's
        prefetch of the next step's first units (kept gathered for it), and the optimizer's
        swapped sub-groups stepping in them (``offload_optimizer.defer_step``; the write-back
        of the last ones may still run). Afterwards none of the engine's communication is
        running: for a program that counts bytes or times a phase on its own. Reading a
        parameter's values waits by itself; this is never needed for correctness."""
        if self.optimizer is not None:
            self.optimizer.finish_step()
        if self.param_store is not None:
            self.param_store.settle()

    def offload_states(self, *args, **kwargs) -> None:
        """DeepSpeed's ``engine.offload_states(include, device, pin_memory, non_blocking)``:
        the model states of the kinds in ``include`` move to host memory, freeing the
        accelerator's, until ``reload_states()`` (``ZeroOptimizer.offload_states``)."""
        self._require_optimizer("offload_states")
        self.optimizer.offload_states(*args, **kwargs)

    def reload_states(self, *args, **kwargs) -> None:
        """``reload_states(non_blocking=False, include=None)``: what ``offload_states`` moved
        comes back."""
        self._require_optimizer("reload_states")
        self.optimizer.reload_states(*args, **kwargs)

    def _refuse_if_parked(self, what: str) -> None:
        # On every forward, backward and step: nothing built unless something is parked.
        if self.optimizer is not None and self.optimizer.parked.active:
            self.optimizer.parked.require(f"engine.{what}()", NEEDED[what])

    def empty_partition_cache(self) -> None:
        """Release every gathered stage-3 parameter (no-op for stages 0-2)."""
        if self.fetcher is not None:
            self.fetcher.release_all()

    def fetch_stats(self) -> dict | None:
        """Stage 3: gathers per module, how many a prefetch had started, and the time forward
        and backward waited for parameters; None for stages 0-2."""
        return None if self.fetcher is None else self.fetcher.stats.as_dict()

    def memory_breakdown(self) -> MemoryBreakdown:
        """Bytes of model state this rank holds, against the ZeRO formula for its stage."""
        return measure_memory(self)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = super().__getattr__("module")
            return getattr(module, name)


DeepSpeedEngine = ZerolapEngine  # the name DeepSpeed scripts use in isinstance checks
