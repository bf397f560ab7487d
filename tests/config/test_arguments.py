"""add_config_arguments: DeepSpeed's command-line flags."""

from __future__ import annotations

import argparse

from zerolap.config import add_config_arguments


def parser() -> argparse.ArgumentParser:
    return add_config_arguments(argparse.ArgumentParser(prog="train"))


def test_defaults():
    args = parser().parse_args([])
    assert args.deepspeed is False and args.deepspeed_config is None
    assert args.deepscale is False and args.deepscale_config is None


def test_flags_parse():
    args = parser().parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"
    args = parser().parse_args(["--deepscale", "--deepscale_config", "old.json"])
    assert args.deepscale is True and args.deepscale_config == "old.json"


def test_returns_the_same_parser_with_a_deepspeed_group():
    base = argparse.ArgumentParser()
    assert add_config_arguments(base) is base
    assert "DeepSpeed" in [group.title for group in base._action_groups]
