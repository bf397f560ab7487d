"""``InferenceEngine``: a model prepared for inference as DeepSpeed's ``init_inference`` does it,
without DeepSpeed's fused kernels.

In order, at construction: the model is converted to ``dtype``; with tensor parallelism it is
split by zerolap's plan for its layout (``tensor_parallel.plan.auto_plan``: DeepSpeed calls this
AutoTP) and the ranks of each tensor group take the same random state, so that sampling draws the
same tokens on all of them; then it is moved to the accelerator unless ``keep_module_on_host``.
The first forward or ``generate`` checks that the ranks of a tensor group were given the same
inputs (``runtime.inputs``), since a group computes one answer together.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

import zerolap.comm as dist
from zerolap.accelerator import get_accelerator
from zerolap.config.inference import DeepSpeedInferenceConfig, parse_inference_config
from zerolap.runtime.inputs import check_same_inputs
from zerolap.tensor_parallel.layers import is_tensor_parallel
from zerolap.tensor_parallel.plan import auto_plan, parallelize
from zerolap.topology import build_mesh
from zerolap.utils import log_dist

__all__ = ["InferenceEngine", "init_inference"]


def init_inference(
    model: nn.Module,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    **kwargs: Any,
) -> InferenceEngine:
    """DeepSpeed's ``init_inference``: ``model`` prepared by ``config`` (a dict, a JSON file's
    path, or None) and the keyword arguments, which are the same keys (a key given both ways must
    have one value). Every rank of a tensor group must call it with the same model."""
    return InferenceEngine(model, parse_inference_config(config, kwargs))


class InferenceEngine(nn.Module):
    def __init__(self, model: nn.Module, config: DeepSpeedInferenceConfig) -> None:
        super().__init__()
        self.module = model
        self._config = config
        self.config = getattr(model, "config", None)  # DeepSpeed keeps the model's config here
        accelerator = get_accelerator()
        if config.dtype not in accelerator.supported_dtypes():
            raise ValueError(
                f"init_inference: dtype {config.dtype} is not supported by the "
                f"{accelerator.device_name()} accelerator (it supports "
                f"{', '.join(map(str, accelerator.supported_dtypes()))})"
            )
        meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
        if meta is not None:
            raise ValueError(
                f"init_inference: parameter {meta} is on the meta device; DeepSpeed fills such "
                "a model from its checkpoint= files, which zerolap does not read: load the "
                "weights first"
            )
        self.mpu = config.tensor_parallel.mpu
        # Split before converting: a split that cannot be made leaves the model as it was
        # (slicing and converting commute, so the result is DeepSpeed's convert-then-split).
        self.mp_group = self._split(model) if config.tensor_parallel.split else None
        model.to(config.dtype)  # floating-point parameters and buffers, as model.half() does
        if not config.keep_module_on_host:
            model.to(accelerator.current_device_name())
        self._inputs_checked = self.mp_group is None
        self._model_times: list[float] | None = None  # ms per model forward, when profiling
        self._began = 0.0
        self._is_compiled = False
        if hasattr(model, "generate"):
            self.generate = self._generate
        unread = config.unsupported_keys()
        if unread:
            log_dist(
                "init_inference: these keys belong to DeepSpeed's fused kernels and its other "
                f"inference machinery, which zerolap does not have, and have no effect: "
                f"{', '.join(unread)}",
                ranks=[0],
                level=logging.WARNING,
            )
        for note in config.advice():
            log_dist(f"init_inference: {note}", ranks=[0], level=logging.WARNING)

    # -- tensor parallelism -------------------------------------------------------------------

    def _split(self, model: nn.Module):
        """The tensor group, with ``model`` split over it (None when it has one rank). A model
        already split (by ``zerolap.tensor_parallel.parallelize``, for a layout zerolap has no
        plan for) is adopted as it is, with the group it was split over."""
        tp = self._config.tensor_parallel
        if not dist.is_initialized():
            dist.init_distributed()
        if tp.tp_group is not None:
            group = tp.tp_group
        elif tp.mpu is not None:
            group = tp.mpu.get_model_parallel_group()
        else:
            world = dist.get_world_size()
            if world % tp.tp_size:
                raise ValueError(
                    f"init_inference: tensor_parallel.tp_size={tp.tp_size} does not divide the "
                    f"world size {world}"
                )
            group = None
        split = any(is_tensor_parallel(p) for p in model.parameters())
        if split and group is None:
            raise ValueError(
                "init_inference: the model is already split over a tensor group; pass that "
                "group as tensor_parallel.tp_group"
            )
        plan = None
        if not split:  # decided before any group is made: a model without a plan is refused
            try:
                plan = auto_plan(model)
            except ValueError as err:
                raise ValueError(
                    f"init_inference: {err.args[0].split(';')[0]}; split it with "
                    "zerolap.tensor_parallel.parallelize(model, group, plan={name regex: "
                    "'colwise' | 'rowwise'}) and pass the group as tensor_parallel.tp_group"
                ) from None
        if group is None:
            group = build_mesh(tp.tp_size).tensor_group
        size = dist.get_world_size(group)
        if tp.tp_size > 1 and size != tp.tp_size:
            raise ValueError(
                f"init_inference: tensor_parallel.tp_size={tp.tp_size} but the given tensor "
                f"group has {size} ranks"
            )
        if size == 1:
            return None
        if plan is not None:
            parallelize(model, group, plan)
        _share_rng(group)
        how = f"split by the {plan.name} plan" if plan else "split before init_inference"
        log_dist(f"init_inference: the model runs over {size} ranks, {how}", ranks=[0])
        return group

    def _check_inputs(self, inputs: tuple, kwargs: dict, call: str) -> None:
        if not self._inputs_checked:
            check_same_inputs(
                self.mp_group,
                inputs,
                kwargs,
                call=call,
                advice="give every rank of the group the same inputs and the same generate "
                "settings",
            )
            self._inputs_checked = True

    # -- running ------------------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        self._check_inputs(inputs, kwargs, "forward")
        return self.module(*inputs, **kwargs)

    def _generate(self, *inputs, **kwargs):
        """The model's own ``generate`` (greedy, sampling and beam search alike: the split
        layers compute the dense model's logits on every rank of the group). An input longer
        than ``max_out_tokens`` is refused, as DeepSpeed does."""
        self._check_inputs(inputs, kwargs, "generate")  # first: every rank then agrees below
        ids = kwargs.get("input_ids", inputs[0] if inputs else None)
        limit = self._config.max_out_tokens
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[-1] > limit:
            raise RuntimeError(
                f"init_inference: an input of {ids.shape[-1]} tokens exceeds max_out_tokens="
                f"{limit}; raise max_tokens in the inference config"
            )
        return self.module.generate(*inputs, **kwargs)

    # -- DeepSpeed's other methods ------------------------------------------------------------

    def profile_model_time(self, use_cuda_events: bool = True) -> None:
        """Record the time of every forward of the model from now on, in ms, the accelerator
        synchronised around it: each step of ``generate`` too, and calls of ``engine.module``
        (hooks on the model, as in DeepSpeed; ``use_cuda_events`` is DeepSpeed's choice of
        timer, and both time the same span)."""
        del use_cuda_events
        if self._model_times is None:
            self._model_times = []
            self.module.register_forward_pre_hook(self._start_timing)
            self.module.register_forward_hook(self._stop_timing)

    def _start_timing(self, module, inputs) -> None:
        get_accelerator().synchronize()
        self._began = time.perf_counter()

    def _stop_timing(self, module, inputs, output) -> None:
        get_accelerator().synchronize()
        self._model_times.append((time.perf_counter() - self._began) * 1e3)

    def model_times(self) -> list[float]:
        """The forward times recorded since the last call (ms), and a fresh record."""
        if self._model_times is None:
            raise RuntimeError("model_times(): call profile_model_time() first")
        times, self._model_times = self._model_times, []
        return times

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None) -> None:
        """``torch.compile`` the model in place (once)."""
        if not self._is_compiled:
            self.module.compile(backend=backend, **(compile_kwargs or {}))
            self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled

    def __getattr__(self, name: str):
        """What the engine lacks is the model's (``generation_config``, ``device``, ...), as
        for the training engine: DeepSpeed's inference engine does not forward, so the
        DeepSpeed examples' ``pipe.model = init_inference(pipe.model, ...)`` fails in a
        transformers pipeline, which reads ``pipe.model.generation_config``."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


def _share_rng(group) -> None:
    """The group's first rank's random state on every rank of it (the CPU generator, and the
    accelerator's), so sampling picks the same token on all of them."""
    source = dist.get_all_ranks_from_group(group)[0]
    device = dist.buffer_device(group)
    accelerator = get_accelerator()
    states = [(torch.get_rng_state, torch.set_rng_state)]
    if accelerator.device_name() != "cpu":
        states.append((accelerator.get_rng_state, accelerator.set_rng_state))
    for get, put in states:
        state = get().to(device)
        dist.broadcast(state, src=source, group=group)
        put(state.cpu())
