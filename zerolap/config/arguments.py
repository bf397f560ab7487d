"""``add_config_arguments``: the command-line flags DeepSpeed scripts expect."""

from __future__ import annotations

import argparse

__all__ = ["add_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's "DeepSpeed" argument group to ``parser`` and return it: ``--deepspeed``,
    ``--deepspeed_config`` and their deprecated spellings ``--deepscale``,
    ``--deepscale_config``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (a flag for user code; zerolap itself does not read it)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file."
    )
    group.add_argument(
        "--deepscale",
        default=False,
        action="store_true",
        help="Deprecated spelling of --deepspeed",
    )
    group.add_argument(
        "--deepscale_config",
        default=None,
        type=str,
        help="Deprecated spelling of --deepspeed_config",
    )
    return parser
