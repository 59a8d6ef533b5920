#!/usr/bin/env bash
# Everything that needs GPUs, in one command, results under $OUT (default ./out):
#   bash benchmarks/run_all_gpu.sh checks   # GPU test suite, profiled-share check, demo (GPUs 0,1) and, in parallel
#                                          # on GPUs 2,3 when present, the compression benchmark
#   bash benchmarks/run_all_gpu.sh lab      # the lab benchmark: mix2 + same2 (+ mix4 with 4 GPUs, and with 4 GPUs
#                                          # the GPU checks again on GPUs 0,1 while GPUs 2,3 benchmark)
#   bash benchmarks/run_all_gpu.sh monitor  # the monitor's GPU test and its overhead A/B (mix2, GPT + ResNet-50)
#   bash benchmarks/run_all_gpu.sh tokens   # token-balanced vs sample-count splits on a length-skewed set
# Each step has its own time limit, so one hang cannot take the rest with it.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-out}
mkdir -p "$OUT"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/hardware.txt"

step() {  # step NAME SECONDS GPUS command...
    local name=$1 limit=$2 devices=$3; shift 3
    echo "=== $name (GPUs $devices, limit ${limit}s)"
    local t0=$SECONDS
    CUDA_VISIBLE_DEVICES=$devices timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0))s"
    tail -n 40 "$OUT/$name.log"
}

case "${1:-checks}" in
    checks)
        pair2=0,1
        [ "$gpus" -ge 4 ] && pair2=2,3
        if [ "$pair2" = "2,3" ]; then
            step compression 430 2,3 python3 benchmarks/compression_bench.py --out "$OUT/compression" >"$OUT/lane2.txt" 2>&1 &
        fi
        step gpu_tests 900 0,1 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu tests/grad/test_compression.py
        step profile_check 120 0,1 python3 benchmarks/profile_check.py --out "$OUT/profile"
        step demo 90 0,1 python3 examples/train_digits.py
        wait
        [ -f "$OUT/lane2.txt" ] && cat "$OUT/lane2.txt"
        if [ "$pair2" = "0,1" ]; then
            step compression 430 0,1 python3 benchmarks/compression_bench.py --out "$OUT/compression"
        fi
        ;;
    monitor)
        step gpu_monitor_test 200 0,1 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_monitor.py
        step monitor_overhead 360 0,1 python3 benchmarks/monitor_overhead.py --accelerator gpu --out "$OUT/monitor"
        ;;
    tokens)
        step token_balance 500 0,1 python3 benchmarks/token_balance.py --accelerator gpu --devices 2 --out "$OUT/tokens"
        ;;
    lab)
        # With 4 GPUs the 2-GPU scenarios run on GPUs 2,3 while GPUs 0,1 re-run the GPU checks; then mix4 on all.
        if [ "$gpus" -ge 4 ]; then
            step lab2 330 2,3 python3 benchmarks/bench_lab.py --scenarios mix2,same2 --out "$OUT/lab2" >"$OUT/lane2.txt" 2>&1 &
            step gpu_tests 200 0,1 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_lab.py tests/grad/test_compression.py
            step profile_check 120 0,1 python3 benchmarks/profile_check.py --out "$OUT/profile"
            wait
            cat "$OUT/lane2.txt"
            step lab4 200 0,1,2,3 python3 benchmarks/bench_lab.py --scenarios mix4 --out "$OUT/lab4"
        else
            step lab2 330 0,1 python3 benchmarks/bench_lab.py --scenarios mix2,same2 --out "$OUT/lab2"
        fi
        ;;
esac
