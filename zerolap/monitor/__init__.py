"""``zerolap.monitor`` (``deepspeed.monitor``): training events written to TensorBoard, CSV
files, Weights & Biases and Comet, as the ds_config's monitor blocks ask.

``monitor`` holds ``MonitorMaster``, which the engine builds from those blocks; ``writers``
holds one writer per destination. Which events the engine writes, and when, is the engine's
business (``zerolap.runtime.monitoring``).
"""

from zerolap.monitor.monitor import Event, Monitor, MonitorError, MonitorMaster

__all__ = ["Event", "Monitor", "MonitorError", "MonitorMaster"]
