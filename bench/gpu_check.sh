#!/usr/bin/env bash
# One GPU check in at most 8 minutes on one H100/H200:
#   1. build the native extension (CUDA kernels included),
#   2. run the CUDA tests (marked `cuda`, or with "cuda" in their names),
#   3. run the step benchmark at GPU sizes (64M, 256M, 1B params, fp32 and bf16 +
#      fp32 master; GPT-2 small shapes; 8192 x 4096 tensors) on --device cuda,
#   4. time a GPT-2-small training iteration end to end (bench/e2e.py, world size 1 on
#      one GPU: DDP, torch's ZeRO, ZeroAdamW stage 1/2 with and without buckets and
#      overlap(); at one rank there is nothing to hide, so overlap must cost nothing;
#      and with offload="cpu", all of the state or half (offload_fraction=0.5) in pinned
#      host memory: its peak device memory and iteration time beside the others). The offload tests (tests/test_offload.py,
#      named cuda: pinned buffers, the state off the device) run in stage 2,
#   5. capture opt.step() in a CUDA graph (capturable=True) and replay it against eager
#      steps, bit for bit, and time it (bench/capture_check.py).
# Every stage runs under `timeout`; a failing stage does not stop the next one, and a
# summary with each stage's status closes the run. Logs, CSV, JSON and PNG go to DIR.
#
#   bench/gpu_check.sh DIR            the real check (needs an NVIDIA GPU)
#   bench/gpu_check.sh DIR --dry-run  the same stages on CPU at tiny sizes, to prove
#                                     the script runs (JIT CPU extension instead of a
#                                     pip build; two files' CUDA tests collected and
#                                     skipped; bench --quick --device cpu)
#
# GPU stage timeouts (seconds) add up to 555, under the 600 a device command may run,
# leaving room for the kill grace periods.
set -u

usage() { echo "usage: $0 DIR [--dry-run]" >&2; exit 2; }
[ $# -ge 1 ] || usage
OUT=$1; shift
DRY=0
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        *) usage ;;
    esac
done
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python}
# Compiled Triton on the GPU; conftest.py defaults to the interpreter otherwise.
export TRITON_INTERPRET=0
export PYTHONUNBUFFERED=1

STAGES=()
START_ALL=$(date +%s)

# run_stage NAME TIMEOUT_S CMD...: runs CMD under timeout, logs to OUT/NAME.log,
# records "NAME status seconds". pytest's exit 5 (nothing collected) is "none".
run_stage() {
    local name=$1 limit=$2; shift 2
    local log="$OUT/$name.log" t0 rc status
    t0=$(date +%s)
    echo "== [$name] (timeout ${limit}s) $*" | tee "$log"
    timeout --kill-after=5 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status="TIMEOUT after ${limit}s" ;;
        5) if [[ $name == test* ]]; then status="none collected"; else status="FAIL rc=5"; fi ;;
        *) status="FAIL rc=$rc" ;;
    esac
    tail -n 25 "$log"
    STAGES+=("$(printf '%-14s %-24s %4ss  %s' "$name" "$status" "$(( $(date +%s) - t0 ))" "$log")")
}

if [ $DRY -eq 1 ]; then
    run_stage info 30 "$PY" -m zero_triton info
    run_stage build 120 "$PY" -c "
from zero_triton.native import ext as _ext
mod = _ext.load()
print('zero_triton._C:', mod, '| reason:', _ext.unavailable_reason(), '| cuda kernels:', _ext.cuda_available())
raise SystemExit(0 if mod is not None else 1)"
    # Two of the files that hold CUDA tests: collecting the whole suite twice took ~50 s.
    run_stage test-marked 90 "$PY" -m pytest tests/test_native.py tests/test_side_stream.py -q -n0 \
        -m cuda -p no:cacheprovider
    run_stage test-named 60 "$PY" -m pytest tests/test_native.py tests/test_side_stream.py -n0 \
        tests/test_serve.py -q -k cuda -m "not cuda" -p no:cacheprovider
    # Every provider the GPU run can have, less DeepSpeedCPUAdam: a CPU-only provider the
    # GPU stage never runs, whose first use in a new environment compiles cpu_adam (87 s
    # of a core) for a row nothing checks.
    run_stage bench 150 "$PY" bench/step.py --quick --device cpu --out "$OUT" \
        --providers zt-cpu,zt-triton,zt-torch,torch-loop,torch-foreach,torch-fused,torch-composite,copy
    # No e2e stage: tests/test_e2e_bench.py runs bench/e2e.py at this size, every configuration.
    run_stage capture 90 "$PY" bench/capture_check.py --dry-run
else
    # info compiles the CPU extension on a fresh machine (~20 s): give it room.
    run_stage info 45 bash -c "nvidia-smi; $PY -m zero_triton info"
    # --no-deps: the GPU machine may be offline; torch and triton are there already.
    run_stage build 165 env ZERO_TRITON_BUILD_EXT=1 "$PY" -m pip install --no-build-isolation --no-deps -e .
    # test-marked includes FSDP2 on the GPU with the compiled list kernel (tests/test_dtensor.py).
    run_stage test-marked 70 "$PY" -m pytest tests -q -n0 -m cuda -p no:cacheprovider
    # test-named includes two gloo ranks on the GPU (tests/test_side_stream.py), the
    # low-bit moments' Triton and CUDA kernels (tests/test_int8.py: int8 and bf16;
    # tests/test_int4.py: int4), ZeroAdam's gradient release on side streams
    # (tests/test_zero_release.py), and the
    # shard server's GPU path (tests/test_serve.py: the host copy after the state's event
    # while the main stream spins; rank 0's state_dict() of two gloo ranks on the GPU).
    run_stage test-named 90 "$PY" -m pytest tests -q -n0 -k cuda -m "not cuda" -p no:cacheprovider
    # The benchmark drops its slow multi-pass providers by itself at sizes whose
    # buffers would not all fit in device memory.
    run_stage bench 70 "$PY" bench/step.py --device cuda --sizes 64M,256M,1B \
        --cases fp32,bf16,gpt2,many --repeats 20 --out "$OUT"
    run_stage e2e 70 "$PY" bench/e2e.py --device cuda --ranks 1 --steps 10 --warmup 3 \
        --layers 12 --width 768 --heads 12 --vocab 50304 --seq 512 --batch 8 --out "$OUT"
    # capturable=True: opt.step() captured in a CUDA graph, 20 replays against 20 eager
    # steps bit for bit (FusedAdamW, ZeroAdamW at world size 1 on NCCL, torch.compile's
    # reduce-overhead), and a replayed step's time against an eager one.
    run_stage capture 45 "$PY" bench/capture_check.py
fi

echo
echo "== summary ($(( $(date +%s) - START_ALL ))s total, $( [ $DRY -eq 1 ] && echo dry-run || echo gpu ))" | tee "$OUT/summary.txt"
FAILED=0
for line in "${STAGES[@]}"; do
    echo "$line" | tee -a "$OUT/summary.txt"
    case $line in *FAIL*|*TIMEOUT*) FAILED=1 ;; esac
done
for f in "$OUT"/step_*.csv "$OUT"/step_*.json "$OUT"/step_*.png "$OUT"/e2e_*; do
    [ -e "$f" ] && echo "result: $f" | tee -a "$OUT/summary.txt"
done
exit $FAILED
