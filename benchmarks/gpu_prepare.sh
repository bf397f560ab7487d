#!/usr/bin/env bash
# Here, before a lent GPU's first call: the wheels its image lacks, into .whl/ (ignored by git;
# the call carries it). The device's python3 is CPython 3.12 on x86-64 with torch, psutil, tqdm,
# matplotlib, pytest and pytest-timeout (the device tool's KINDS.md), but no pydantic, which
# zerolap needs, and no hjson, which DeepSpeed needs. DeepSpeed 0.19.8 itself goes as the
# pure-Python wheel that DS_BUILD_OPS=0 builds; there it JIT-builds the ops it uses.
# About 20 MB in all; a minute here, no device time.
#
# AB_BASE=REV (a commit): also the zerolap and benchmarks of REV into .ab/base/ (ignored by
# git; the call carries it too), for gpu_check.sh's `ab` pass, which runs the working tree
# against it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [ ! -x "$PY" ]; then
    echo "gpu_prepare: no $PY: run 'make .venv/.installed' first (or set PYTHON)" >&2
    exit 2
fi
rm -rf .whl
mkdir .whl
# zerolap's pydantic as installed here, with the versions of its own dependencies it was tested
# with, built for the device's interpreter (typing-extensions too: this pydantic needs >= 4.16,
# which the image's copy may not be).
pins=$("$PY" -c 'from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in
      ("pydantic", "pydantic-core", "annotated-types", "typing-inspection",
       "typing-extensions")))')
# shellcheck disable=SC2086  # $pins is a list of requirements
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl $pins hjson
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
du -sh .whl
ls .whl
if [ -n "${AB_BASE:-}" ]; then
    rm -rf .ab/base
    mkdir -p .ab/base
    git archive "$AB_BASE" zerolap benchmarks | tar -x -C .ab/base
    git rev-parse --short "$AB_BASE" >.ab/base/REVISION
    echo "gpu_prepare: .ab/base holds $(cat .ab/base/REVISION): carry .ab too"
fi
