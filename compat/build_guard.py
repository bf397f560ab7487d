"""Build backend of the ``deepspeed`` shim: setuptools, after checking that no real DeepSpeed
is installed where the shim would go.

pip installs a distribution over another of the same name by uninstalling the old one, so the
check must happen before the wheel exists. The backend runs inside pip's isolated build
environment, which hides the target's site-packages; the target interpreter is asked directly,
in a child process that ignores the isolation's variables (``-E``) and runs outside the source
tree (whose own freshly built metadata would answer otherwise).
"""

from __future__ import annotations

import json
import subprocess
import sys

from setuptools import build_meta as _setuptools

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "find_deepspeed",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]

_PROBE = """
import importlib.metadata as metadata, json
try:
    dist = metadata.distribution("deepspeed")
except metadata.PackageNotFoundError:
    print("null")
else:
    print(json.dumps([dist.version, str(dist.locate_file(""))]))
"""


def find_deepspeed(python: str | None = None) -> tuple[str, str] | None:
    """(version, location) of the ``deepspeed`` distribution installed for ``python`` (by
    default the interpreter running the build, the one the shim would be installed into)."""
    python = python or sys.executable
    result = subprocess.run(
        [python, "-E", "-c", _PROBE], cwd="/", capture_output=True, text=True, check=True
    )
    found = json.loads(result.stdout)
    return None if found is None else (found[0], found[1])


def _refuse_real_deepspeed() -> None:
    found = find_deepspeed()
    if found is not None and "+zerolap" not in found[0]:
        version, location = found
        raise SystemExit(
            f"refusing to install zerolap's deepspeed shim: a real DeepSpeed {version} is "
            f"installed in {location} and this install would replace it. Use another virtual "
            "environment, or run `pip uninstall deepspeed` first if you mean to replace it."
        )


def _guarded(hook):
    def run(*args, **kwargs):
        _refuse_real_deepspeed()
        return hook(*args, **kwargs)

    run.__name__ = hook.__name__
    return run


build_wheel = _guarded(_setuptools.build_wheel)
build_editable = _guarded(_setuptools.build_editable)
prepare_metadata_for_build_wheel = _guarded(_setuptools.prepare_metadata_for_build_wheel)
prepare_metadata_for_build_editable = _guarded(_setuptools.prepare_metadata_for_build_editable)
build_sdist = _setuptools.build_sdist
get_requires_for_build_wheel = _setuptools.get_requires_for_build_wheel
get_requires_for_build_editable = _setuptools.get_requires_for_build_editable
get_requires_for_build_sdist = _setuptools.get_requires_for_build_sdist
