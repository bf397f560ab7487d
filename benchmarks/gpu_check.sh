#!/usr/bin/env bash
# On a lent GPU, after `bash benchmarks/gpu_prepare.sh` here, in two calls of the device tool,
# the second at once after the first (a machine stays warm 30 s; a new start costs minutes of
# the session's 15):
#
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=360)
#   run(command="bash benchmarks/gpu_check.sh ds syncs", carry=[".whl"], timeout_s=360)
#
# Passes, as named in the arguments (default: tests interleaved zerolap gas):
#   tests    the CUDA paths' values (tests/cuda: ZeRO stages and offload on NCCL, tensor
#            parallelism's backward overlap on CUDA streams, a checkpoint from the GPU)
#   interleaved  plain PyTorch against zerolap's stages 0-3 in one process per round, taking
#            turns step by step (the ratios against plain: a lent host's speed moves between
#            processes), with each phase's host and device time
#   zerolap  plain PyTorch against zerolap at every stage and with offload (issues 14 and 11),
#            with each phase's host and device time (--phases)
#   gas      the offload rows with 4 micro-batches a step (accumulation's host additions)
#   ds       plain PyTorch against DeepSpeed 0.19.8's rows (their first rows JIT-build
#            FusedAdam and CPUAdam, a minute or more each)
#   syncs    the implicit host syncs per step of plain and of zerolap's rows (CUDA's sync debug
#            mode; a diagnosis of the step times, not a timing)
#   ab       a change against a base: the working tree and the commit gpu_prepare.sh put in
#            .ab/base (AB_BASE=REV; carry .ab too), four processes in the order base, change,
#            change, base, each running AB_SYSTEMS (default: plain z3 z3-blocks) by turns
#            (--interleaved --phases): each row's ratio to its own process's plain, per tree
#   profile  where stages 1-3 spend host and device time (torch's profiler and
#            cProfile over 3 steps of plain, z1, z2, z3 and z3-blocks, and the device idle time by
#            the phase of the step whose host work ended it; a diagnosis, not a timing)
# Every log goes to $OUT as it is written, so a call cut short still brings back what ran.
# BUDGET_S (default 300) is the seconds the call may take: each benchmark pass starts no row
# after its share, and a row started late may run a minute over.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
BUDGET_S=${BUDGET_S:-300}
PASSES=${*:-tests interleaved zerolap gas}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_check: no .whl/: run benchmarks/gpu_prepare.sh first and carry .whl" >&2
    exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
# The repository's zerolap, and (for the ds rows) the real DeepSpeed: no shim is installed here.
export PYTHONPATH=$PWD:/tmp/site
# DeepSpeed's JIT builds for the device's own architecture: left to itself on this image (an
# H200, torch 2.11), DeepSpeed 0.19.8 failed every GPU row with "invalid literal for int()
# with base 10: '0a'" before it built anything.
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(python3 -c 'import torch
print("%d.%d" % torch.cuda.get_device_capability())')} || exit 1
export TORCH_CUDA_ARCH_LIST
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv,noheader
    python3 -c 'import torch, deepspeed, pydantic
print("torch", torch.__version__, "cuda", torch.version.cuda, "deepspeed", deepspeed.__version__,
      "pydantic", pydantic.__version__)'
    nproc
} 2>&1 | tee "$OUT/device.txt"

bench() {  # bench LOG RESERVE_S ARGS...: gpu_bench with the budget left after RESERVE_S
    local log=$1 left=$((BUDGET_S - SECONDS - $2))
    shift 2
    if [ "$left" -gt 30 ]; then
        python3 benchmarks/gpu_bench.py --budget-s "$left" "$@" 2>&1 | tee "$OUT/$log"
    fi
}
for pass in $PASSES; do
    case $pass in
    tests)  # each test at most 100 s; -v names them as they end
        timeout 300 python3 -m pytest -v -rA -p no:cacheprovider --timeout 100 \
            --junitxml "$OUT/cuda_tests.xml" tests/cuda 2>&1 | tee "$OUT/cuda_tests.log" ;;
    interleaved)  # leaves 150 s for the per-row passes
        bench gpu_bench_interleaved.log 150 --interleaved --phases --rounds 2 \
            --systems plain z0 z1 z2 z3 z3-blocks ;;
    zerolap)  # leaves 60 s for the accumulation pass
        bench gpu_bench.log 60 --rounds 2 --phases \
            --systems plain z0 z1 z2 z3 z3-blocks z2-cpu z3-cpu ;;
    gas)
        bench gpu_bench_gas4.log 0 --gas 4 --steps 8 --warmup 2 --rounds 1 \
            --systems plain z2 z2-cpu ;;
    ds)  # leaves 60 s for the syncs pass
        bench gpu_bench_ds.log 60 --rounds 1 \
            --systems plain ds0 ds1 ds2 ds3 ds3-blocks ds2-cpu ds3-cpu ;;
    syncs)
        bench gpu_bench_syncs.log 0 --count-syncs --steps 3 --warmup 2 --rounds 1 \
            --systems plain z0 z2 z3 z2-cpu z3-cpu ;;
    ab)
        if [ ! -f .ab/base/REVISION ]; then
            echo "gpu_check: no .ab/base: run AB_BASE=REV benchmarks/gpu_prepare.sh, carry .ab" >&2
            exit 2
        fi
        echo "ab: base $(cat .ab/base/REVISION), change: the working tree" | tee "$OUT/gpu_bench_ab.log"
        for tree in base change change base; do
            dir=$PWD
            [ "$tree" = base ] && dir=$PWD/.ab/base
            left=$((BUDGET_S - SECONDS))
            [ "$left" -gt 30 ] || break
            # shellcheck disable=SC2086  # AB_SYSTEMS is a list of rows
            (cd "$dir" && PYTHONPATH=$dir:/tmp/site python3 benchmarks/gpu_bench.py \
                --budget-s "$left" --interleaved --phases --rounds 1 \
                --systems ${AB_SYSTEMS:-plain z3 z3-blocks}) 2>&1 |
                sed "s/^/$tree: /" | tee -a "$OUT/gpu_bench_ab.log"
        done ;;
    profile)
        bench gpu_profile.log 0 --profile --steps 3 --warmup 3 --rounds 1 \
            --systems plain z1 z2 z3 z3-blocks ;;
    *)
        echo "gpu_check: unknown pass '$pass' (tests, interleaved, zerolap, gas, ds, syncs, ab, profile)" >&2
        exit 2 ;;
    esac
done
echo "gpu_check ($PASSES): ${SECONDS}s" | tee -a "$OUT/device.txt"
