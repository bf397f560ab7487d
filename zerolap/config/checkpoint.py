"""The ``checkpoint`` section of ds_config (DeepSpeed's keys and defaults)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

from zerolap.config.section import ConfigSection, DeepSpeedOnly

__all__ = ["CheckpointConfig"]


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


class CheckpointConfig(ConfigSection):
    """How ``save_checkpoint`` checks its tag and which tag a load picks; DeepSpeed's storage
    options, which zerolap's checkpoints do not need, are accepted and named in the engine's
    warning."""

    tag_validation: Annotated[Literal["WARN", "IGNORE", "FAIL"], BeforeValidator(_upper)] = "WARN"
    """What a save does when the ranks were given different tags ("Warn", "Ignore" or "Fail",
    in any case): fail on every rank, or save under rank 0's tag, saying so unless ignored."""
    load_universal: bool = False
    """``load_checkpoint`` without a tag loads the one ``latest_universal`` names: the output
    of DeepSpeed's ``ds_to_universal`` converter (``checkpoint.universal``). Without that file,
    the tag ``latest`` names (zerolap's and DeepSpeed's own checkpoints load at any world size
    and stage as they are); with neither, an error. A converted folder loads with or without
    this key when its tag is given."""
    use_node_local_storage: Annotated[bool, DeepSpeedOnly()] = False
    """DeepSpeed saves through each node's local disk."""
    parallel_write: Annotated[dict[str, Any] | None, DeepSpeedOnly()] = None
    """DeepSpeed's pipeline-stage parallel writes."""
    writer: Annotated[dict[str, Any] | None, DeepSpeedOnly()] = None
    """DeepSpeed's checkpoint writer (fast / decoupled)."""
    checkpoint_serialization: Annotated[bool, DeepSpeedOnly()] = True
    """DeepSpeed's torch serialisation switch."""
