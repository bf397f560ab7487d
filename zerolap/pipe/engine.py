"""``PipelineEngine``: DeepSpeed's ``train_batch`` / ``eval_batch`` over a ``PipelineModule``.

One ``train_batch`` runs ``gradient_accumulation_steps`` micro-batches through the 1F1B
schedule (interleaved with virtual stages, or ZB-H1: ``pipe.schedule``) and steps once. Each
stage is a ZeRO engine of its own layers over its data-parallel group (stages 0-2): its
backward passes are the engine's backward passes, with the last reducing the gradients while it
runs (every one under ZeRO 2), and the step is the engine's step, with the norm for clipping and
the overflow check agreed over the whole pipeline.

Per step, in order:
1. post the receives the next steps need (activations from the previous stage, gradients from
   the next), so they arrive while this stage computes;
2. forward (inputs from the data on the first stage, received on the others; the last stage
   computes the loss from its labels) and send the outputs on, asynchronously;
3. backward (the loss, scaled, on the last stage; the received gradients of the outputs on the
   others) and send the inputs' gradients back, asynchronously; under ZB-H1 this backward
   skips the linear layers' weight gradients, which a later weight step computes
   (``pipe.weight_grad``).
At the end: the sends drained, tied weights' gradients summed over the stages holding them, the
optimizer step, and the loss averaged over micro-batches and data-parallel copies and broadcast
to every stage (what ``train_batch`` returns on every rank, as in DeepSpeed).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

import zerolap.comm as dist
from zerolap import checkpointing
from zerolap.accelerator import get_accelerator
from zerolap.config import ConfigError
from zerolap.pipe.module import PipelineModule
from zerolap.pipe.p2p import MAX_CHUNKS, StageLink
from zerolap.pipe.report import batch_report
from zerolap.pipe.schedule import Op, Step, forward_only, schedule
from zerolap.pipe.weight_grad import DeferredWeights
from zerolap.runtime.engine import ZerolapEngine
from zerolap.topology import PipelineParallelGrid
from zerolap.utils.logging import logger

__all__ = ["PipelineEngine", "PipelineError", "check_pipeline_config"]


class PipelineError(RuntimeError):
    """A pipeline engine used as it cannot be (DeepSpeed's name)."""


def check_pipeline_config(config, model, mpu) -> None:
    """Before any collective: the ds_config's ``pipeline`` section and ZeRO stage against the
    model (a ``PipelineModule`` or not); every rank raises alike."""
    section = config.pipeline
    if not isinstance(model, PipelineModule):
        for key, plain in (("stages", ("auto", 1)), ("schedule", ("1f1b",))):
            value = getattr(section, key)
            if value not in plain:
                raise ConfigError(
                    f"pipeline.{key}={value!r} but the model is a "
                    f"{type(model).__name__}: pipeline parallelism needs a zerolap.pipe."
                    "PipelineModule (deepspeed.pipe.PipelineModule)"
                )
        return
    if config.flops_profiler.enabled:
        raise ConfigError(
            "flops_profiler.enabled with a PipelineModule: the profiler counts and times the "
            "engine's forward, and a pipeline runs its stages inside train_batch(); switch it "
            "off, or profile the model with zerolap.profiling.flops.get_model_profile"
        )
    problems = []
    if section.stages not in ("auto", model.num_stages):
        problems.append(f"pipeline.stages={section.stages} (the module has {model.num_stages})")
    if section.partition not in ("best", model.partition_method):
        problems.append(
            f"pipeline.partition={section.partition!r} (the module's partition_method is "
            f"{model.partition_method!r})"
        )
    if section.seed_layers is not None and section.seed_layers != model.seed_layers:
        problems.append(
            f"pipeline.seed_layers={section.seed_layers} (the module has {model.seed_layers})"
        )
    if problems:
        raise ConfigError(
            "the ds_config's pipeline section contradicts the PipelineModule: "
            + "; ".join(problems)
        )
    # What DeepSpeed's pipeline engine sets on the module from its section.
    if section.activation_checkpoint_interval:
        model.activation_checkpoint_interval = section.activation_checkpoint_interval
    if section.use_reentrant is False:
        model.activation_checkpoint_func = checkpointing.non_reentrant_checkpoint
    if section.schedule == "zb-h1" and model.virtual_stages > 1:
        raise ConfigError(
            f"pipeline.schedule=zb-h1 with virtual_stages={model.virtual_stages}: ZB-H1 runs "
            "one chunk per stage"
        )
    if section.schedule == "zb-h1" and model.activation_checkpoint_interval:
        raise ConfigError(
            "pipeline.schedule=zb-h1 with activation_checkpoint_interval="
            f"{model.activation_checkpoint_interval}: a recomputed forward would record its "
            "linear layers twice"
        )
    if section.schedule == "zb-h1" and config.torch_autocast.enabled:
        raise ConfigError(
            "pipeline.schedule=zb-h1 with torch_autocast.enabled: the deferred weight steps "
            "multiply the inputs the layers were given, which autocast casts only inside them"
        )
    if config.zero_optimization.stage == 3:
        raise ConfigError(
            "zero_optimization.stage=3 with a PipelineModule: a pipeline stage keeps its "
            "layers' parameters whole between micro-batches; use stage 0, 1 or 2 (each shards "
            "over the stage's data-parallel group)"
        )
    if dist.get_backend() != "gloo" or get_accelerator().device_name() != "cpu":
        raise ConfigError(
            f"a PipelineModule on the {dist.get_backend()} backend "
            f"({get_accelerator().device_name()}): pipeline parallelism runs on gloo with CPU "
            "tensors in this version (its early-posted receives rely on gloo's tag matching)"
        )
    tp = config.tensor_parallel
    if mpu is not None:
        raise ConfigError(
            "initialize(mpu=...) with a PipelineModule: the module's topology and "
            "tensor_parallel.autotp_size make the mesh; pass no mpu"
        )
    if model.dims.tensor not in (1, tp.size):
        raise ConfigError(
            f"the PipelineModule's topology has a model (tensor) axis of {model.dims.tensor} but "
            f"tensor_parallel.autotp_size={tp.size}; make them agree"
        )
    if tp.size > 1 and tp.overlap_mode == "full":
        raise ConfigError(
            "tensor_parallel.overlap=full with a PipelineModule: a stage's blocks are not split "
            "into lanes; use overlap: backward or off"
        )


@dataclass
class _Batch:
    """One train_batch's or eval_batch's state, dropped at its end."""

    micro_batches: int
    train: bool
    compute_loss: bool = True  # eval_batch(compute_loss=False): the last stage's outputs
    # Every micro-batch's (inputs, labels), read before the schedule (first and last stages).
    samples: list = field(default_factory=list)
    # By (chunk, micro-batch):
    inputs: dict[tuple[int, int], tuple] = field(default_factory=dict)  # kept for their grads
    outputs: dict[tuple[int, int], object] = field(default_factory=dict)  # the last one's loss
    activations: dict[tuple[int, int], object] = field(default_factory=dict)  # receives posted
    grads: dict[tuple[int, int], object] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    logits: object = None  # eval_batch(return_logits=True): the last micro-batch's outputs
    compute_s: float = 0.0
    spans: list[tuple[str, int, float, float]] = field(default_factory=list)


class PipelineEngine(ZerolapEngine):
    def __init__(self, *, module: PipelineModule, **kwargs) -> None:
        super().__init__(module=module, **kwargs)
        mesh = self.mesh
        self.num_stages = mesh.dims.pipe
        self.stage_id = mesh.pipe_rank
        self.chunks = module.virtual_stages  # chunks of layers per rank (interleaved 1F1B)
        self._check_accumulation(self.gradient_accumulation_steps())
        if self.num_stages * self.chunks > MAX_CHUNKS:
            raise ConfigError(
                f"{self.num_stages} stages x virtual_stages={self.chunks} chunks: at most "
                f"{MAX_CHUNKS} chunks in all"
            )
        if (
            mesh.dims.tensor > 1
            and self._config.pipeline.pipe_partitioned
            and self.global_rank == 0
        ):
            logger.info(
                "pipeline.pipe_partitioned / grad_partitioned: each tensor rank sends its whole "
                "copy of the activations to the next stage's same tensor rank (zerolap does not "
                "split them over the tensor group); results are the same"
            )
        # The neighbours this stage receives activations from (``_prev``) and sends them to
        # (``_next``); with virtual stages the chunks go round, the last stage's to the first.
        self._prev = self._next = None
        ring = self.chunks > 1
        if self.stage_id > 0 or ring:
            self._prev = self._link((self.stage_id - 1) % self.num_stages)
        if self.stage_id < self.num_stages - 1 or ring:
            self._next = self._link((self.stage_id + 1) % self.num_stages)
        self.schedule_kind = self._config.pipeline.schedule
        self._deferred = None  # ZB-H1: the linear layers' weight gradients, computed apart
        if self.schedule_kind == "zb-h1":
            names = {id(p): n for n, p in module.named_parameters()}
            self._deferred = DeferredWeights(self._deferred_layers, names)
            self._attachments.hooks.append(self._deferred)  # removed with the engine's
        deferred = self._deferred_ids
        self._input_grad_params = [p for p in self.params if id(p) not in deferred]
        # Per (op, chunk), the buckets that backward reduces, when backwards reduce apart.
        self._scopes = None
        if self._reduces_apart():
            self._scopes = {
                (op, chunk): frozenset(
                    self.layout.slots[slot].bucket
                    for slot, param in enumerate(self.params)
                    if chunk in self._chunks_of.get(id(param), ())
                    and (id(param) in deferred) == (op is Op.WEIGHT)
                )
                for op in (Op.BACKWARD, Op.WEIGHT)
                for chunk in range(self.chunks)
            }
        self._backward_at = (Op.BACKWARD, 0)
        self.data_iterator: Iterator | None = None
        self.batch_fn: Callable | None = None
        # DeepSpeed's grid of the job (coordinates and groups, ``zerolap.topology``), built
        # here as it may create groups, which every rank must; it is a pipeline engine's mpu.
        self.grid = self.mpu = PipelineParallelGrid(mesh=mesh)
        module.use_dims(mesh.dims)
        self.agg_train_loss: torch.Tensor | None = None  # the last train_batch's, as returned
        self.last_stats: dict | None = None  # the last train_batch's measurements

    def _link(self, peer: int) -> StageLink:
        return StageLink(
            stage=self.stage_id,
            peer_stage=peer,
            peer_rank=self.mesh.stage_rank(peer),
            dynamic_shape=self.module.dynamic_shape,
        )

    def _schedule(self) -> list[Step]:
        return schedule(
            stages=self.num_stages,
            stage=self.stage_id,
            micro_batches=self.micro_batches,
            chunks=self.chunks,
            kind=self.schedule_kind,
        )

    # -- construction hooks (called by ZerolapEngine.__init__) ----------------------------------

    def _tie_owners(self) -> dict[str, list[int]]:
        """Ties this stage shares with another: key -> the stages holding it."""
        return {
            key: stages
            for key, stages in self.module.tied_keys().items()
            if len(stages) > 1 and self.mesh.pipe_rank in stages
        }

    def _tied_params(self) -> list[torch.nn.Parameter]:
        return [p for key in self._tie_owners() for p in self.module.tied_weights(key)]

    def _tied_copies(self) -> frozenset[int]:
        stage = self.mesh.pipe_rank
        return frozenset(
            id(p)
            for key, stages in self._tie_owners().items()
            if stages[0] != stage
            for p in self.module.tied_weights(key)
        )

    def _in_bucket_order(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """When ZB-H1's halves reduce apart, the deferred linear parameters go after all the
        others (each group in gradient order): the halves' gradients arrive in separate passes
        anyway, and a transformer block's linear layers and norms would otherwise alternate,
        cutting the buckets small."""
        if not self._reduces_apart():
            return params
        deferred = self._deferred_ids
        return [p for p in params if id(p) not in deferred] + [
            p for p in params if id(p) in deferred
        ]

    def _bucket_kinds(self) -> list | None:
        """A tied weight's bucket holds it alone; when backwards reduce apart, a bucket holds
        the parameters of one set of chunks, deferred by ZB-H1 or not."""
        tied = {id(p) for p in self._tied_params()}
        if not self._reduces_apart():
            return [id(p) if id(p) in tied else None for p in self.params]
        return [
            (
                self._chunks_of.get(id(p)),
                id(p) if id(p) in tied else None,
                id(p) in self._deferred_ids,
            )
            for p in self.params
        ]

    # Derived once from the module and the config, during the base engine's construction.

    @functools.cached_property
    def _deferred_layers(self) -> list[nn.Linear]:
        """ZB-H1: the stage's trainable ``nn.Linear`` layers (tied ones excepted: their weight
        serves another layer too); none under other schedules."""
        if self._config.pipeline.schedule != "zb-h1":
            return []
        tied = {id(m) for m in self.module.tied_modules.modules()}
        return [
            m
            for m in self.module.modules()
            if type(m) is nn.Linear
            and id(m) not in tied
            and any(p.requires_grad for p in m.parameters())
        ]

    def _reduces_apart(self) -> bool:
        """Under ZeRO-2 every backward reduces (into the gradient shard). With data parallelism,
        a backward that reaches only some parameters (one of the virtual stages' chunks, or
        ZB-H1's input-gradient and weight halves) reduces only their buckets, instead of the
        others' as zeros. Stages 0-1 reduce once, at the boundary, all that accumulated."""
        split = self.module.virtual_stages > 1 or self._config.pipeline.schedule == "zb-h1"
        return split and self.plan.reduce_every_micro_batch and self.world_size > 1

    @functools.cached_property
    def _deferred_ids(self) -> frozenset[int]:
        return frozenset(id(p) for layer in self._deferred_layers for p in layer.parameters())

    @functools.cached_property
    def _chunks_of(self) -> dict[int, frozenset[int]]:
        """Per parameter id, the chunks of this stage that use it."""
        chunks_of: dict[int, set[int]] = {}
        for chunk in range(self.module.virtual_stages):
            for param in self.module.chunk_parameters(chunk):
                chunks_of.setdefault(id(param), set()).add(chunk)
        return {key: frozenset(value) for key, value in chunks_of.items()}

    def _reduce_scope(self) -> frozenset[int] | None:
        return None if self._scopes is None else self._scopes[self._backward_at]

    def _broadcast_initial_state(self) -> None:
        """Every stage's copy of a tied weight starts as the copy on the stage of the tie's
        first layer (after the data-parallel copies agreed). Every rank creates every tie
        group, in one order."""
        super()._broadcast_initial_state()
        dims, mine = self.mesh.dims, self.mesh
        self._tie_groups: dict[str, object] = {}
        for key, stages in sorted(self.module.tied_keys().items()):
            if len(stages) < 2:
                continue
            for data in range(dims.data):
                for tensor in range(dims.tensor):
                    ranks = [dims.rank_of(s, data, tensor) for s in stages]
                    group = dist.new_group(ranks)
                    if self.global_rank in ranks:
                        self._tie_groups[key] = group
        for key, group in self._tie_groups.items():
            owner = mine.stage_rank(self.module.tied_keys()[key][0])
            for param in self.module.tied_weights(key):
                dist.broadcast(param.data, src=owner, group=group)

    # -- DeepSpeed's pipeline interface --------------------------------------------------------

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def _check_accumulation(self, count: int) -> None:
        if count < self.num_stages:
            raise ConfigError(
                f"gradient_accumulation_steps={count} gives each train_batch fewer "
                f"micro-batches than the {self.num_stages} pipeline stages; use at least "
                f"{self.num_stages} (many more keep the bubble small)"
            )
        if self.chunks > 1 and count % self.num_stages:
            raise ConfigError(
                f"gradient_accumulation_steps={count}: interleaved 1F1B "
                f"(virtual_stages={self.chunks}) takes micro-batches in groups of the "
                f"{self.num_stages} stages; use a multiple of {self.num_stages}"
            )

    @property
    def micro_batches(self) -> int:
        """Micro-batches per ``train_batch``: the accumulation steps (DeepSpeed's attribute;
        ``set_train_batch_size`` changes it between batches)."""
        return self.gradient_accumulation_steps()

    @property
    def is_pipe_parallel(self) -> bool:
        return self.num_stages > 1

    @property
    def is_data_parallel(self) -> bool:
        return self.mesh.dims.data > 1

    def set_dataiterator(self, iterator: Iterator) -> None:
        self.data_iterator = iterator

    def set_batch_fn(self, fn: Callable | None) -> None:
        """``fn(micro_batch)`` maps each micro-batch on the stages that read data, before its
        inputs and labels are taken from it (``None`` in, on such a rank without an iterator;
        ``_read`` says when)."""
        self.batch_fn = fn

    def forward(self, *args, **kwargs):
        raise PipelineError("a pipeline engine runs forward through train_batch() or eval_batch()")

    def backward(self, *args, **kwargs):
        raise PipelineError("a pipeline engine runs backward inside train_batch()")

    def step(self, *args, **kwargs):
        raise PipelineError("a pipeline engine steps inside train_batch()")

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches, each
        ``(inputs, labels)`` from ``data_iter`` (read on the first and last stages only);
        returns the mean loss on every rank."""
        self._require_optimizer("train_batch")
        self._refuse_if_parked("step")  # the whole step: forward, backward and the update
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() under torch.no_grad(); use eval_batch()")
        batch = _Batch(self.micro_batches, train=True)
        self._read(data_iter, batch)
        self.module.train()
        self.tput_timer.start()
        stats = self._run(self._schedule(), batch)
        self._reduce_tied_grads()
        self._boundary = True
        try:
            ZerolapEngine.step(self)
        finally:
            self._boundary = None
        self.micro_steps += self.micro_batches - 1
        self.last_stats = stats
        self.agg_train_loss = self._aggregate(batch.losses, broadcast=True)
        if self._events is not None:
            self._events.write("train_loss", self.agg_train_loss.item(), self.global_samples)
        return self.agg_train_loss

    def pipeline_report(self) -> dict:
        """The last train_batch seen from every stage (``pipe.report.batch_report``): per stage
        the bubble against the theory and the exposed point-to-point time. A collective over
        this rank's pipeline; stages on one host (their clocks are compared)."""
        if self.last_stats is None:
            raise PipelineError("pipeline_report() before any train_batch()")
        stages = [self.last_stats]
        if self.num_stages > 1:
            stages = [None] * self.num_stages
            dist.all_gather_object(stages, self.last_stats, group=self.mesh.pipe_group)
        return batch_report(stages)

    def eval_batch(
        self,
        data_iter: Iterator | None = None,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ):
        """Forward only over ``num_micro_batches`` (default: the accumulation steps); returns
        the loss averaged over micro-batches (``reduce_output='avg'``) and data-parallel
        copies, on every rank with ``bcast_loss`` (else on the last stage only), and with
        ``return_logits`` the last stage's outputs for the last micro-batch too (None on the
        other stages), as DeepSpeed returns them. Without ``compute_loss`` the last stage's
        outputs, averaged over micro-batches, stay on the last stage."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        self._refuse_if_parked("forward")
        micro_batches = num_micro_batches or self.micro_batches
        batch = _Batch(micro_batches, train=False, compute_loss=compute_loss)
        self._read(data_iter, batch)
        self.module.eval()
        for link in (self._prev, self._next):
            if link is not None:  # shapes may differ from the last evaluation's (a last, short
                link.forget(train=False)  # batch): both sides send and expect metadata afresh
        try:
            with torch.no_grad():
                steps = forward_only(
                    stages=self.num_stages, micro_batches=micro_batches, chunks=self.chunks
                )
                self._run(steps, batch)
        finally:
            self.module.train()
        if reduce_output is None:
            out = batch.losses if self.is_last_stage() else None
        else:
            # With a monitor, rank 0 writes the loss, so it gets it (as in DeepSpeed).
            out = self._aggregate(
                batch.losses,
                broadcast=(bcast_loss or self.monitor.enabled) and compute_loss,
                scalar=compute_loss,
            )
            if self._events is not None and compute_loss:
                self._events.write("eval_loss", out.item(), self.global_samples)
        if return_logits:
            return out, batch.logits
        return out

    # -- the schedule ---------------------------------------------------------------------------

    def _read(self, data_iter: Iterator | None, batch: _Batch) -> None:
        """The batch's micro-batches, read before any stage sends anything, and agreed on by
        every rank (one all-gather of a count per rank): when any rank's iterator runs out (an
        epoch's end, or shards of unequal length) every rank raises ``StopIteration`` (what
        DeepSpeed's loops catch), and when one fails to read every rank raises, naming it; so
        none is left in the schedule, or with receives posted that the next batch's messages
        would be matched against. ``batch_fn`` then runs on each micro-batch on every rank
        that reads, with ``None`` where the rank has no iterator (DeepSpeed's contract:
        Megatron-DeepSpeed's broadcasts tensor rank 0's data there), the same number of times
        on every rank, so collectives inside it pair up."""
        data = data_iter if data_iter is not None else self.data_iterator
        reads = self.is_first_stage() or self.is_last_stage()
        raw: list = []
        count, failure = batch.micro_batches, None
        if reads and data is None and self.batch_fn is None:
            count, failure = (
                -1,
                PipelineError(
                    "no data: pass train_batch(data_iter=...) or call set_dataiterator() on the "
                    "first and last stages"
                ),
            )
        elif reads:
            try:
                raw = [None] * count if data is None else list(itertools.islice(data, count))
            except Exception as error:  # an iterator that raised: every rank hears of it
                count, failure = -1, error
            else:
                count = len(raw)
        counts, world = [count], self.mesh.dims.world_size
        if world > 1:
            mine = torch.tensor([count], dtype=torch.int64, device=dist.buffer_device(None))
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            counts = torch.cat(every).tolist()
        call = "train_batch" if batch.train else "eval_batch"
        failed = next((r for r, n in enumerate(counts) if n < 0), None)
        if failed is not None:
            if failure is not None:
                raise failure
            raise PipelineError(
                f"{call}(): pipeline stage {self.mesh.dims.coordinates(failed)[0]} (rank "
                f"{failed}) failed to read its data (its own error says why)"
            )
        short = next((r for r, n in enumerate(counts) if n < batch.micro_batches), None)
        if short is not None:
            raise StopIteration(
                f"pipeline stage {self.mesh.dims.coordinates(short)[0]} (rank {short}): the "
                f"data iterator ran out at micro-batch {counts[short]} of the "
                f"{batch.micro_batches} that {call}() reads"
            )
        batch.samples = [self.batch_fn(x) for x in raw] if self.batch_fn else raw

    def _run(self, steps: list[Step], batch: _Batch) -> dict:
        links = [link for link in (self._prev, self._next) if link is not None]
        for link in links:
            link.trace = []
        start = time.perf_counter()
        waited = self._link_waits()
        # The batch's last step that makes gradients reduces them and ends the cycle.
        last = max((i for i, s in enumerate(steps) if s.op is not Op.FORWARD), default=-1)
        if self._deferred is not None:
            self._deferred.drop()  # what a batch that raised left
        for index, step in enumerate(steps):
            self._post_ahead(steps, index, batch)
            if step.op is Op.FORWARD:
                self._forward(step.micro_batch, step.chunk, batch)
            elif step.op is Op.BACKWARD:
                self._backward(step.micro_batch, step.chunk, batch, index == last)
            else:
                self._weight(step.micro_batch, step.chunk, batch, index == last)
            for link in links:
                link.reap()
        for link in links:
            link.drain()
        return {
            "stage": self.stage_id,
            "micro_batches": batch.micro_batches,
            "chunks": self.chunks,
            "schedule": self.schedule_kind,
            "schedule_s": time.perf_counter() - start,
            "compute_s": batch.compute_s,
            "p2p_wait_s": self._link_waits() - waited,
            "start": start,
            "steps": batch.spans,  # (op, micro-batch, start, end) of each compute step
            "p2p": [event for link in links for event in link.trace],
        }

    def _link_waits(self) -> float:
        return sum(link.wait_s for link in (self._prev, self._next) if link is not None)

    # A chunk's place: global index g = chunk * P + stage; the first chunk reads the inputs, the
    # last computes the loss; chunk g's messages are tagged with the receiving chunk's index.

    def _global(self, chunk: int) -> int:
        return chunk * self.num_stages + self.stage_id

    def _is_first_chunk(self, chunk: int) -> bool:
        return self._global(chunk) == 0

    def _is_last_chunk(self, chunk: int) -> bool:
        return self._global(chunk) == self.num_stages * self.chunks - 1

    def _post_ahead(self, steps: list[Step], index: int, batch: _Batch) -> None:
        """The receives of this step and of the next forward and backward after it, posted
        before this step computes, so they arrive meanwhile (the metadata, when unknown, is
        awaited here). At most one message ahead per direction is held."""
        wanted = {Op.FORWARD: 2, Op.BACKWARD: 2}
        for position in range(index, len(steps)):
            step = steps[position]
            if not any(wanted.values()):
                break
            if step.op is Op.WEIGHT or not wanted[step.op]:
                continue  # a weight step receives nothing
            wanted[step.op] -= 1
            key, g = (step.chunk, step.micro_batch), self._global(step.chunk)
            if step.op is Op.FORWARD:
                if self._is_first_chunk(step.chunk) or key in batch.activations:
                    continue
                if self._prev.dynamic_shape and position != index:
                    continue  # its shape is known only once its metadata arrives
                batch.activations[key] = self._prev.post_activations(key[1], batch.train, g)
            elif (
                not self._is_last_chunk(step.chunk)
                and key not in batch.grads
                and key in batch.outputs  # its forward ran: the gradients' shapes are known
            ):
                batch.grads[key] = self._next.post_grads(key[1], batch.outputs[key], g)

    def _forward(self, mb: int, chunk: int, batch: _Batch) -> None:
        first, last = self._is_first_chunk(chunk), self._is_last_chunk(chunk)
        key = (chunk, mb)
        sample = batch.samples[mb] if (first or last) else None
        # The first layer takes the inputs as given (a tensor, or a tuple: DeepSpeed's form,
        # a one-element tuple included), a later stage's as the stage before returned them.
        if first:
            inputs = sample[0] if isinstance(sample[0], torch.Tensor) else tuple(sample[0])
        else:
            inputs = self._prev.wait(batch.activations.pop(key))
        as_tuple = inputs if isinstance(inputs, tuple) else (inputs,)
        if first:
            self._check_inputs_once(as_tuple, {})
        start = time.perf_counter()
        if self._deferred is not None and batch.train:
            self._deferred.record(key)
        try:
            with self._autocast():
                out = self.module(inputs, chunk=chunk)
        except BaseException:
            if self._deferred is not None:
                self._deferred.drop()  # no later call of the layers is this forward's
            raise
        if last:
            loss_fn = self.module.loss_fn
            if not batch.train:
                batch.logits = out
            if loss_fn is not None and batch.compute_loss:
                out = loss_fn(out, sample[1])
            batch.losses.append(out.detach())
            if batch.train:
                batch.outputs[key] = out
        else:
            outs = out if isinstance(out, tuple) else (out,)
            for i, tensor in enumerate(outs):
                if not isinstance(tensor, torch.Tensor):
                    raise PipelineError(
                        f"pipeline stage {self.stage_id}'s output {i} is a "
                        f"{type(tensor).__name__}; a stage passes a tensor or a tuple of tensors"
                    )
            if batch.train:
                batch.outputs[key] = outs
        if self._deferred is not None and batch.train:
            self._deferred.stop((batch.outputs[key],) if last else outs)
        end = time.perf_counter()
        batch.compute_s += end - start
        batch.spans.append(("forward", mb, start, end))
        self._phase_recorders("forward", start, end)
        if batch.train and not first:
            batch.inputs[key] = as_tuple
        if not last:
            self._next.send_activations(out, mb, batch.train, self._global(chunk) + 1)

    def _backward(self, mb: int, chunk: int, batch: _Batch, boundary: bool) -> None:
        key, last = (chunk, mb), self._is_last_chunk(chunk)
        outputs = batch.outputs.pop(key)
        if not last:
            grads = self._next.wait(batch.grads.pop(key))
            tensors = [t for t in outputs if t.requires_grad]
        self._boundary = boundary  # the batch's last backward reduces and ends the cycle
        self._backward_at = (Op.BACKWARD, chunk)
        self._open_backward("engine")
        start = time.perf_counter()
        # ZB-H1: the inputs' gradients and every parameter's but the deferred linear weights'.
        only, leaves = None, []
        if self._deferred is not None:
            received = [] if self._is_first_chunk(chunk) else batch.inputs[key]
            leaves = self._deferred.extra_inputs(key)
            only = [t for t in received if t.requires_grad] + self._input_grad_params + leaves
        try:
            if last:
                self.nonfinite.observe_loss(outputs)
                scale = self.loss_scaler.loss_scale / batch.micro_batches
                (outputs.float() * scale).backward(inputs=only)
            else:
                torch.autograd.backward(tensors, grads, inputs=only)
        except BaseException:
            self._backward_kind = None
            raise
        for leaf in leaves:
            leaf.grad = None  # asked for only so that the pass reaches their layers
        # The inputs' gradients go back before the end-of-backward wait: the previous stage
        # is waiting for them, and the wait (at the batch's last backward) may hold a
        # collective of the whole job (ignore_unused_parameters: false) it must reach first.
        if not self._is_first_chunk(chunk):
            inputs = batch.inputs.pop(key)
            back = tuple(
                t.grad if t.grad is not None else torch.zeros_like(t)
                for t in inputs
                if t.requires_grad
            )
            self._prev.send_grads(back, mb, self._global(chunk) - 1)
        self._close_backward(start)
        end = time.perf_counter()
        batch.compute_s += end - start
        batch.spans.append(("backward", mb, start, end))

    def _weight(self, mb: int, chunk: int, batch: _Batch, boundary: bool) -> None:
        """ZB-H1's weight step: the deferred linear layers' gradients of micro-batch ``mb``,
        accumulated (and reduced, when due) like any backward's."""
        self._boundary = boundary
        self._backward_at = (Op.WEIGHT, chunk)
        self._open_backward("engine")
        start = time.perf_counter()
        try:
            self._deferred.accumulate((chunk, mb))
        except BaseException:
            self._backward_kind = None
            raise
        self._close_backward(start)
        end = time.perf_counter()
        batch.compute_s += end - start
        batch.spans.append(("weight", mb, start, end))

    def _reduce_tied_grads(self) -> None:
        """A tied weight's gradient is the sum of its stages' (each already averaged over its
        data-parallel group): one all-reduce per tied parameter over its tie group, on this
        rank's part of the reduced gradient (its chunk when gradients are sharded: the same
        elements on every stage, the weight having a bucket of its own)."""
        if not self._tie_groups:
            return
        self.grads.settle()  # an offloaded part on the host has arrived
        slot_of = {id(p): i for i, p in enumerate(self.params)}
        chunked = self.plan.shard_gradients or self.plan.reduce_scatter
        rank = dist.get_rank(self.group)
        for key, group in self._tie_groups.items():
            for param in self.module.tied_weights(key):
                slot = self.layout.slots[slot_of[id(param)]]
                bucket = self.layout.buckets[slot.bucket]
                start, end = bucket.chunk(rank) if chunked else (bucket.start, bucket.end)
                position = self.layout.shard_position(slot.bucket, start) if chunked else 0
                for part in self.grads.parts(start, end, position):  # some may be on the host
                    dist.through_group_device(dist.all_reduce, part, group=group)
                self.optimizer.delivered(slot.bucket)  # copies of it made earlier are stale

    def _aggregate(self, values: list[torch.Tensor], *, broadcast: bool, scalar: bool = True):
        """The last stage's ``values`` averaged over micro-batches (losses as their mean; other
        outputs element by element) and over data-parallel copies; broadcast to every stage
        of the pipeline when asked, else None off the last stage."""
        if self.is_last_stage():
            if scalar:
                value = torch.stack([v.float().mean() for v in values]).mean()
            else:
                value = torch.stack([v.float() for v in values]).mean(0)
            if self.mesh.dims.data > 1:
                dist.all_reduce(value, group=self.group)
                value /= self.mesh.dims.data
        if not (broadcast and self.num_stages > 1):
            return value if self.is_last_stage() else None
        src = self.mesh.stage_rank(self.num_stages - 1)
        group = self.mesh.pipe_group
        if not self.is_last_stage():  # a scalar: broadcast is asked for losses only
            value = torch.zeros((), dtype=torch.float32, device=dist.buffer_device(group))
        dist.broadcast(value, src=src, group=group)
        return value
