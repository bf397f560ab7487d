"""What sequence parallelism does inside the model: ``UlyssesSPAttentionHF`` (DeepSpeed's name
and constructor) wraps one of transformers' attention functions so that it sees whole
sequences (``exchange.to_heads``), and hands the rank its own tokens back
(``exchange.to_sequence``).

``register_with_transformers`` puts the wrapper in transformers' table of attention functions
under the name the model already uses (``sdpa``, ``flash_attention_2``, ...), so every branch
transformers takes for that name still runs and only the kernel call goes through the wrapper
(DeepSpeed's choice). The table is the process's: the wrapper then serves every model that
names that kernel, until the groups it was registered with are replaced (set up again with
another size, or a new process group), when it refuses to run by name.

On whole sequences the attention mask is dropped: transformers built it for the rank's piece,
and the kernels make the causal mask themselves when given none; position ids, which flash
attention reads to find packed sequences, are gathered whole. A module in eval mode with
``disable_in_eval`` runs the plain kernel on its own uncut batch, mask included (DeepSpeed
drops the mask there too, which changes left-padded evaluation). ``eager`` needs a full mask
and is refused, as DeepSpeed refuses it; so is ``flex_attention`` (Accelerate refuses it for
sequence parallelism too; DeepSpeed rebuilds a causal block mask, whatever the model's was).
"""

from __future__ import annotations

import torch

import zerolap.comm as dist
from zerolap.sequence_parallel import state
from zerolap.sequence_parallel.exchange import gather_rows, to_heads, to_sequence
from zerolap.utils.logging import logger

__all__ = ["UlyssesSPAttentionHF"]

_REFUSED = {
    "eager": "it needs the whole [seq, seq] attention mask, which sequence parallelism drops",
    "paged|eager": "it needs the whole [seq, seq] attention mask, which sequence parallelism drops",
    "flex_attention": "its block mask is built for the rank's piece of the sequence; zerolap "
    "does not rebuild it",
}


class UlyssesSPAttentionHF(torch.nn.Module):
    """One of transformers' attention functions (``attn``), run on whole sequences by the
    ``process_group``'s ranks, each for ``attn_head_count / S`` of the heads. Key and value
    heads are split the same way, or, when there are fewer of them than ranks, repeated so
    that each rank gets the one its query heads use. ``seq_length_is_variable=False`` fixes
    each rank's piece at ``local_seq_length`` tokens (of ``global_seq_length``), checked on
    every call, as ``batch_size`` is. ``disable_in_eval``: a module in eval mode runs the
    plain attention on the rank's own tokens (the Trainer evaluates without cutting
    sequences). ``num_hidden_layers`` is recorded only (DeepSpeed uses it for a debugging
    mode that skips attention)."""

    def __init__(
        self,
        attn,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size = batch_size
        self.attn_head_count = attn_head_count
        self.attn_head_size = attn_head_size
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.disable_in_eval = disable_in_eval
        if attn_head_count % size:
            raise ValueError(
                f"sequence parallelism: {attn_head_count} attention heads are not divisible by "
                f"the sequence-parallel size {size}"
            )
        if kv_head_count % size and size % kv_head_count:
            raise ValueError(
                f"sequence parallelism: {kv_head_count} key/value heads and the "
                f"sequence-parallel size {size}: one must divide the other"
            )
        # Fewer key/value heads than ranks: each is repeated so every rank gets one.
        self.kv_copies = max(size // kv_head_count, 1)
        if not seq_length_is_variable:
            if local_seq_length is None or global_seq_length is None:
                raise ValueError(
                    "sequence parallelism with seq_length_is_variable=False needs "
                    "local_seq_length and global_seq_length"
                )
            if local_seq_length * size != global_seq_length:
                raise ValueError(
                    f"sequence parallelism: local_seq_length {local_seq_length} x "
                    f"{size} ranks != global_seq_length {global_seq_length}"
                )
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.core_attn_implementation = None  # the name it answers (register_with_transformers)

    def _check(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        b, _, length, d = query.shape
        expected = (self.batch_size, self.attn_head_count, length, self.attn_head_size)
        if not self.seq_length_is_variable and length != self.local_seq_length:
            raise ValueError(
                f"sequence parallelism: this rank's piece of the sequence has {length} tokens, "
                f"but the sequence length was fixed at {self.global_seq_length} "
                f"({self.local_seq_length} per rank); pass seq_length_is_variable=True"
            )
        if query.shape != expected:
            raise ValueError(
                f"sequence parallelism: query of shape {tuple(query.shape)}, expected "
                f"[batch {self.batch_size}, heads {self.attn_head_count}, tokens, head_dim "
                f"{self.attn_head_size}] (micro_batch_size and the model's config)"
            )
        kv = (b, self.global_kv_head_count, length, d)
        if key.shape != kv or value.shape != kv:
            raise ValueError(
                f"sequence parallelism: key {tuple(key.shape)} / value {tuple(value.shape)}, "
                f"expected {kv}"
            )

    def forward(self, module, query, key, value, attention_mask, *args, **kwargs):
        """transformers' attention-function signature: ``query``/``key``/``value`` as
        ``[batch, heads, L, head_dim]``; returns ``(output [batch, L, heads x head_dim],
        weights)``."""
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        # The mask transformers made covers the rank's piece only: the kernel makes the causal
        # mask of the whole sequence itself.
        attention_mask = None
        self._check(query, key, value)
        if "position_ids" not in kwargs or kwargs["position_ids"] is None:
            raise ValueError(
                "sequence parallelism needs position_ids in every forward call (each token's "
                "place in the whole sequence); give them in every batch "
                "(UlyssesSPDataLoaderAdapter cuts them with the rest)"
            )
        group, size = self.process_group, self.world_size
        with torch.no_grad():
            kwargs["position_ids"] = torch.cat(gather_rows(kwargs["position_ids"], group, size), 1)
        if self.kv_copies > 1:
            key = key.repeat_interleave(self.kv_copies, dim=1)
            value = value.repeat_interleave(self.kv_copies, dim=1)
        query, key, value = (to_heads(x, group, size) for x in (query, key, value))
        # The kernel repeats each key/value head for its query heads by this module attribute,
        # which must count this rank's heads while it runs (and the model's after).
        saved = getattr(module, "num_key_value_groups", None)
        if saved is not None:
            module.num_key_value_groups = query.shape[1] // key.shape[1]
        try:
            out, weights = self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        finally:
            if saved is not None:
                module.num_key_value_groups = saved
        return to_sequence(out, group, size), weights

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ):
        """Set up sequence parallelism of ``sequence_parallel_size`` for the model (or its hub
        name or folder) and route transformers' ``core_attn_implementation`` through it;
        returns the ``mpu`` to give ``initialize`` (None for size 1: nothing to do)."""
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            logger.warning("register_with_transformers: max_length is deprecated; use seq_length")
            seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError(
                "register_with_transformers: give seq_length, or seq_length_is_variable=True"
            )
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        loaded = hasattr(model_name_or_path, "config")
        config = (
            model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
        )
        name = core_attn_implementation
        in_use = getattr(config, "_attn_implementation", None) if loaded else None
        if in_use is not None and in_use != name:
            raise ValueError(
                f"core_attn_implementation={name!r} but the model runs attn_implementation="
                f"{in_use!r}: give both the same"
            )
        if name in _REFUSED:
            raise ValueError(
                f"sequence parallelism does not run attn_implementation={name!r}: "
                f"{_REFUSED[name]}; use 'sdpa' or a flash attention"
            )
        if name not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(
                f"{name!r} is not one of transformers' attention implementations: "
                f"{sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())}"
            )
        if seq_length is not None and seq_length % sequence_parallel_size:
            raise ValueError(
                f"seq_length {seq_length} is not divisible by sequence_parallel_size "
                f"{sequence_parallel_size}"
            )
        state.initialize_sequence_parallel(sequence_parallel_size)
        text = config.get_text_config()
        heads = text.num_attention_heads
        core = ALL_ATTENTION_FUNCTIONS[name]
        core = getattr(core, "zerolap_core", core)  # registered before: wrap the kernel again
        attention = cls(
            attn=core,
            batch_size=micro_batch_size,
            attn_head_count=heads,
            attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
            kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
            num_hidden_layers=text.num_hidden_layers,
            process_group=state.get_sequence_parallel_group(),
            seq_length_is_variable=seq_length_is_variable,
            local_seq_length=None if seq_length is None else seq_length // sequence_parallel_size,
            global_seq_length=seq_length,
            disable_in_eval=disable_in_eval,
        )
        attention.core_attn_implementation = name
        mesh = state.current_mesh()

        def ulysses(module, query, key, value, attention_mask, *args, **kwargs):
            if not state.initialized() or state.current_mesh() is not mesh:
                raise RuntimeError(
                    f"the Ulysses attention registered for {name!r} talks over groups that "
                    "were replaced since (sequence parallelism set up again, or a new process "
                    "group): call UlyssesSPAttentionHF.register_with_transformers again"
                )
            return attention(module, query, key, value, attention_mask, *args, **kwargs)

        ulysses.zerolap_core = core
        ALL_ATTENTION_FUNCTIONS[name] = ulysses
        return state
