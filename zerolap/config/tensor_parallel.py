"""``tensor_parallel``: DeepSpeed's AutoTP training section (``autotp_size`` ranks split each
layer's matrices; the rest of the job is data-parallel copies of those ranks).

Keys and meanings are DeepSpeed's. ``partition_config.layer_specs`` name layers by *parameter*
regexes (``re.match`` on e.g. ``model.layers.0.self_attn.o_proj.weight``); each spec's
``partition_type`` is ``column``, ``row`` or ``skip``, and ``shape: [k, -1]`` marks a fused
projection of k equal blocks (``[[q, kv, kv], -1]``: of those sizes), each split per head.
Specs come first; with ``use_default_specs`` the ``preset_model`` plan (or the one zerolap finds
for the model) follows. What zerolap does not implement of DeepSpeed's section (a non-default
``partition_dim``, ``embedding_partition_dim``) is an error naming the key, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field

from zerolap.config.errors import Problem
from zerolap.config.section import ConfigSection, DeepSpeedOnly, is_set

__all__ = ["InnerTPConfig", "LayerSpec", "PartitionConfig", "TensorParallelConfig"]


class LayerSpec(ConfigSection):
    """One entry of ``partition_config.layer_specs``."""

    patterns: list[str]
    """Regexes matched (``re.match``) against full parameter names; a layer matches when its
    weight's name does."""
    partition_type: Literal["column", "row", "skip"] = "column"
    """``column``: output features split; ``row``: input features split; ``skip``: replicated."""
    shape: list[Any] | None = None
    """``[k, -1]``: the output features are k equal fused blocks (QKV: 3), each split;
    ``[[q, kv, kv], -1]``: fused blocks of these sizes (fewer key/value heads than query
    heads), each split."""
    partition_dim: int | None = None
    """The split dimension; only the default (0 for column, 1 for row) is supported."""
    gather_output: bool = False
    """Column only: all-gather the output so the next layer sees it whole."""
    model_types: list[str] | None = None
    """Apply the spec only to models whose ``config.model_type`` is listed."""

    @property
    def parts(self) -> int | tuple[int, ...]:
        if self.shape is None:
            return 1
        blocks = self.shape[0]
        return blocks if isinstance(blocks, int) else tuple(blocks)

    def _check(self, context: Mapping[str, Any]) -> list[Problem]:
        problems = []
        shape = self.shape
        if shape is not None and not (
            len(shape) == 2 and shape[1] == -1 and _blocks_given(shape[0])
        ):
            message = "only [k, -1] (k equal fused blocks) or [[sizes...], -1] (fused blocks "
            message += f"of those sizes) along the split dimension is supported, got {shape!r}"
            problems.append(Problem(("shape",), message))
        elif shape is not None and self.parts != 1 and self.partition_type != "column":
            # A row split cuts the input features: fused output blocks would stay whole, so the
            # key would say nothing (DeepSpeed refuses it too).
            message = "fused blocks apply to column specs only; this spec is "
            problems.append(Problem(("shape",), message + repr(self.partition_type)))
        default_dim = {"column": 0, "row": 1}.get(self.partition_type)
        if self.partition_dim is not None and self.partition_dim != default_dim:
            message = f"only the default split dimension ({default_dim}) is supported"
            problems.append(Problem(("partition_dim",), message))
        if self.gather_output and self.partition_type != "column":
            problems.append(Problem(("gather_output",), "applies to column specs only"))
        return problems


def _blocks_given(blocks: Any) -> bool:
    """A positive block count, or a list of positive block sizes."""
    if isinstance(blocks, bool):
        return False
    if isinstance(blocks, int):
        return blocks >= 1
    return (
        isinstance(blocks, (list, tuple))
        and len(blocks) >= 1
        and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in blocks)
    )


class PartitionConfig(ConfigSection):
    """``tensor_parallel.partition_config``: which layers split how."""

    layer_specs: list[LayerSpec] = Field(default_factory=list)
    """Specs in priority order (the first matching one wins)."""
    use_default_specs: bool = True
    """After the specs, the ``preset_model`` plan (or the one found for the model)."""
    strict_mode: bool = False
    """Every ``nn.Linear`` must be matched by some spec (``skip`` counts), else an error."""
    embedding_partition_dim: int = 1
    """DeepSpeed's embedding split dimension; zerolap keeps embeddings of Hugging Face models
    replicated, as DeepSpeed's AutoTP training does, and accepts only the default."""
    lm_head_patterns: list[str] = Field(default_factory=lambda: ["lm_head", "embed_out"])
    """Names of LM heads, kept replicated (their logits feed the model's own loss)."""

    def _check(self, context: Mapping[str, Any]) -> list[Problem]:
        if self.embedding_partition_dim != 1:
            message = "zerolap keeps Hugging Face embeddings replicated; only 1 is accepted"
            return [Problem(("embedding_partition_dim",), message)]
        return []


class InnerTPConfig(ConfigSection):
    """``tensor_parallel.tp``: DeepSpeed's inner block, which AutoTP training fills in from
    ``autotp_size``."""

    tp_size: int = Field(1, ge=1)
    """1, or the same as ``autotp_size`` (with AutoTP on, DeepSpeed refuses any other)."""
    tp_grain_size: Annotated[int, DeepSpeedOnly()] = 1
    """DeepSpeed's granularity for uneven splits, not active in its training either; zerolap
    splits evenly or names the layer that does not divide."""


_KERNELS = "it swaps in DeepSpeed's inference kernels"
_POLICY = "it names the all-reduced layers; give them as partition_config.layer_specs"
_VOCAB_HEAD = (
    "true is not implemented: zerolap keeps a Hugging Face model's LM head replicated "
    "(partition_config.lm_head_patterns)"
)


class TensorParallelConfig(ConfigSection):
    """``tensor_parallel``: AutoTP training."""

    autotp_size: int = Field(0, ge=0)
    """Tensor-parallel degree T; 0 or 1 is off. T must divide the world size; ranks
    ``k*T .. k*T+T-1`` form one tensor group."""
    tp_overlap_comm: bool = False
    """DeepSpeed's: start each column-parallel layer's input-gradient all-reduce before its
    weight gradient is computed, and wait after (results are identical). Means
    ``overlap: backward``."""
    overlap: Literal["off", "backward", "full"] | None = None
    """zerolap's: which all-reduces hide. ``backward`` as ``tp_overlap_comm``; ``full`` also
    splits each block's micro-batch in two so that one half's forward all-reduces run under the
    other half's compute, and the backward likewise (results equal to rounding). Unset: what
    ``tp_overlap_comm`` says."""
    partition_config: PartitionConfig | None = None
    """Which layers split how; without it, the plan of ``preset_model`` or the one zerolap
    finds for the model (its demo GPT, Hugging Face GPT-2, Llama-style decoders)."""
    preset_model: str | None = None
    """A named plan: ``gpt`` (zerolap's demo), ``gpt2``, or a Llama-style Hugging Face
    ``model_type`` (``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma``, ``gemma2``,
    ``gemma3_text`` and the others ``tensor_parallel.plan`` lists), or ``opt``, ``gptj``,
    ``gpt_neo``, ``gpt_neox``, ``phi``, ``starcoder2``."""
    inner: InnerTPConfig = Field(
        default_factory=InnerTPConfig, validation_alias=AliasChoices("tp", "tensor_parallel")
    )
    """DeepSpeed's inner ``tp`` block (``tp_size`` 1 or ``autotp_size``)."""
    dtype: Annotated[Any, DeepSpeedOnly()] = None
    """DeepSpeed's AutoTP model dtype; training's precision is the fp16 / bf16 sections'."""
    keep_module_on_host: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed keeps checkpoint tensors on the host while it loads; zerolap's split reads
    the model where it is."""
    vocab_parallel_lm_head: bool | None = None
    """DeepSpeed's vocabulary-parallel LM head for Hugging Face models (true: refused); false
    and unset keep it replicated, which is what zerolap does (its own GPT's head is vocabulary
    parallel through ``zerolap.tensor_parallel``)."""
    vocab_parallel_ce_backend: Annotated[Literal["torch", "liger"], DeepSpeedOnly()] = "torch"
    """DeepSpeed's cross-entropy kernel for a vocabulary-parallel head."""
    injection_policy_tuple: Annotated[Any, DeepSpeedOnly(is_set, _POLICY)] = None
    """DeepSpeed's AutoTP injection policy."""
    replace_with_kernel_inject: bool = Field(
        False, validation_alias=AliasChoices("kernel_inject", "replace_with_kernel_inject")
    )
    """DeepSpeed's inference kernel injection (true: refused)."""

    @property
    def overlap_mode(self) -> str:
        """The overlap in force: ``overlap`` when set, else ``tp_overlap_comm``'s."""
        if self.overlap is not None:
            return self.overlap
        return "backward" if self.tp_overlap_comm else "off"

    def _check(self, context: Mapping[str, Any]) -> list[Problem]:
        problems = []
        if self.overlap == "off" and self.tp_overlap_comm:
            message = "overlap: off contradicts tp_overlap_comm: true; set one of them"
            problems.append(Problem(("overlap",), message))
        if self.size == 1:  # DeepSpeed reads the rest only for AutoTP (``_advise``)
            return problems
        if self.vocab_parallel_lm_head:
            problems.append(Problem(("vocab_parallel_lm_head",), _VOCAB_HEAD))
        if self.replace_with_kernel_inject:
            message = f"got True; zerolap does not implement this: {_KERNELS}"
            problems.append(Problem(("kernel_inject",), message))
        if self.inner.tp_size not in (1, self.size):
            message = f"tp_size {self.inner.tp_size} does not match autotp_size ({self.size})"
            problems.append(Problem(("tp",), message))
        return problems

    @property
    def size(self) -> int:
        """The tensor-parallel degree (1 when off)."""
        return max(self.autotp_size, 1)

    def _advise(self) -> list[Problem]:
        if self.size > 1:
            return []
        keys = ("tp_overlap_comm", "overlap", "partition_config", "preset_model")
        idle = [
            key
            for key in (*keys, "vocab_parallel_lm_head", "replace_with_kernel_inject")
            if key in self.model_fields_set and getattr(self, key) not in (None, False)
        ]
        if self.inner.tp_size != 1:
            idle.append("tp")
        if not idle:
            return []
        return [Problem(tuple(idle), "no effect without tensor_parallel.autotp_size > 1")]
