"""Each monitor writer on its own (one process, rank 0): what reaches W&B and Comet (through
recording stand-ins for their packages, which are not installed here), the CSV layout across a
resumed run, and the monitor blocks' config."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from zerolap.config import ConfigError, load_config
from zerolap.config.monitor import get_monitor_config
from zerolap.monitor import MonitorMaster
from zerolap.monitor.writers import CsvMonitor

EVENTS = [("Train/Samples/train_loss", 2.5, 32), ("Train/Samples/lr", 1e-3, 32)]


def _package(monkeypatch, name: str, **attributes) -> types.ModuleType:
    """A module importable as ``name`` holding ``attributes``."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    return module


class _Recorder:
    """Stands for a W&B run or a Comet experiment: records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, method: str):
        return lambda *args, **kwargs: self.calls.append((method, args, kwargs))


def test_wandb_starts_a_run_and_logs_each_steps_events_together(monkeypatch):
    started, run = [], _Recorder()
    _package(monkeypatch, "wandb", init=lambda **kw: started.append(kw) or run)
    config = get_monitor_config({"wandb": {"enabled": True, "group": "g", "team": "t"}})
    master = MonitorMaster(config)
    assert started == [{"project": "deepspeed", "group": "g", "entity": "t"}]
    master.write_events([*EVENTS, ("Train/Samples/lr", 2e-3, 64)])
    assert run.calls == [
        ("log", ({"Train/Samples/train_loss": 2.5, "Train/Samples/lr": 1e-3},), {"step": 32}),
        ("log", ({"Train/Samples/lr": 2e-3},), {"step": 64}),
    ]


@pytest.mark.parametrize("project_key", ["project_name", "project"])
def test_comet_starts_an_experiment_and_logs_each_event_every_interval(monkeypatch, project_key):
    started, experiment = [], _Recorder()

    # comet_ml's start() takes project_name in recent releases, project in older ones; the
    # writer reads which from the signature.
    if project_key == "project_name":

        def start(api_key=None, workspace=None, project_name=None, mode=None, **others):
            started.append({"api_key": api_key, "workspace": workspace, "mode": mode})
            started[-1][project_key] = project_name
            return experiment
    else:

        def start(api_key=None, workspace=None, project=None, mode=None, **others):
            started.append({"api_key": api_key, "workspace": workspace, "mode": mode})
            started[-1][project_key] = project
            return experiment

    _package(monkeypatch, "comet_ml", __version__="3.47.1", start=start)
    block = {
        "enabled": True, "project": "p", "workspace": "w", "api_key": "k",
        "experiment_name": "run-1", "mode": "create", "samples_log_interval": 100,
    }  # fmt: skip
    MonitorMaster(get_monitor_config({"comet": block})).write_events(
        [("Train/Samples/lr", float(step), step) for step in (32, 64, 96, 132, 160, 232)]
    )
    assert started == [{"api_key": "k", "workspace": "w", "mode": "create", project_key: "p"}]
    assert experiment.calls[0] == ("set_name", ("run-1",), {})
    logged = [(args, kw["step"]) for method, args, kw in experiment.calls[1:]]
    # First at 32, then at the first step 100 samples or more after the last one logged.
    assert [step for _, step in logged] == [32, 132, 232]
    assert logged[1] == (("Train/Samples/lr", 132.0), 132)


def test_comet_older_than_3_41_is_named(monkeypatch):
    _package(monkeypatch, "comet_ml", __version__="3.40.2")
    with pytest.raises(ConfigError, match=r"comet.enabled is true, but comet_ml 3.40.2 is older"):
        MonitorMaster(get_monitor_config({"comet": {"enabled": True}}))


def test_csv_files_after_a_resume_have_one_header(tmp_path):
    block = get_monitor_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path)}})
    MonitorMaster(block).write_events(EVENTS)
    MonitorMaster(block).write_events([("Train/Samples/lr", 5e-4, 64)])  # a resumed run
    lines = (tmp_path / "DeepSpeedJobName" / "Train_Samples_lr.csv").read_text().splitlines()
    assert lines == ["step,lr", "32,0.001", "64,0.0005"]
    assert CsvMonitor(block.csv_monitor).path("Train/My loss").name == "Train_My_loss.csv"


def test_nothing_enabled_builds_nothing():
    master = MonitorMaster(get_monitor_config({"wandb": {"enabled": False}}))
    assert not master.enabled and master.monitors == []
    master.write_events(EVENTS)  # nothing to write to


def test_monitor_blocks_are_checked_and_no_longer_unsupported():
    config = load_config(
        {
            "train_batch_size": 4,
            "tensorboard": {"enabled": True, "output_path": "logs/", "job_name": "run"},
            "csv_monitor": {"enabled": True},
        },
        world_size=1,
    )
    assert (
        config.tensorboard.job_name == "run" and config.csv_monitor.job_name == "DeepSpeedJobName"
    )
    assert config.monitor_config.enabled and not config.monitor_config.wandb.enabled
    assert config.unsupported_keys() == []
    with pytest.raises(ConfigError, match=r"tensorboard\.job_nme.*job_name"):
        load_config({"train_batch_size": 4, "tensorboard": {"job_nme": "x"}}, world_size=1)
    with pytest.raises(ConfigError, match=r"comet\.mode"):
        load_config({"train_batch_size": 4, "comet": {"mode": "append"}}, world_size=1)
    with pytest.raises(ConfigError, match=r"comet\.samples_log_interval"):
        load_config({"train_batch_size": 4, "comet": {"samples_log_interval": 0}}, world_size=1)


def test_deepspeed_module_paths():
    from zerolap.aliases import MODULES

    assert MODULES["monitor.monitor"] == "zerolap.monitor.monitor"
    assert MODULES["monitor.config"] == "zerolap.config.monitor"
