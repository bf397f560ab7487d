"""The ``deepspeed`` command, as DeepSpeed lays it out: ``runner`` parses DeepSpeed's launcher
flags and hands the job to torchrun, ``launch`` is what each process runs."""

from zerolap.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME, main, torchrun_argv

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main", "torchrun_argv"]
