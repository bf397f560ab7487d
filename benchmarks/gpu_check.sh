#!/usr/bin/env bash
# On a lent GPU, in one call of the device tool, after `bash benchmarks/gpu_prepare.sh` here:
#
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
# 1. the CUDA paths' values (tests/cuda: ZeRO stages and offload on NCCL, tensor parallelism's
#    backward overlap on CUDA streams), 2. zerolap against plain PyTorch at every stage and with
#    offload (issues 14 and 11), 3. DeepSpeed 0.19.8's rows beside them, as long as the budget
#    lasts. Every log goes to $OUT as it is written, so a call cut short still brings back what
#    ran. BUDGET_S (default 480) is the seconds the whole script may take; the benchmark starts
#    no row after it.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
BUDGET_S=${BUDGET_S:-480}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
# The repository's zerolap, and (for the ds rows) the real DeepSpeed: no shim is installed here.
export PYTHONPATH=$PWD:/tmp/site
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import torch, deepspeed, pydantic
print("torch", torch.__version__, "cuda", torch.version.cuda, "deepspeed", deepspeed.__version__,
      "pydantic", pydantic.__version__)'
    nproc
} 2>&1 | tee "$OUT/device.txt"

timeout 240 python3 -m pytest -q -p no:cacheprovider tests/cuda 2>&1 | tee "$OUT/cuda_tests.log"

# A minute for the rows running when the budget ends, and 90 s for the accumulation pass.
left=$((BUDGET_S - SECONDS - 150))
if [ "$left" -gt 0 ]; then
    python3 benchmarks/gpu_bench.py --rounds 2 --budget-s "$left" --systems \
        plain z0 z1 z2 z3 z2-cpu z3-cpu ds0 ds1 ds2 ds3 ds2-cpu ds3-cpu \
        2>&1 | tee "$OUT/gpu_bench.log"
fi
# Offload with accumulation: later micro-batches' gradients added on the host off the backward.
left=$((BUDGET_S - SECONDS - 30))
if [ "$left" -gt 30 ]; then
    python3 benchmarks/gpu_bench.py --gas 4 --steps 8 --warmup 2 --rounds 1 --budget-s "$left" \
        --systems plain z2 z2-cpu ds2-cpu 2>&1 | tee "$OUT/gpu_bench_gas4.log"
fi
echo "gpu_check: ${SECONDS}s" | tee -a "$OUT/device.txt"
