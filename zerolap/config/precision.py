"""The ``fp16``, ``bf16`` and ``torch_autocast`` sections, and the dtype names
``communication_data_type`` accepts.

Only one of fp16 and bf16 may be enabled; the root config checks that, as it spans both sections.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from pydantic import AliasChoices, BeforeValidator, Field

from zerolap.config.errors import Problem
from zerolap.config.section import ConfigSection, DeepSpeedOnly, is_true

__all__ = [
    "BF16Config",
    "DTypeName",
    "DataTypesConfig",
    "FP16Config",
    "TorchAutocastConfig",
    "torch_dtype",
]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_SPELLINGS = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
}


def _normalise_dtype_name(value: Any) -> Any:
    if value is None or not isinstance(value, str):
        return value
    name = value.strip().lower().removeprefix("torch.")
    if name in ("", "none", "null"):
        return None
    if name not in _SPELLINGS:
        raise ValueError(
            "must be one of fp32, fp16, bf16 (or float32, float16, bfloat16), or null for the "
            "training dtype"
        )
    return _SPELLINGS[name]


DTypeName = Annotated[
    Literal["fp32", "fp16", "bf16"] | None, BeforeValidator(_normalise_dtype_name)
]
"""A dtype by DeepSpeed's short name; torch spellings (``"bfloat16"``, ``"torch.float16"``) are
normalised to it."""


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a ``DTypeName`` value."""
    return None if name is None else _DTYPES[name]


class DataTypesConfig(ConfigSection):
    """The ``data_types`` section: the dtypes of what is not a parameter."""

    param_dtype: DTypeName = None
    """The parameters' dtype: must be that of the enabled fp16 or bf16 section (fp32 with
    neither), as DeepSpeed checks."""
    grad_accum_dtype: DTypeName = None
    """The dtype gradients accumulate in between steps. zerolap accumulates 16-bit training's
    gradients in fp32 (as DeepSpeed does with ``fp32`` here); ``bf16`` or ``fp16`` is not
    implemented, and is said once at start (results are those of ``fp32``)."""
    buffer_dtype: DTypeName = None
    """The dtype floating-point buffers are cast to with fp16 or bf16; null (the default, as
    in DeepSpeed 0.19.8) keeps them as loaded, so a rotary embedding's ``inv_freq`` stays fp32
    while the parameters are cast."""
    keep_in_fp32_modules: list[str] | Literal["auto"] | None = None
    """Buffers kept in fp32 when ``buffer_dtype`` casts the others: name patterns (``*`` any
    run of characters, searched in the buffer's name), or null / ``"auto"`` for the model's
    own ``_keep_in_fp32_modules_strict`` (and ``_keep_in_fp32_modules`` under fp16), as
    transformers declares them."""

    def _advise(self) -> list[Problem]:
        if self.grad_accum_dtype in (None, "fp32"):
            return []
        return [
            Problem(
                ("grad_accum_dtype",),
                f"{self.grad_accum_dtype!r} is not implemented: gradients accumulate in fp32",
            )
        ]


class FP16Config(ConfigSection):
    """The ``fp16`` section: fp16 training with fp32 master weights and loss scaling."""

    enabled: bool = False
    """Train in fp16 (parameters and gradients in fp16, master weights in fp32)."""
    auto_cast: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed casts floating-point inputs to fp16; zerolap leaves the inputs alone."""
    loss_scale: float = Field(0.0, ge=0, allow_inf_nan=False)
    """A static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = Field(16, ge=0, le=127)
    """Dynamic loss scaling starts at ``2**initial_scale_power`` (at most 2**127, the largest
    power of two a float32 holds)."""
    loss_scale_window: int = Field(1000, ge=1)
    """Steps without overflow before the dynamic loss scale is doubled."""
    hysteresis: int = Field(2, ge=1)
    """Overflowing steps tolerated before the dynamic loss scale is halved."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every step without overflow."""
    min_loss_scale: float = Field(1.0, gt=0, allow_inf_nan=False)
    """The floor of the dynamic loss scale."""
    fp16_master_weights_and_grads: Annotated[
        bool, DeepSpeedOnly(is_true, "master weights stay in fp32 in zerolap")
    ] = False
    """DeepSpeed keeps master weights and gradients in fp16 (with its CPU Adam)."""
    fused_mode: Annotated[bool | None, DeepSpeedOnly()] = None
    """Legacy DeepSpeed switch for its fused fp16 optimizer."""


class BF16Config(ConfigSection):
    """The ``bf16`` section (also spelt ``bfloat16``): bf16 training with fp32 master weights
    (or bf16 ones, ``bf16_master_weights_and_grads``). bf16 has fp32's exponent range, so there
    is no loss scaling."""

    enabled: bool = False
    """Train in bf16 (parameters and gradients in bf16, master weights in fp32 unless
    ``bf16_master_weights_and_grads``)."""
    check_grad_overflow: bool = Field(
        True, validation_alias=AliasChoices("check_grad_overflow", "check_overflow")
    )
    """Skip the optimizer step when a gradient is inf or nan on any rank, as fp16 does (on by
    default, as in DeepSpeed 0.19.8; ``nonfinite_gradients`` says what else happens). The
    global gradient norm tells, so it is free unless ``compute_grad_norm`` is off (then one
    one-element all-reduce per step)."""
    immediate_grad_update: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed's bf16 optimizer folds each gradient into the fp32 one as soon as it is ready."""
    bf16_master_weights_and_grads: bool = False
    """ZeRO stages 1-3: no fp32 master; the optimizer steps the bf16 parameters' own elements
    with bf16 gradients (2 bytes per parameter for each instead of 4; DeepSpeed keeps a bf16
    master copy, equal to the parameters, at stages 1-2). Needs ``bf16_optimizer_states``."""
    bf16_optimizer_states: bool = False
    """With ``bf16_master_weights_and_grads``: the optimizer state in bf16 (torch's optimizers
    make it in the parameters' dtype). DeepSpeed allows fp32 state for bf16 masters only in its
    CPU Adam under ZeRO-Offload, which zerolap does not have: the two keys go together."""


class TorchAutocastConfig(ConfigSection):
    """``torch_autocast``: the engine's forward runs under ``torch.autocast`` (DeepSpeed's
    section): eligible ops (matrix products, convolutions) compute in ``dtype`` while the
    parameters keep theirs, the ones autocast keeps in fp32 (softmax, norms, losses) stay there.

    At ZeRO stages 1-3 DeepSpeed also reduces the gradients of ``lower_precision_safe_modules``
    (``nn.Linear`` and ``nn.Conv*`` by default) in ``dtype`` and every other gradient in its
    parameter's dtype; zerolap reduces every gradient in one dtype (the parameters', or
    ``communication_data_type``'s), so a list naming modules is refused (an empty one, which
    reduces each gradient in its parameter's dtype there too, is accepted)."""

    enabled: bool = False
    dtype: DTypeName = "bf16"
    """The autocast dtype (DeepSpeed writes ``"torch.bfloat16"``); bf16 only (fp16 autocast
    needs a gradient scaler, which the ``fp16`` section is). Unset it is bf16 (DeepSpeed then
    takes torch's default for the device: fp16 on CUDA, bf16 on CPU)."""
    lower_precision_safe_modules: list[str] | None = None
    """DeepSpeed's: modules whose gradients it communicates in ``dtype``. Only ``[]``."""

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return torch_dtype(self.dtype)

    def _check(self, context: Mapping[str, Any]) -> list[Problem]:
        if not self.enabled:
            return []
        problems = []
        if self.dtype != "bf16":
            message = f"zerolap autocasts to bf16 only, got {self.dtype!r}"
            if self.dtype == "fp16":
                message += " (for fp16 use the fp16 section, which scales the loss)"
            problems.append(Problem(("dtype",), message))
        if self.lower_precision_safe_modules:
            message = "zerolap reduces every gradient in one dtype; per-module communication "
            message += "dtypes are not supported (an empty list is)"
            problems.append(Problem(("lower_precision_safe_modules",), message))
        return problems
