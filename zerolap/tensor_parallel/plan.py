"""Turning a dense model into a tensor-parallel one: ``parallelize(model, group, plan)``.

A *plan* maps module names to styles, first matching rule wins:

* ``"colwise"``: an ``nn.Linear`` (or Hugging Face ``Conv1D``) becomes ``ColumnParallelLinear``
  (``Rule.parts`` > 1 for fused projections such as a GPT's QKV, split per block so each rank
  keeps whole heads);
* ``"rowwise"``: it becomes ``RowParallelLinear``;
* ``"vocab"``: an ``nn.Embedding`` becomes ``VocabParallelEmbedding``, an ``nn.Linear`` LM head a
  column-parallel layer over the vocabulary (keeping its tie to the embedding), and an
  ``nn.CrossEntropyLoss`` a ``VocabParallelCrossEntropy``, so logits are never gathered;
* ``"split_input"``: a module applied to a split activation, piece by piece (the per-head
  query/key norms of Qwen3 or Gemma 3 after a column-parallel projection, Apertus's learned
  activation between the MLP's projections): it stays whole on every rank, and since each
  rank's gradient for its weights comes from its own piece only, those gradients are summed
  over the tensor group in backward (a module without weights needs nothing);
* ``"skip"``: left replicated.

A plan is given as ``{regex: style}`` (``re.fullmatch`` on the module's qualified name), as a
list of ``Rule``, or found for the layouts zerolap knows (``auto_plan``): its own demo GPT, Hugging
Face GPT-2, Llama-style decoders (``_LLAMA_STYLE``: Llama, Mistral, Qwen2/3, Gemma 1-3 and
thirteen more ``model_type``s) and a few others (``_OTHER_DECODERS``: OPT, GPT-J, GPT-Neo,
GPT-NeoX, Phi, StarCoder2). Attention modules whose head counts are attributes get them divided
by T; a head count T does not divide is a named error, since a split that cuts through
a head computes something else silently.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import zerolap.comm as dist
from zerolap.tensor_parallel import lanes
from zerolap.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from zerolap.tensor_parallel.layers import (
    ColumnParallelLinear,
    Parts,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from zerolap.tensor_parallel.mappings import BACKWARD, all_reduce_now
from zerolap.tensor_parallel.overlap import Overlap, split_blocks

__all__ = [
    "STYLES",
    "Rule",
    "TPPlan",
    "auto_plan",
    "parallelize",
    "plan_from_config",
    "preset_plan",
]

STYLES = ("colwise", "rowwise", "vocab", "split_input", "skip")


@dataclass(frozen=True)
class Rule:
    """Modules whose qualified name matches ``pattern`` (``re.fullmatch``) take ``style``."""

    pattern: str
    style: str
    parts: Parts = 1
    """Fused projections: the output features are this many equal blocks (or blocks of these
    sizes), each split."""
    gather_output: bool = False
    """Column-parallel only: all-gather the output so the next layer sees it whole."""
    on_weight: bool = False
    """Match DeepSpeed's way: ``re.match`` on the module's weight name (``<module>.weight``)."""

    def matches(self, name: str) -> bool:
        if self.on_weight:
            return re.match(self.pattern, f"{name}.weight") is not None
        return re.fullmatch(self.pattern, name) is not None

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(
                f"tensor-parallel plan: style {self.style!r} for {self.pattern!r} is not one of "
                f"{', '.join(STYLES)}"
            )
        try:
            re.compile(self.pattern)
        except re.error as err:
            raise ValueError(f"tensor-parallel plan: bad pattern {self.pattern!r}: {err}") from err


@dataclass(frozen=True)
class TPPlan:
    """Rules, plus what to fix after the split: ``divide`` maps a module class name to the
    attributes (head counts, split widths) divided by T; ``heads`` names ``model.config``
    fields (head counts) that T must divide."""

    rules: tuple[Rule, ...]
    divide: dict[str, tuple[str, ...]] = field(default_factory=dict)
    heads: tuple[str, ...] = ()
    name: str = "custom"
    strict: bool = False
    """Every ``nn.Linear`` / ``Conv1D`` must be matched by a rule (``skip`` counts)."""


def _gpt_block_rules(block: str) -> tuple[Rule, ...]:
    """The demo GPT's blocks (named by the regex ``block``): QKV split per head, MLP in
    columns, both outputs in rows."""
    return (
        Rule(block + r"attn\.qkv", "colwise", parts=3),
        Rule(block + r"attn\.proj", "rowwise"),
        Rule(block + r"mlp\.0", "colwise"),
        Rule(block + r"mlp\.2", "rowwise"),
    )


def _gpt_plan() -> TPPlan:
    return TPPlan(
        rules=(
            *_gpt_block_rules(r"blocks\.\d+\."),
            Rule("tok_emb", "vocab"),
            Rule("head", "vocab"),
            Rule("criterion", "vocab"),
        ),
        divide={"CausalSelfAttention": ("n_head",)},
        name="zerolap GPT",
    )


def _gpt2_plan() -> TPPlan:
    block = r"(.*\.)?h\.\d+\."
    return TPPlan(
        rules=(
            Rule(block + r"attn\.c_attn", "colwise", parts=3),
            Rule(block + r"attn\.c_proj", "rowwise"),
            Rule(block + r"mlp\.c_fc", "colwise"),
            Rule(block + r"mlp\.c_proj", "rowwise"),
        ),
        divide={"GPT2Attention": ("num_heads", "split_size")},
        heads=("n_head",),
        name="Hugging Face GPT-2",
    )


def _attention_mlp_plan(
    name: str,
    qkv: str,
    out: str,
    up: str,
    down: str,
    *,
    extra: tuple[Rule, ...] = (),
    divide: dict[str, tuple[str, ...]] | None = None,
    heads: tuple[str, ...] = (),
) -> Callable[[], TPPlan]:
    """A decoder with separate query/key/value projections (``qkv``, a regex of their module
    paths inside a layer) and an MLP whose first matrices (``up``) feed one last (``down``):
    the projections and the MLP's first matrices in columns, the attention output and the
    MLP's last matrix in rows, then the ``extra`` rules."""

    def plan() -> TPPlan:
        return TPPlan(
            rules=(
                Rule(rf".*\.{qkv}", "colwise"),
                Rule(rf".*\.{out}", "rowwise"),
                Rule(rf".*\.{up}", "colwise"),
                Rule(rf".*\.{down}", "rowwise"),
                *extra,
            ),
            divide=divide or {},
            heads=heads,
            name=name,
        )

    return plan


_llama_plan = _attention_mlp_plan(
    "Llama-style decoder", r"self_attn\.(q|k|v)_proj", r"self_attn\.o_proj",
    r"mlp\.(gate|up)_proj", r"mlp\.down_proj",
    extra=(
        Rule(r".*\.self_attn\.(q_norm|k_norm|query_layernorm|key_layernorm)", "split_input"),
        Rule(r".*\.mlp\.act_fn", "split_input"),
    ),
    heads=("num_attention_heads", "num_key_value_heads"),
)  # fmt: skip


_OTHER_DECODERS = {
    "opt": _attention_mlp_plan(
        "OPT", r"self_attn\.(q|k|v)_proj", r"self_attn\.out_proj", "fc1", "fc2",
        divide={"OPTAttention": ("num_heads",)}, heads=("num_attention_heads",),
    ),
    "gptj": _attention_mlp_plan(
        "GPT-J", r"attn\.(q|k|v)_proj", r"attn\.out_proj", r"mlp\.fc_in", r"mlp\.fc_out",
        divide={"GPTJAttention": ("num_attention_heads",)}, heads=("n_head",),
    ),
    "gpt_neo": _attention_mlp_plan(
        "GPT-Neo", r"attn\.attention\.(q|k|v)_proj", r"attn\.attention\.out_proj",
        r"mlp\.c_fc", r"mlp\.c_proj",
        divide={"GPTNeoSelfAttention": ("num_heads",)}, heads=("num_heads",),
    ),
    "phi": _attention_mlp_plan(
        "Phi", r"self_attn\.(q|k|v)_proj", r"self_attn\.dense", r"mlp\.fc1", r"mlp\.fc2",
        extra=(Rule(r".*\.self_attn\.(q|k)_layernorm", "split_input"),),
        heads=("num_attention_heads", "num_key_value_heads"),
    ),
    # The fused projection holds each head's query, key and value rows together, so a plain
    # split of the rows gives each rank whole heads.
    "gpt_neox": _attention_mlp_plan(
        "GPT-NeoX", r"attention\.query_key_value", r"attention\.dense",
        r"mlp\.dense_h_to_4h", r"mlp\.dense_4h_to_h", heads=("num_attention_heads",),
    ),
    "starcoder2": _attention_mlp_plan(
        "StarCoder2", r"self_attn\.(q|k|v)_proj", r"self_attn\.o_proj", r"mlp\.c_fc",
        r"mlp\.c_proj", heads=("num_attention_heads", "num_key_value_heads"),
    ),
}  # fmt: skip
"""Other Hugging Face decoders with separate projections, by ``model_type``; head counts the
attention module keeps as attributes are divided by T (``divide``). Each is checked like the
Llama-style ones."""

_LLAMA_STYLE = (
    "apertus", "arcee", "cohere", "ernie4_5", "exaone4", "gemma", "gemma2", "gemma3_text",
    "granite", "helium", "hunyuan_v1_dense", "llama", "ministral", "mistral", "nemotron", "olmo",
    "qwen2", "qwen3", "seed_oss", "smollm3",
)  # fmt: skip
"""Hugging Face ``model_type``s whose decoder layers have Llama's projections (q/k/v/o, and
gate/up/down or up/down), each checked on 2 ranks against the dense model
(``tests/tensor_parallel/test_plan.py``). Not here: models whose query/key norms span every
head (OLMo 2 and 3), fused projections (Phi-3, GLM) and experts (Mixtral, Qwen-MoE)."""

_PRESETS = {
    "gpt": _gpt_plan,
    "gpt2": _gpt2_plan,
    **{model_type: _llama_plan for model_type in _LLAMA_STYLE},
    **_OTHER_DECODERS,
}


def preset_plan(name: str) -> TPPlan:
    """The plan zerolap keeps for ``name`` (``tensor_parallel.preset_model``)."""
    if name not in _PRESETS:
        raise ValueError(
            f"tensor_parallel.preset_model={name!r} is not a layout zerolap knows; known: "
            f"{', '.join(sorted(_PRESETS))} (or give partition_config.layer_specs)"
        )
    return _PRESETS[name]()


def _gpt_pipeline_plan() -> TPPlan:
    """The demo GPT as pipeline layers (``demo.gpt.pipeline_layers``): its blocks are layers
    named by their index; the embedding and LM head, tied across stages, stay whole."""
    return TPPlan(
        rules=_gpt_block_rules(r"\d+\."),
        divide={"CausalSelfAttention": ("n_head",)},
        name="zerolap GPT pipeline",
    )


def _is_block(layer, block: type) -> bool:
    """A pipeline layer (a module or a LayerSpec) that is the demo GPT's block."""
    return isinstance(layer, block) or getattr(layer, "typename", None) is block


def auto_plan(model: nn.Module) -> TPPlan:
    """The plan for a model of a layout zerolap knows, found from its classes and config."""
    from zerolap.demo.gpt import GPT, Block

    if isinstance(model, GPT):
        return _gpt_plan()
    layers = getattr(model, "layer_list", None)  # a PipelineModule: decided on the whole list
    if layers is not None and any(_is_block(layer, Block) for layer in layers):
        return _gpt_pipeline_plan()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in _PRESETS:
        return _PRESETS[model_type]()
    raise ValueError(
        f"tensor parallelism: no plan for a {type(model).__name__} (model_type={model_type!r}); "
        "give tensor_parallel.partition_config.layer_specs or tensor_parallel.preset_model, "
        "or call zerolap.tensor_parallel.parallelize(model, group, plan={regex: style})"
    )


def plan_from_config(config, model: nn.Module) -> TPPlan:
    """The plan a ds_config ``tensor_parallel`` section describes for ``model``: its
    ``partition_config.layer_specs`` first (LM heads named by ``lm_head_patterns`` kept
    whole), then, with ``use_default_specs``, the ``preset_model`` plan or ``auto_plan``."""
    partition = config.partition_config
    default = preset_plan(config.preset_model) if config.preset_model else None
    if partition is None:
        return default or auto_plan(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    rules = [Rule(rf"(.*\.)?{re.escape(p)}", "skip") for p in partition.lm_head_patterns]
    styles = {"column": "colwise", "row": "rowwise", "skip": "skip"}
    for spec in partition.layer_specs:
        if spec.model_types is not None and model_type not in spec.model_types:
            continue
        rules += [
            Rule(
                pattern,
                styles[spec.partition_type],
                parts=spec.parts,
                gather_output=spec.gather_output,
                on_weight=True,
            )
            for pattern in spec.patterns
        ]
    divide, heads, name = {}, (), "partition_config"
    if partition.use_default_specs:
        base = default or auto_plan(model)
        rules += base.rules
        divide, heads, name = base.divide, base.heads, f"partition_config + {base.name}"
    else:
        # Layer specs say column, row or skip only: the weights of a known layout that see a
        # split activation still need their gradients summed, whatever the specs split.
        try:
            base = default or auto_plan(model)
        except ValueError:  # a layout zerolap has no plan for: nothing known to add
            base = None
        if base is not None:
            rules += [rule for rule in base.rules if rule.style == "split_input"]
    return TPPlan(tuple(rules), divide, heads, name, strict=partition.strict_mode)


def as_plan(plan) -> TPPlan:
    if isinstance(plan, TPPlan):
        return plan
    if isinstance(plan, dict):
        return TPPlan(tuple(Rule(pattern, style) for pattern, style in plan.items()))
    return TPPlan(tuple(plan))


def parallelize(
    model: nn.Module,
    group,
    plan=None,
    *,
    overlap: Overlap | str = Overlap.OFF,
    match_required: bool = True,
) -> nn.Module:
    """Split ``model``'s layers over the tensor group ``group`` by ``plan`` (``auto_plan`` when
    None), in place, with the all-reduces ``overlap`` hides; returns ``model``. Every rank of
    the group must call it on the same dense model (same seed): each keeps its own slices.
    ``match_required=False``: a plan that matches nothing here is no error (a pipeline stage
    holding only embeddings; the caller checks the whole model)."""
    overlap = Overlap(overlap)
    count = dist.get_world_size(group)
    if count == 1:
        return model
    plan = auto_plan(model) if plan is None else as_plan(plan)
    _check_heads(model, plan, count)
    _divide(model, plan, count, apply=False)
    # Every rule decided and checked before the first layer is split: an error leaves the
    # model as it was.
    chosen = []
    for name, module in model.named_modules():
        rule = next((r for r in plan.rules if r.matches(name)), None)
        if rule is None and plan.strict and (isinstance(module, nn.Linear) or _transposed(module)):
            raise ValueError(
                f"tensor parallelism: {name} ({type(module).__name__}) matches no layer spec "
                "and partition_config.strict_mode is on"
            )
        if rule is not None and rule.style != "skip":
            chosen.append((name, module, rule))
    if not chosen and match_required:
        raise ValueError(
            f"tensor parallelism: the {plan.name} plan matched no module of the "
            f"{type(model).__name__}"
        )
    split: dict[int, nn.Parameter] = {}  # id(dense weight) -> its split (tied weights stay tied)
    if overlap is Overlap.FULL and not any(r.style == "rowwise" for _, _, r in chosen):
        raise ValueError(
            "tensor_parallel.overlap=full: the plan splits no row-parallel layer, so there is "
            "no forward all-reduce to hide"
        )
    overlap_backward = overlap is not Overlap.OFF
    # Every layer is split before any is put in place, so that a layer that cannot be split
    # leaves the model as it was.
    replacements = []
    for name, module, rule in chosen:
        try:
            replacements.append(
                (name, _convert(name, module, rule, group, split, overlap_backward))
            )
        except ValueError as error:
            raise ValueError(f"{error} (layer {name}, a {type(module).__name__})") from error
    for name, replacement in replacements:
        if replacement is not model.get_submodule(name):
            _replace(model, name, replacement)
    for _, module, rule in chosen:
        if rule.style == "split_input":
            _sum_gradients(module, group)
    _divide(model, plan, count, apply=True)
    if overlap is Overlap.FULL:
        split_blocks(model)
    return model


def _transposed(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` stores its weight ``(in, out)``."""
    return type(module).__name__ == "Conv1D"


def _convert(name, module, rule: Rule, group, split, overlap) -> nn.Module:
    kind = type(module).__name__
    linear = isinstance(module, nn.Linear) or _transposed(module)
    if rule.style == "colwise" and linear:
        layer = ColumnParallelLinear.from_dense(
            module,
            group=group,
            parts=rule.parts,
            gather_output=rule.gather_output,
            overlap_backward=overlap,
            transposed=_transposed(module),
        )
    elif rule.style == "rowwise" and linear:
        layer = RowParallelLinear.from_dense(module, group=group, transposed=_transposed(module))
    elif rule.style == "vocab" and isinstance(module, nn.Embedding):
        layer = VocabParallelEmbedding.from_dense(module, group=group)
        if id(module.weight) in split:  # its tied head came first
            layer.weight = split[id(module.weight)]
        split[id(module.weight)] = layer.weight
    elif rule.style == "vocab" and isinstance(module, nn.Linear):
        layer = ColumnParallelLinear.from_dense(
            module, group=group, overlap_backward=overlap, weight=split.get(id(module.weight))
        )
        split[id(module.weight)] = layer.weight
    elif rule.style == "split_input":
        per_head = [n for n, p in module.named_parameters() if p.dim() > 1]
        if per_head:  # Cohere's q_norm with use_qk_norm: a weight row per head
            raise ValueError(
                f"tensor parallelism: {name} ({kind}) applies {', '.join(per_head)} of shape "
                f"{tuple(module.get_parameter(per_head[0]).shape)}, a row per head; splitting "
                "such a weight by head is not implemented"
            )
        layer = module  # kept whole; its gradients are summed once the whole split is made
    elif rule.style == "vocab" and isinstance(module, nn.CrossEntropyLoss):
        if module.weight is not None or module.label_smoothing or module.reduction != "mean":
            raise ValueError(
                f"tensor parallelism: {name} ({kind}) uses class weights, label smoothing or a "
                "reduction other than mean, which the vocab-parallel cross-entropy does not"
            )
        layer = VocabParallelCrossEntropy(group, ignore_index=module.ignore_index)
    else:
        raise ValueError(
            f"tensor parallelism: the plan says {rule.style!r} for {name}, a {kind}; "
            "colwise/rowwise take nn.Linear or Conv1D, vocab takes nn.Embedding, an "
            "nn.Linear LM head or nn.CrossEntropyLoss, split_input any module"
        )
    return layer


def _sum_gradients(module: nn.Module, group) -> None:
    """Hooks summing the gradients of ``module``'s trainable weights over ``group`` (a frozen
    one gets no gradient to sum, and torch refuses hooks on it)."""
    for param in module.parameters():
        if param.requires_grad and not getattr(param, "tp_summed_grad", False):  # once each
            param.register_hook(functools.partial(_sum_over, group=group))
            param.tp_summed_grad = True


def _sum_over(grad: torch.Tensor, *, group) -> torch.Tensor:
    """A ``split_input`` module's weight gradient, summed over the tensor group: each rank
    computed the part its own piece of the activation contributes. Inside the full overlap's
    lanes it is left alone: the block returns the two halves' gradients added together to the
    outer backward, where this hook runs again, once."""
    if lanes.in_lanes():
        return grad
    return all_reduce_now(grad.clone(), group, name=BACKWARD)


def _replace(model: nn.Module, name: str, replacement: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, replacement)


def _check_heads(model: nn.Module, plan: TPPlan, count: int) -> None:
    config = getattr(model, "config", None)
    for key in plan.heads:
        value = getattr(config, key, None)
        if value is not None and value % count:
            raise ValueError(
                f"tensor parallelism: {key}={value} of the {type(model).__name__} is not "
                f"divisible by the tensor-parallel size {count}"
            )


def _divide(model: nn.Module, plan: TPPlan, count: int, *, apply: bool) -> None:
    for name, module in model.named_modules():
        # By the class or any base of it (transformers' FlashAttention2 variants subclass the
        # attention class the plan names).
        kinds = [cls.__name__ for cls in type(module).__mro__]
        found = next((plan.divide[kind] for kind in kinds if kind in plan.divide), ())
        for attribute in found:
            value = getattr(module, attribute)
            if value % count:
                raise ValueError(
                    f"tensor parallelism: {name}.{attribute}={value} is not divisible by the "
                    f"tensor-parallel size {count}"
                )
            if apply:
                setattr(module, attribute, value // count)
