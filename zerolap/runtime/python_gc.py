"""ds_config's ``disable_python_gc``: Python's automatic cyclic garbage collector stays off
while any engine that asked for it lives, so a collection never pauses one rank in the middle
of a step while the others wait for it in a collective; ``engine.collect_python_gc()`` runs
one where the training loop chooses.

The collector is one per process and engines may overlap (a reference model beside the
trained one), so engines take and give back a share of "off", and the collector comes back
on, if it was on, when the last share is given back. A process forked meanwhile (data loader
workers) gets its collector back on, since it has no engine.
"""

from __future__ import annotations

import gc
import os
import threading

from zerolap.utils.logging import logger

__all__ = ["acquire", "collect", "release"]

_lock = threading.Lock()
_holders = 0
_was_enabled = False


def acquire() -> None:
    """One more engine wants the collector off: collect once, then switch it off."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            if _was_enabled:
                found = gc.collect()
                gc.disable()
                logger.info(f"Python's cyclic GC is off while training ({found} objects collected)")
        _holders += 1


def release() -> None:
    """An engine that acquired is gone; the last one puts the collector back as it was."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and _was_enabled and not gc.isenabled():
            gc.enable()


def collect() -> int:
    """One collection now, the collector's state unchanged; the number of objects found."""
    return gc.collect()


def _forked_child() -> None:
    global _holders
    if _holders and _was_enabled:
        gc.enable()
    _holders = 0


os.register_at_fork(after_in_child=_forked_child)
