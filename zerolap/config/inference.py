"""The configuration of ``init_inference`` (DeepSpeed's ``DeepSpeedInferenceConfig``).

Keys, aliases and defaults are DeepSpeed 0.19.8's, given as a dict, a JSON file, keyword
arguments or both (a key given both ways with two values is an error, as in DeepSpeed).

What zerolap does with them: ``dtype`` converts the model; ``tensor_parallel`` (or the legacy
``mp_size`` / ``mpu``) splits it over a tensor group by zerolap's tensor-parallel plans (DeepSpeed
calls this AutoTP); ``keep_module_on_host`` and ``max_out_tokens`` mean what they say. The rest
belongs to DeepSpeed's fused inference kernels (``replace_with_kernel_inject``), CUDA graphs,
Triton, quantisation and sharded checkpoint loading, which zerolap does not have: asking for any
of them is an error naming the key, and the kernels' tuning keys set to a non-default value are
named in one warning, since without the kernels they have nothing to tune.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from zerolap.config.errors import ConfigError, Problem, format_validation_error, problems_error
from zerolap.config.section import ConfigSection, DeepSpeedOnly, enabled, is_set, is_true

__all__ = ["DeepSpeedInferenceConfig", "DeepSpeedTPConfig", "parse_inference_config"]

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "bfloat": torch.bfloat16,
    "int8": torch.int8,
}  # fmt: skip
"""DeepSpeed's dtype spellings (``DtypeEnum``), lower case."""


def _dtype(value: Any) -> Any:
    if isinstance(value, str):
        name = value.lower().removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"valid: {', '.join(_DTYPES)} or a torch.dtype")
        return _DTYPES[name]
    if not isinstance(value, torch.dtype):
        raise ValueError(f"a torch.dtype or one of {', '.join(_DTYPES)} is needed")
    return value


_KERNELS = (
    "DeepSpeed's fused inference kernels; leave it false: tensor_parallel.tp_size > 1 splits "
    "the model's own layers (AutoTP)"
)
_POLICY = (
    "zerolap splits by its own plans (Hugging Face GPT-2, OPT, GPT-J, GPT-Neo, GPT-NeoX, Phi, "
    "StarCoder2, Llama-style decoders such as Llama, Mistral, Qwen2/3 and Gemma 1-3, zerolap's "
    "GPT), not by injection policies; for another model call "
    "zerolap.tensor_parallel.parallelize(model, group, plan={name regex: 'colwise' | 'rowwise'})"
)
_LOADING = (
    "DeepSpeed loads sharded checkpoints into a model built on the meta device; load the weights "
    "into the model before init_inference"
)


class DeepSpeedTPConfig(ConfigSection):
    """``tensor_parallel`` (alias ``tp``): the model's layers split over a tensor group."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    enabled: bool = True
    """False: the model is not split, whatever ``tp_size`` says."""
    tp_size: int = Field(1, ge=1)
    """Ranks each copy of the model is split over. zerolap forms groups of this many
    consecutive ranks, one per copy (the world size must be a multiple); DeepSpeed forms one
    group of ranks 0 to ``tp_size`` - 1."""
    tp_grain_size: Annotated[int, DeepSpeedOnly()] = 64
    """DeepSpeed's granularity for splits that do not divide evenly; zerolap splits only
    evenly (a head count ``tp_size`` does not divide is an error)."""
    mpu: Any = None
    """A Megatron-style mpu whose model-parallel group is the tensor group."""
    tp_group: Any = None
    """The tensor group itself (a process group)."""

    @property
    def split(self) -> bool:
        return self.enabled and (
            self.tp_size > 1 or self.mpu is not None or self.tp_group is not None
        )


class DeepSpeedInferenceConfig(ConfigSection):
    """DeepSpeed's inference config, read by ``init_inference``."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    replace_with_kernel_inject: Annotated[
        bool,
        Field(validation_alias=AliasChoices("replace_with_kernel_inject", "kernel_inject")),
        DeepSpeedOnly(is_true, _KERNELS),
    ] = False
    """DeepSpeed swaps known Transformer layers for its fused kernels."""
    dtype: Annotated[torch.dtype, BeforeValidator(_dtype)] = torch.float16
    """The model is converted to this type (``model.half()`` / ``bfloat16()`` / ``float()``);
    DeepSpeed's default is float16. It must be one the accelerator supports."""
    tensor_parallel: DeepSpeedTPConfig = Field(
        default_factory=DeepSpeedTPConfig,
        validation_alias=AliasChoices("tensor_parallel", "tp"),
    )
    enable_cuda_graph: Annotated[
        bool, DeepSpeedOnly(is_true, "zerolap does not capture CUDA graphs")
    ] = False
    use_triton: Annotated[bool, DeepSpeedOnly(is_true, "DeepSpeed's Triton kernels")] = False
    triton_autotune: Annotated[bool, DeepSpeedOnly(is_true, "DeepSpeed's Triton kernels")] = False
    zero: Annotated[dict[str, Any] | None, DeepSpeedOnly()] = None
    """A ZeRO section DeepSpeed's inference engine keeps and does not use either."""
    triangular_masking: Annotated[
        bool,
        Field(validation_alias=AliasChoices("triangular_masking", "tm")),
        DeepSpeedOnly(),
    ] = True
    """The kernels' causal mask."""
    moe: Annotated[bool | dict[str, Any], DeepSpeedOnly()] = False
    """The kernels' mixture-of-experts groups (False, or a block without ``enabled: true``,
    is off)."""
    keep_module_on_host: bool = False
    """Leave the model where it is instead of moving it to the accelerator."""
    quant: Annotated[
        dict[str, Any] | None,
        DeepSpeedOnly(enabled, "quantised inference needs DeepSpeed's quantiser"),
    ] = None
    checkpoint: Annotated[str | dict[str, Any] | None, DeepSpeedOnly(is_set, _LOADING)] = None
    base_dir: Annotated[str, DeepSpeedOnly()] = ""
    """Where ``checkpoint``'s files are."""
    set_empty_params: Annotated[bool, DeepSpeedOnly()] = False
    """Meta-device loading."""
    save_mp_checkpoint_path: Annotated[
        str | None,
        DeepSpeedOnly(is_set, "DeepSpeed writes its kernels' sharded checkpoint there"),
    ] = None
    checkpoint_config: Annotated[
        dict[str, Any] | None,
        Field(validation_alias=AliasChoices("checkpoint_config", "ckpt_config")),
        DeepSpeedOnly(),
    ] = None
    """Sharded checkpoint loading."""
    return_tuple: Annotated[bool, DeepSpeedOnly()] = True
    """What the kernels' layers return."""
    training_mp_size: Annotated[int, DeepSpeedOnly()] = 1
    """The tensor-parallel size a loaded checkpoint was trained at."""
    replace_method: Annotated[str, DeepSpeedOnly()] = "auto"
    """Deprecated in DeepSpeed; no longer read there either."""
    injection_policy: dict | None = Field(
        None, validation_alias=AliasChoices("injection_policy", "injection_dict")
    )
    """Which layers of a module class end in an all-reduce once split (DeepSpeed's manual
    AutoTP). zerolap splits by its own plans, so with ``tp_size`` > 1 this is an error; with
    one rank per copy nothing is split and it has no effect (named in a warning)."""
    injection_policy_tuple: tuple | None = None
    """DeepSpeed's internal form of ``injection_policy``, treated alike."""
    config: Annotated[
        dict[str, Any] | None,
        Field(validation_alias=AliasChoices("config", "args")),
        DeepSpeedOnly(),
    ] = None
    """A model config for the kernels."""
    max_out_tokens: int = Field(
        1024, gt=0, validation_alias=AliasChoices("max_out_tokens", "max_tokens")
    )
    """``generate`` refuses an input longer than this, as DeepSpeed does."""
    min_out_tokens: Annotated[
        int,
        Field(validation_alias=AliasChoices("min_out_tokens", "min_tokens")),
        DeepSpeedOnly(),
    ] = 1
    """The kernels' workspace."""
    transposed_mode: Annotated[bool, DeepSpeedOnly()] = False
    """The kernels' weight layout."""
    # Legacy spellings of moe's keys (mp_size and mpu are rewritten into tensor_parallel).
    ep_size: Annotated[int, DeepSpeedOnly()] = 1
    ep_group: Annotated[
        Any, Field(validation_alias=AliasChoices("ep_group", "expert_group")), DeepSpeedOnly()
    ] = None
    ep_mp_group: Annotated[
        Any,
        Field(validation_alias=AliasChoices("ep_mp_group", "expert_mp_group")),
        DeepSpeedOnly(),
    ] = None
    moe_experts: Annotated[list, DeepSpeedOnly()] = Field(default_factory=lambda: [1])
    moe_type: Annotated[str, DeepSpeedOnly()] = "standard"

    @classmethod
    def _rewrite_legacy(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``mp_size`` and ``mpu``, DeepSpeed's older spellings, go into ``tensor_parallel``."""
        legacy = {key: data.pop(key) for key in ("mp_size", "mpu") if key in data}
        if not legacy:
            return data
        key = "tp" if "tp" in data else "tensor_parallel"
        section = data.get(key) or {}
        if isinstance(section, BaseModel):  # a DeepSpeedTPConfig: the keys it was given
            section = {name: getattr(section, name) for name in section.model_fields_set}
        if not isinstance(section, Mapping):
            return data  # pydantic names the wrong type
        section = dict(section)
        for old, new in (("mp_size", "tp_size"), ("mpu", "mpu")):
            if old not in legacy:
                continue
            if new in section and section[new] != legacy[old]:
                raise problems_error(
                    [Problem((old, f"{key}.{new}"), f"two values; give {key}.{new} only")]
                )
            section[new] = legacy[old]
        data[key] = section
        return data

    def _policy_keys(self) -> tuple[str, ...]:
        return tuple(
            self.config_key(name)
            for name in ("injection_policy", "injection_policy_tuple")
            if getattr(self, name) is not None
        )

    def _check(self, context: Mapping[str, Any]) -> list[Problem]:
        problems = []
        if self.dtype == torch.int8:
            problems.append(
                Problem(("dtype",), "int8 weights need DeepSpeed's quantiser, which zerolap lacks")
            )
        if self._policy_keys() and self.tensor_parallel.split:
            problems.append(Problem(self._policy_keys(), _POLICY))
        return problems

    def _advise(self) -> list[Problem]:
        if self._policy_keys() and not self.tensor_parallel.split:
            return [
                Problem(
                    self._policy_keys(),
                    "no effect: nothing is split without tensor_parallel.tp_size > 1",
                )
            ]
        return []


def parse_inference_config(
    config: Mapping[str, Any] | str | os.PathLike | None, kwargs: Mapping[str, Any]
) -> DeepSpeedInferenceConfig:
    """``init_inference``'s ``config`` (a dict, a JSON file or None) merged with its keyword
    arguments, checked: a key given both ways must have one value."""
    source = "inference config"
    if config is None:
        given: dict[str, Any] = {}
    elif isinstance(config, (str, os.PathLike)):
        source = f"inference config {os.fspath(config)}"
        try:
            given = json.loads(Path(config).read_text())
        except OSError as err:
            raise ConfigError(f"cannot read {source}: {err.strerror}") from None
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"{source} is not valid JSON: {err.msg} at line {err.lineno}"
            ) from None
    elif isinstance(config, Mapping):
        given = dict(config)
    else:
        raise ConfigError(
            f"init_inference(config=...) takes a dict or a JSON file's path; got "
            f"{type(config).__name__}"
        )
    for key in set(given) & set(kwargs):
        if given[key] != kwargs[key]:
            raise ConfigError(
                f"init_inference: {key} is {given[key]!r} in config and {kwargs[key]!r} as a "
                "keyword argument"
            )
    try:
        return DeepSpeedInferenceConfig.model_validate({**given, **kwargs})
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source=source)) from None
