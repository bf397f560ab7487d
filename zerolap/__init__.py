"""zerolap: ZeRO-sharded data-parallel training for PyTorch, DeepSpeed-compatible.

``import zerolap as deepspeed`` gives the names a DeepSpeed script uses: ``initialize``,
``init_inference``, ``init_distributed``, ``add_config_arguments``, ``comm``, ``zero``,
``utils``, ``accelerator``, ``checkpointing``, ``ops``, ``pipe``, ``runtime``, ``checkpoint``,
``inference``, each reachable along DeepSpeed's module paths (``zerolap.aliases``).
"""

import sys

from zerolap import (
    accelerator,
    aliases,
    checkpoint,
    checkpointing,
    comm,
    inference,
    ops,
    pipe,
    runtime,
    utils,
    zero,
)
from zerolap.accelerator import get_accelerator
from zerolap.comm import init_distributed
from zerolap.config import ConfigError, add_config_arguments
from zerolap.inference import DeepSpeedInferenceConfig, InferenceEngine, init_inference
from zerolap.pipe import PipelineEngine, PipelineModule
from zerolap.runtime.engine import DeepSpeedEngine, ZerolapEngine
from zerolap.runtime.initialize import initialize, tp_model_init
from zerolap.utils import RepeatingLoader, log_dist, logger

__version__ = "0.2.0"

DeepSpeedConfigError = ConfigError  # DeepSpeed's name for a rejected ds_config

__all__ = [
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "DeepSpeedInferenceConfig",
    "InferenceEngine",
    "PipelineEngine",
    "PipelineModule",
    "RepeatingLoader",
    "ZerolapEngine",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "checkpoint",
    "checkpointing",
    "comm",
    "get_accelerator",
    "inference",
    "init_distributed",
    "init_inference",
    "initialize",
    "log_dist",
    "logger",
    "ops",
    "pipe",
    "runtime",
    "tp_model_init",
    "utils",
    "zero",
]

aliases.link(sys.modules[__name__])  # deepspeed.runtime.zero.partition_parameters & co.
