"""One writer per destination, each built from its ds_config block (``zerolap.config.monitor``).

File layouts and names are DeepSpeed's, so dashboards and scripts made for a DeepSpeed run read
a zerolap run unchanged: TensorBoard event files, and CSV files named after the event with its
slashes and spaces made underscores (``Train_Samples_lr.csv``, header ``step,lr``), both under
``output_path/job_name``. One difference: a CSV file that already has rows (a resumed run
writing to the same job) gets no second header line; DeepSpeed writes one per process.
"""

from __future__ import annotations

import csv
import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zerolap.config.monitor import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
from zerolap.monitor.monitor import Event, Monitor

__all__ = ["CometMonitor", "CsvMonitor", "TensorBoardMonitor", "WandbMonitor"]


def _job_dir(block: TensorBoardConfig | CSVConfig) -> Path:
    path = Path(os.path.join(block.output_path, block.job_name))
    path.mkdir(parents=True, exist_ok=True)
    return path


class TensorBoardMonitor(Monitor):
    """Scalars in TensorBoard event files under ``output_path/job_name``."""

    def __init__(self, block: TensorBoardConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = _job_dir(block)
        self.summary_writer = SummaryWriter(log_dir=str(self.log_dir))

    def write_events(self, event_list: Sequence[Event]) -> None:
        for name, value, step in event_list:
            self.summary_writer.add_scalar(name, value, step)
        # On disk at each step, so a crashed run keeps its curve up to the crash.
        self.summary_writer.flush()

    def close(self) -> None:
        self.summary_writer.close()


class CsvMonitor(Monitor):
    """One ``step,<name>`` CSV file per event under ``output_path/job_name``, appended to."""

    def __init__(self, block: CSVConfig) -> None:
        self.log_dir = _job_dir(block)

    def path(self, name: str) -> Path:
        """The file event ``name`` is written to."""
        return self.log_dir / (name.replace("/", "_").replace(" ", "_") + ".csv")

    def write_events(self, event_list: Sequence[Event]) -> None:
        for name, value, step in event_list:
            path = self.path(name)
            # Opened per row, so every row written is on disk whatever happens to the process.
            with path.open("a", newline="") as file:
                writer = csv.writer(file)
                if file.tell() == 0:
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, value])


class WandbMonitor(Monitor):
    """A Weights & Biases run, started here; the events of one step are logged together."""

    def __init__(self, block: WandbConfig) -> None:
        import wandb

        self.run = wandb.init(project=block.project, group=block.group, entity=block.team)

    def write_events(self, event_list: Sequence[Event]) -> None:
        by_step: dict[int, dict[str, Any]] = {}
        for name, value, step in event_list:
            by_step.setdefault(step, {})[name] = value
        for step, values in by_step.items():
            self.run.log(values, step=step)


class CometMonitor(Monitor):
    """A Comet experiment, started here; an event is logged again only once
    ``samples_log_interval`` more samples have been trained since it last was."""

    def __init__(self, block: CometConfig) -> None:
        import comet_ml

        # comet_ml renamed start()'s ``project`` to ``project_name`` (the old name warns).
        project_key = (
            "project_name" if "project_name" in inspect.signature(comet_ml.start).parameters
            else "project"
        )  # fmt: skip
        self.experiment = comet_ml.start(
            api_key=block.api_key,
            workspace=block.workspace,
            experiment_key=block.experiment_key,
            mode=block.mode,
            online=block.online,
            **{project_key: block.project},
        )
        if block.experiment_name is not None:
            self.experiment.set_name(block.experiment_name)
        self.samples_log_interval = block.samples_log_interval
        self._last_logged: dict[str, int] = {}

    def write_events(self, event_list: Sequence[Event]) -> None:
        for name, value, step in event_list:
            last = self._last_logged.get(name)
            if last is not None and step - last < self.samples_log_interval:
                continue
            self._last_logged[name] = step
            self.experiment.log_metric(name, value, step=step)
