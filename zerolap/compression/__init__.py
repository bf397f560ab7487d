"""``deepspeed.compression``: DeepSpeed's quantisation-aware training and pruning are not
implemented (their ds_config blocks are refused when enabled); only the deprecated ``helper``
module DeepSpeed-Chat still imports is here. It is imported on request, never eagerly, since
importing it warns."""
