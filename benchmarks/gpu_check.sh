#!/usr/bin/env bash
# On a lent GPU, in one call of the device tool, after `bash benchmarks/gpu_prepare.sh` here:
#
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
# 1. the CUDA paths' values (tests/cuda: ZeRO stages and offload on NCCL, tensor parallelism's
#    backward overlap on CUDA streams), 2. zerolap against plain PyTorch at every stage and with
#    offload (issues 14 and 11), 3. DeepSpeed 0.19.8's rows, 4. offload with accumulation, each
#    as long as the budget lasts. Every log goes to $OUT as it is written, so a call cut short
#    still brings back what ran. BUDGET_S (default 480) is the seconds the whole script may take:
#    each pass starts no row after its share, and a row started late may run a minute over.
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
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv,noheader
    python3 -c 'import torch, deepspeed, pydantic
print("torch", torch.__version__, "cuda", torch.version.cuda, "deepspeed", deepspeed.__version__,
      "pydantic", pydantic.__version__)'
    nproc
} 2>&1 | tee "$OUT/device.txt"

# Each test's own limit is at most 150 s (tests/cuda); -v names them as they end.
timeout 330 python3 -m pytest -v -rA -p no:cacheprovider --junitxml "$OUT/cuda_tests.xml" \
    tests/cuda 2>&1 | tee "$OUT/cuda_tests.log"

bench() {  # bench LOG RESERVE_S ARGS...: gpu_bench with the budget left after RESERVE_S
    local log=$1 left=$((BUDGET_S - SECONDS - $2))
    shift 2
    if [ "$left" -gt 30 ]; then
        python3 benchmarks/gpu_bench.py --budget-s "$left" "$@" 2>&1 | tee "$OUT/$log"
    fi
}
# zerolap against plain PyTorch (issues 14 and 11), leaving time for the passes after it.
bench gpu_bench.log 200 --rounds 2 --systems plain z0 z1 z2 z3 z2-cpu z3-cpu
# DeepSpeed beside them: its first rows JIT-build FusedAdam and CPUAdam (a minute or more each).
bench gpu_bench_ds.log 60 --rounds 1 --systems plain ds0 ds1 ds2 ds3 ds2-cpu ds3-cpu
# Offload with accumulation: later micro-batches' gradients added on the host off backward.
bench gpu_bench_gas4.log 0 --gas 4 --steps 8 --warmup 2 --rounds 1 --systems plain z2 z2-cpu
echo "gpu_check: ${SECONDS}s" | tee -a "$OUT/device.txt"
