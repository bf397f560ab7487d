"""Shared helpers for the config tests."""

from __future__ import annotations

from typing import Any

import pytest

from zerolap.config import ConfigError, ZerolapConfig, load_config

BASE: dict[str, Any] = {"train_batch_size": 8}
"""The smallest valid ds_config (world size 1 or any divisor of 8)."""


def load(extra: dict[str, Any] | None = None, *, world_size: int = 1) -> ZerolapConfig:
    return load_config({**BASE, **(extra or {})}, world_size=world_size)


def load_error(extra: dict[str, Any], *, world_size: int = 1, base: bool = True) -> str:
    """The message of the ConfigError that loading ``extra`` (over BASE) raises."""
    config = {**BASE, **extra} if base else extra
    with pytest.raises(ConfigError) as error:
        load_config(config, world_size=world_size)
    return str(error.value)
