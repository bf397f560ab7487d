"""``deepspeed.compression.helper``, DeepSpeed's deprecated home of the dotted-path helpers, as
in DeepSpeed 0.19 (which warns the same way): use ``zerolap.utils.module_utils``."""

import warnings

from zerolap.utils.module_utils import recursive_getattr, recursive_setattr

warnings.warn(
    "deepspeed.compression.helper is deprecated; import recursive_getattr and "
    "recursive_setattr from deepspeed.utils.module_utils",
    FutureWarning,
    stacklevel=2,
)

__all__ = ["recursive_getattr", "recursive_setattr"]
