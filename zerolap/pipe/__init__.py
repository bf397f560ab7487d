"""``zerolap.pipe`` (``deepspeed.pipe``): pipeline parallelism over point-to-point messages.

* ``module``    what: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``; a stage builds its
                layers only
* ``partition`` which layers each stage holds (pure)
* ``schedule``  which step each stage runs when: 1F1B, forward-only, a simulator (pure)
* ``p2p``       how stages talk: tagged isend / irecv between neighbours, metadata once
* ``engine``    ``PipelineEngine``: ``train_batch`` / ``eval_batch`` on a ZeRO engine per stage
"""

from zerolap.pipe.engine import PipelineEngine, PipelineError
from zerolap.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from zerolap.pipe.p2p import PipeError, PipelineShapeError
from zerolap.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeError",
    "PipeModelDataParallelTopology",
    "PipelineEngine",
    "PipelineError",
    "PipelineModule",
    "PipelineParallelGrid",
    "PipelineShapeError",
    "ProcessTopology",
    "TiedLayerSpec",
]
