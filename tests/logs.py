"""Capture what zerolap's logger says, for tests that assert a message was logged."""

from __future__ import annotations

import contextlib
import logging

from zerolap.utils.logging import logger

__all__ = ["captured_logs"]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname}: {record.getMessage()}")


@contextlib.contextmanager
def captured_logs():
    """Yields the list of ``"LEVEL: message"`` strings logged inside the block."""
    handler = _Collect()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
