"""Inference with DeepSpeed's API: ``init_inference(model, config, **kwargs)`` returns an
``InferenceEngine`` that runs the model converted to the configured dtype, placed on the
accelerator and, with ``tensor_parallel.tp_size`` > 1, split over a tensor group.

*What* it computes is the model's own forward and ``generate``; *how it talks* is the split
layers' all-reduces (``zerolap.tensor_parallel``), over groups ``zerolap.topology`` forms.
"""

from zerolap.config.inference import DeepSpeedInferenceConfig
from zerolap.inference.engine import InferenceEngine, init_inference

__all__ = ["DeepSpeedInferenceConfig", "InferenceEngine", "init_inference"]
