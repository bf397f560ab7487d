"""zerolap's messages go through one ``logging`` logger (``deepspeed.utils.logger``), so a
client's level governs them, as the Trainer sets it."""

from __future__ import annotations

import logging

from tests.logs import captured_logs
from zerolap.config import load_config
from zerolap.runtime.lr_schedules import WarmupDecayLR
from zerolap.utils import log_dist, logger


def test_the_level_a_client_sets_governs_zerolap_messages():
    optimizer = torch_sgd()
    with captured_logs() as logs:
        logger.setLevel(logging.ERROR)  # what the Trainer does for replicas
        WarmupDecayLR(optimizer, total_num_steps=1, warmup_num_steps=5)
        logger.setLevel(logging.WARNING)
        WarmupDecayLR(optimizer, total_num_steps=1, warmup_num_steps=5)
    assert len(logs) == 1 and "total_num_steps 1" in logs[0]
    assert logger.name == "zerolap" and not logger.propagate


def test_log_dist_without_a_process_group_logs_with_the_rank():
    with captured_logs() as logs:
        log_dist("hello", ranks=[0])
    assert logs == ["INFO: [Rank -1] hello"]


def test_config_warnings_name_the_key():
    config = load_config(
        {"train_batch_size": 2, "zero_optimization.reduce_bucket_size": 10}, world_size=1
    )
    assert config.unknown_keys() == [
        "zero_optimization.reduce_bucket_size (did you mean zero_optimization?)"
    ]


def torch_sgd():
    import torch

    return torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
