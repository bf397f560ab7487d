"""ds_config, parsed into typed sections with DeepSpeed's keys, spellings and defaults.

``load_config(config, world_size=...)`` checks the whole config before training and raises one
``ConfigError`` naming every problem by its dotted key; ``ZerolapConfig.unsupported_keys()``
names the DeepSpeed keys that were accepted but are not implemented.
"""

from zerolap.config.activation_checkpointing import ActivationCheckpointingConfig
from zerolap.config.arguments import add_config_arguments
from zerolap.config.batch import BatchSize, resolve_batch_size
from zerolap.config.comms_logger import CommsLoggerConfig
from zerolap.config.errors import ConfigError
from zerolap.config.offload import OffloadOptimizerConfig, OffloadParamConfig
from zerolap.config.optimizer import OptimizerConfig
from zerolap.config.precision import BF16Config, FP16Config
from zerolap.config.root import ZerolapConfig, load_config, parse_config, read_config
from zerolap.config.scheduler import SchedulerConfig
from zerolap.config.section import ConfigSection
from zerolap.config.zero import ZeroConfig

__all__ = [
    "ActivationCheckpointingConfig",
    "BF16Config",
    "BatchSize",
    "CommsLoggerConfig",
    "ConfigError",
    "ConfigSection",
    "FP16Config",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "ZerolapConfig",
    "add_config_arguments",
    "load_config",
    "parse_config",
    "read_config",
    "resolve_batch_size",
]
