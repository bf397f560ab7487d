"""Sharded checkpoints: save and load at any world size and stage, and consolidation."""

from zerolap.checkpoint.consolidate import get_fp32_state_dict
from zerolap.checkpoint.files import CheckpointError

__all__ = ["CheckpointError", "get_fp32_state_dict"]
