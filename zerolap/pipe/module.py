"""``PipelineModule``: a model given as a list of layers, of which each stage builds its own run.

DeepSpeed's shape: ``layers`` holds ``nn.Module`` instances, plain functions (``lambda x:
x.transpose(0, 1)``), ``LayerSpec`` (a class and its arguments, built only on the stage that
holds it) and ``TiedLayerSpec`` (a module shared by several layers, e.g. the embedding reused as
the LM head: every stage holding one of those layers builds it once under ``tied_modules.<key>``,
and the engine keeps the copies equal). A layer is registered under its index in the whole list
(``"3.attn.qkv.weight"``), so every stage's parameter names are the names of the whole model.

The stage is fixed at construction (a rank builds only what it runs): ``rank // (world / P)``,
pipeline stages outermost (``zerolap.topology``). The module's ``forward`` runs this stage's
layers; a one-stage PipelineModule is the whole model and runs as any ``nn.Module``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import zerolap.comm as dist
from zerolap import checkpointing
from zerolap.pipe.partition import balanced_bounds, layer_weights
from zerolap.topology import ParallelDims, ProcessTopology, parallel_dims

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]


class LayerSpec:
    """A layer to build later: ``typename(*module_args, **module_kwargs)``, on its stage only."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module (and so its ``tied_weight_attr`` parameters) is shared by every
    layer of the same ``key``, on one stage or across stages. ``forward_fn(module, x)`` runs it
    in place of ``module(x)`` (the embedding as an LM head: ``lambda m, x: x @ m.weight.T``)."""

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Callable | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (
            [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        )


class PipelineModule(nn.Module):
    """This stage's layers of ``layers``, split over ``num_stages`` stages (or as ``topology``,
    a DeepSpeed topology or a ``zerolap.topology.ParallelDims``, says).

    ``loss_fn(outputs, labels)`` gives the last stage's loss (without it, the last layer's
    output is the loss). ``partition_method``: ``parameters``, ``uniform`` or ``type:<regex>``
    (``zerolap.pipe.partition``). ``seed_layers``: each ``LayerSpec`` is built after
    ``seed_fn(base_seed + index)`` (``torch.manual_seed`` by default), so a layer starts with
    the same weights whichever stage builds it. ``activation_checkpoint_interval``: runs of that
    many layers are recomputed in backward (``activation_checkpoint_func``) rather than kept.
    ``dynamic_shape``: activation shapes may change between micro-batches (their metadata is
    then sent with every message instead of once). ``virtual_stages`` (zerolap's, as
    Megatron's virtual pipeline size): each rank holds that many chunks of layers, trained by
    interleaved 1F1B (``pipe.schedule``)."""

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | ParallelDims | None = None,
        loss_fn: Callable | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], Any] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable = checkpointing.checkpoint,
        checkpointable_layers: Sequence[str] | None = None,
        dynamic_shape: bool = False,
        virtual_stages: int = 1,
    ) -> None:
        super().__init__()
        self.layer_list = list(layers)
        if not self.layer_list:
            raise ValueError("PipelineModule needs at least one layer")
        for index, layer in enumerate(self.layer_list):
            if not (isinstance(layer, LayerSpec | nn.Module) or callable(layer)):
                raise TypeError(
                    f"PipelineModule layer {index} is {type(layer).__name__}: a layer is an "
                    "nn.Module, a LayerSpec, a TiedLayerSpec or a function"
                )
        self._dims = _dims(num_stages, topology)
        self._topology = topology if isinstance(topology, ProcessTopology) else None
        self.num_stages = self._dims.pipe
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.stage_id = self._dims.coordinates(rank)[0]
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn if seed_fn is not None else torch.manual_seed
        self.base_seed = base_seed
        self.partition_method = partition_method
        if activation_checkpoint_interval < 0:
            raise ValueError(
                f"activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}"
            )
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        if virtual_stages < 1 or (virtual_stages > 1 and self.num_stages < 2):
            raise ValueError(
                f"virtual_stages={virtual_stages}: chunks go round the stages, so more than one "
                f"needs at least 2 stages (num_stages={self.num_stages})"
            )
        self.virtual_stages = virtual_stages
        weights = layer_weights(
            partition_method,
            param_counts=[_param_count(layer) for layer in self.layer_list],
            type_names=[_type_name(layer) for layer in self.layer_list],
        )
        # Chunk g = c * P + s is rank s's chunk c: layers parts[g] to parts[g + 1].
        self.parts = balanced_bounds(weights, self.num_stages * virtual_stages)
        # Registered before the layers, as in DeepSpeed: the parameter order (and so the
        # gradient buckets) puts tied weights last in backward.
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        # How to call each of a chunk's layers, resolved at every call (``chunk_funcs``): by
        # name for modules, so a module replaced after construction (split for tensor
        # parallelism) is the one that runs.
        self._calls: list[list[tuple[str, Any]]] = []
        for chunk in range(virtual_stages):
            g = chunk * self.num_stages + self.stage_id
            self._calls.append(self._build(self.parts[g], self.parts[g + 1]))

    # -- construction -------------------------------------------------------------------------

    def _build(self, start: int, stop: int) -> list[tuple[str, Any]]:
        calls: list[tuple[str, Any]] = []
        for index in range(start, stop):
            layer = self.layer_list[index]
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = self._built(layer, index)
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                calls.append(("tied", (layer.key, layer.forward_fn)))
            elif isinstance(layer, LayerSpec):
                self.add_module(str(index), self._built(layer, index))
                calls.append(("module", str(index)))
            elif isinstance(layer, nn.Module):
                self.add_module(str(index), layer)
                calls.append(("module", str(index)))
            else:
                calls.append(("function", layer))
        return calls

    def _built(self, spec: LayerSpec, index: int) -> nn.Module:
        if self.seed_layers:
            self.seed_fn(self.base_seed + index)
        return spec.build()

    def chunk_funcs(self, chunk: int) -> list[Callable]:
        """Chunk ``chunk``'s layers as callables, in order."""
        funcs = []
        for kind, ref in self._calls[chunk]:
            if kind == "module":
                funcs.append(self._modules[ref])
            elif kind == "tied":
                key, forward_fn = ref
                module = self.tied_modules[key]
                funcs.append(functools.partial(forward_fn, module) if forward_fn else module)
            else:
                funcs.append(ref)
        return funcs

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The parameters chunk ``chunk``'s layers hold (a tied module's included), once each."""
        found: dict[int, nn.Parameter] = {}
        for kind, ref in self._calls[chunk]:
            if kind == "function":
                continue
            module = self._modules[ref] if kind == "module" else self.tied_modules[ref[0]]
            for param in module.parameters():
                found.setdefault(id(param), param)
        return list(found.values())

    # -- what the engine asks -----------------------------------------------------------------

    @property
    def dims(self) -> ParallelDims:
        """The job's degrees this module was split for."""
        return self._dims

    def layer_names(self) -> list[str]:
        """Each layer's kind, in order (what every stage must agree on)."""
        return [
            f"tied:{layer.key}:{layer.typename.__name__}"
            if isinstance(layer, TiedLayerSpec)
            else _type_name(layer)
            for layer in self.layer_list
        ]

    def layer_prefixes(self) -> list[str]:
        """Each layer's state_dict prefix in the whole model: its index (``"3."``), or for a
        tied layer its module's (``"tied_modules.embed."``); a function's holds nothing."""
        return [
            f"tied_modules.{layer.key}." if isinstance(layer, TiedLayerSpec) else f"{index}."
            for index, layer in enumerate(self.layer_list)
        ]

    def tied_keys(self) -> dict[str, list[int]]:
        """Every tie in the whole model: key -> the stages holding one of its layers."""
        holders: dict[str, list[int]] = {}
        for index, layer in enumerate(self.layer_list):
            if isinstance(layer, TiedLayerSpec):
                stage = self.stage_owner(index)
                holders.setdefault(layer.key, [])
                if stage not in holders[layer.key]:
                    holders[layer.key].append(stage)
        return holders

    def tied_weights(self, key: str) -> list[nn.Parameter]:
        """This stage's copies of tie ``key``'s shared parameters."""
        module = self.tied_modules[key]
        return [module.get_parameter(attr) for attr in self.tied_weight_attrs[key]]

    def stage_owner(self, layer_index: int) -> int:
        """The stage holding layer ``layer_index``."""
        if not 0 <= layer_index < len(self.layer_list):
            raise IndexError(f"layer {layer_index} of {len(self.layer_list)}")
        chunk = next(g for g in range(len(self.parts) - 1) if layer_index < self.parts[g + 1])
        return chunk % self.num_stages

    def use_dims(self, dims: ParallelDims) -> None:
        """The job's degrees as the engine built its mesh: tensor parallelism from the
        ds_config adds a model axis the module was not given (stages are outermost, so each
        rank's stage, and this module's layers, stay as they are)."""
        if (dims.world_size, dims.pipe) != (self._dims.world_size, self._dims.pipe):
            raise ValueError(f"the mesh {dims} is not the module's {self._dims} with a model axis")
        if dims != self._dims:
            self._dims, self._topology = dims, None

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def topology(self) -> ProcessTopology:
        """DeepSpeed's topology object: the one given, else the one of the degrees."""
        return self._topology or self._dims.topology()

    # -- running ------------------------------------------------------------------------------

    def forward(self, forward_input, chunk: int | None = None):
        """This stage's layers on ``forward_input``: chunk ``chunk``'s, or with one chunk per
        rank (no virtual stages) all of them."""
        if chunk is None and self.virtual_stages > 1:
            raise ValueError("a PipelineModule with virtual stages runs one chunk: pass chunk=")
        interval = self.activation_checkpoint_interval
        funcs = self.chunk_funcs(chunk or 0)
        if interval == 0 or not torch.is_grad_enabled():
            return _run(funcs, forward_input)
        x = forward_input
        for start in range(0, len(funcs), interval):
            run = funcs[start : start + interval]
            if self._checkpointable(run, x):
                inputs = x if isinstance(x, tuple) else (x,)
                x = self.activation_checkpoint_func(functools.partial(_run_many, run), *inputs)
            else:
                x = _run(run, x)
        return x

    def _checkpointable(self, run: list[Callable], x) -> bool:
        """Whether a run of layers is recomputed in backward: it must hold parameters (or,
        with ``checkpointable_layers``, only layers of the named classes, as DeepSpeed
        decides), and take an input that requires grad. DeepSpeed checkpoints a first run
        fed token ids too, whose parameters then get no gradient from a reentrant
        checkpoint; here that run is kept instead."""
        inputs = x if isinstance(x, tuple) else (x,)
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            return False
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in run)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in run)


def _run(funcs: list[Callable], x):
    for func in funcs:
        x = func(x)
    return x


def _run_many(funcs: list[Callable], *inputs):
    return _run(funcs, inputs if len(inputs) > 1 else inputs[0])


def _dims(num_stages: int | None, topology) -> ParallelDims:
    world = dist.get_world_size() if dist.is_initialized() else 1
    if topology is not None:
        topology = parallel_dims(topology)
        if topology.world_size != world:
            raise ValueError(
                f"PipelineModule(topology=...) describes {topology.world_size} ranks but the "
                f"job has {world}"
            )
        if num_stages not in (None, topology.pipe):
            raise ValueError(
                f"PipelineModule(num_stages={num_stages}) but its topology has "
                f"{topology.pipe} pipeline stages"
            )
        return ParallelDims(world, tensor=topology.tensor, pipe=topology.pipe)
    if num_stages is None:
        raise ValueError("PipelineModule needs num_stages= or topology=")
    return ParallelDims(world, tensor=1, pipe=num_stages)


def _param_count(layer) -> int:
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):  # counted, not allocated
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def _type_name(layer) -> str:
    """What ``type:<regex>`` matches: a module's class name, a function's own name (none
    for other callables, which DeepSpeed skips too)."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", "")  # a partial, a callable object: no name to match
