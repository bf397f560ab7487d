"""``Monitor``, what every writer offers, and ``MonitorMaster``, the writers a config asks for.

Only global rank 0 writes, as in DeepSpeed: every rank computes the same learning rate, and
the loss a step reports is rank 0's. Every rank checks that the packages it would need are
installed, so a missing package fails ``initialize`` on all ranks alike (naming the block)
instead of failing rank 0 alone while the others go on into the first collective.
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
from collections.abc import Sequence
from typing import Any

import zerolap.comm as dist
from zerolap.config.errors import ConfigError
from zerolap.utils.logging import logger

__all__ = ["Event", "Monitor", "MonitorError", "MonitorMaster"]

Event = tuple[str, Any, int]
"""(name, value, step): DeepSpeed's event tuple; the engine's step is its global sample count."""

# block -> (package to import, the version it needs at least, what pip installs)
_PACKAGES = {
    "tensorboard": ("tensorboard", None, "tensorboard"),
    "wandb": ("wandb", None, "wandb"),
    "comet": ("comet_ml", (3, 41), '"comet_ml>=3.41"'),
}


class Monitor(abc.ABC):
    """One destination of training events."""

    @abc.abstractmethod
    def write_events(self, event_list: Sequence[Event]) -> None:
        """Record each ``(name, value, step)``."""

    def close(self) -> None:  # noqa: B027 (optional: writers without buffers need nothing)
        """Write out whatever is buffered; the monitor takes no more events."""


class MonitorMaster(Monitor):
    """The monitors ``monitor_config`` switches on (its ``tensorboard``, ``csv_monitor``,
    ``wandb`` and ``comet`` blocks: a ``ZerolapConfig`` or ``get_monitor_config(dict)``),
    built on global rank 0 only; ``write_events`` hands events to each of them there and does
    nothing elsewhere. A monitor whose writing fails is switched off with an error logged:
    losing a curve must not stop the training, nor leave rank 0 out of the next collective."""

    def __init__(self, monitor_config: Any) -> None:
        blocks = {block: getattr(monitor_config, block) for block, _, _ in _WRITERS}
        self.enabled = any(block.enabled for block in blocks.values())
        for name, block in blocks.items():
            if block.enabled and name in _PACKAGES:
                _require(name)
        self.tb_monitor = self.csv_monitor = self.wandb_monitor = self.comet_monitor = None
        if not self.enabled or _global_rank() != 0:
            return
        # Imported here: each writer's module is light, but its package is loaded only when a
        # block asks for it.
        from zerolap.monitor import writers

        for block, attribute, writer in _WRITERS:
            if blocks[block].enabled:
                try:
                    setattr(self, attribute, getattr(writers, writer)(blocks[block]))
                except Exception as error:
                    raise MonitorError(f"{block}: {type(error).__name__}: {error}") from error

    @property
    def monitors(self) -> list[Monitor]:
        """The monitors this rank writes to (none but on rank 0)."""
        found = (getattr(self, attribute) for _, attribute, _ in _WRITERS)
        return [monitor for monitor in found if monitor is not None]

    def write_events(self, event_list: Sequence[Event]) -> None:
        for block, attribute, _ in _WRITERS:
            monitor = getattr(self, attribute)
            if monitor is None:
                continue
            try:
                monitor.write_events(event_list)
            except Exception as error:
                setattr(self, attribute, None)
                logger.error(
                    f"the {block} monitor failed and writes nothing more: "
                    f"{type(error).__name__}: {error}"
                )

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()


class MonitorError(RuntimeError):
    """A monitor that could not start on this rank (the block and the cause named)."""


# block, MonitorMaster's attribute (DeepSpeed's names), writer class in ``writers``
_WRITERS = (
    ("tensorboard", "tb_monitor", "TensorBoardMonitor"),
    ("csv_monitor", "csv_monitor", "CsvMonitor"),
    ("wandb", "wandb_monitor", "WandbMonitor"),
    ("comet", "comet_monitor", "CometMonitor"),
)


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _require(block: str) -> None:
    """A ``ConfigError`` naming ``block`` unless its package is importable (and new enough)."""
    module, least, install = _PACKAGES[block]
    where = f"{block}.enabled is true, but"
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{where} the {module} package is not installed: pip install {install}")
    if least is not None:  # the module's own version: it is what gets imported
        version = str(getattr(importlib.import_module(module), "__version__", "0"))
        numbers = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
        if numbers < least:
            raise ConfigError(
                f"{where} {module} {version} is older than "
                f"{'.'.join(map(str, least))}: pip install {install}"
            )
