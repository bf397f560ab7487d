"""The monitor sections of ds_config: ``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``.

Keys, spellings and defaults are DeepSpeed's (``deepspeed.monitor.config``): each block is off
unless ``enabled``, and a switched-on block whose package is missing is an error naming the
block before training starts (``zerolap.monitor``). What the engine writes, and when, is in
``zerolap.runtime.monitoring``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from zerolap.config.section import ConfigSection

__all__ = [
    "CSVConfig",
    "CometConfig",
    "DeepSpeedMonitorConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "get_monitor_config",
]


class TensorBoardConfig(ConfigSection):
    """TensorBoard event files, written by rank 0 (needs the ``tensorboard`` package)."""

    enabled: bool = False
    """Write the training events as TensorBoard scalars."""
    output_path: str = ""
    """The directory the job's directory goes in; empty means the working directory."""
    job_name: str = "DeepSpeedJobName"
    """The job's directory under ``output_path``: the event files go there."""


class CSVConfig(ConfigSection):
    """One CSV file per event name, written by rank 0 (no package needed)."""

    enabled: bool = False
    """Write the training events to CSV files."""
    output_path: str = ""
    """The directory the job's directory goes in; empty means the working directory."""
    job_name: str = "DeepSpeedJobName"
    """The job's directory under ``output_path``: the files go there."""


class WandbConfig(ConfigSection):
    """Weights & Biases, logged by rank 0 (needs the ``wandb`` package and its login)."""

    enabled: bool = False
    """Log the training events to a W&B run started by the engine."""
    group: str | None = None
    """The run's group."""
    team: str | None = None
    """The team (W&B's ``entity``) the run belongs to."""
    project: str = "deepspeed"
    """The run's project."""


class CometConfig(ConfigSection):
    """Comet, logged by rank 0 (needs ``comet_ml``); unset keys fall back to Comet's own
    configuration (its config file and ``COMET_*`` environment variables)."""

    enabled: bool = False
    """Log the training events to a Comet experiment started by the engine."""
    samples_log_interval: int = Field(100, ge=1)
    """Log an event again only once this many more samples have been trained since it was
    last logged."""
    project: str | None = None
    """The Comet project."""
    workspace: str | None = None
    """The Comet workspace."""
    api_key: str | None = None
    """The Comet API key."""
    experiment_name: str | None = None
    """The name given to the experiment."""
    experiment_key: str | None = None
    """The key of the experiment to log to (32 to 50 alphanumeric characters)."""
    online: bool | None = None
    """False keeps the experiment on this machine (Comet's offline mode)."""
    mode: Literal["get", "create", "get_or_create"] | None = None
    """Continue an existing experiment, always create one, or either (Comet's default)."""


class DeepSpeedMonitorConfig(ConfigSection):
    """The four monitor blocks together (DeepSpeed's ``monitor_config``)."""

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)

    @property
    def enabled(self) -> bool:
        """Whether any monitor is switched on."""
        return any(getattr(self, name).enabled for name in type(self).model_fields)


def get_monitor_config(param_dict: Mapping[str, Any]) -> DeepSpeedMonitorConfig:
    """The monitor blocks of a ds_config dict (DeepSpeed's function of the same name)."""
    blocks = DeepSpeedMonitorConfig.model_fields
    return DeepSpeedMonitorConfig(**{key: param_dict.get(key) or {} for key in blocks})
