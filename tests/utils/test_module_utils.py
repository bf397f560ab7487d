"""Dotted-path access to submodules (``deepspeed.utils.module_utils``), and its deprecated
home ``deepspeed.compression.helper``, which warns only when imported."""

from __future__ import annotations

import subprocess
import sys

import torch

from zerolap.utils.module_utils import recursive_getattr, recursive_setattr


def test_recursive_getattr_and_setattr_follow_dotted_paths():
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.ReLU())
    assert recursive_getattr(model, "0.0") is model[0][0]
    assert recursive_getattr(model, "0.0.weight") is model[0][0].weight
    replacement = torch.nn.Linear(2, 3)
    recursive_setattr(model, "0.0", replacement)
    assert model[0][0] is replacement
    recursive_setattr(model, "1", torch.nn.Tanh())
    assert isinstance(model[1], torch.nn.Tanh)


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", code],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_deprecated_helper_warns_on_import_only():
    assert _python("import zerolap, zerolap.compression").returncode == 0
    done = _python("import zerolap.compression.helper")
    assert done.returncode != 0 and "FutureWarning" in done.stderr
    assert "deepspeed.utils.module_utils" in done.stderr
