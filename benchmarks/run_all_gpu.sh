#!/usr/bin/env bash
# Everything that needs GPUs, in one command, results under $OUT (default ./out):
#   bash benchmarks/run_all_gpu.sh checks   # GPU test suite, profiled-share check, demo (GPUs 0,1) and, in parallel
#                                          # on GPUs 2,3 when present, the compression benchmark
#   bash benchmarks/run_all_gpu.sh lab      # the lab benchmark: mix2 + same2 (+ mix4 with 4 GPUs, and with 4 GPUs
#                                          # the GPU checks again on GPUs 0,1 while GPUs 2,3 benchmark)
#   bash benchmarks/run_all_gpu.sh monitor  # the monitor's GPU test and its overhead A/B (mix2, GPT + ResNet-50)
#   bash benchmarks/run_all_gpu.sh tokens   # token-balanced vs sample-count splits on a length-skewed set
#   bash benchmarks/run_all_gpu.sh rebalance  # P5: rank 0 of mix2 slows 2x at step 30; Lightning DDP, static shares,
#                                          # rebalance and the oracle on GPT-124M, rounds until 240 s (2 GPUs, limit 290 s)
#   bash benchmarks/run_all_gpu.sh sharded  # 2 GPUs, <= 560 s: P8, the 1.1B sharded pair vs Σ solo and Lightning
#                                          # FSDP, levers side by side (SHARDED_LEVERS); SHARDED_BIG=1: the ~8B check
#   bash benchmarks/run_all_gpu.sh goals    # 4 GPUs, <= 540 s: the throughput goals P1 (mix2), P2 (mix4), P3 (same2
#                                          # on NVLink and PCIe), P7 (hosts 2+2, periodic sync); 3 rounds each;
#                                          # $OUT gets goals.json, goals.txt, p1/p2/p3/p7 plots, logs.txt
#   bash benchmarks/run_all_gpu.sh hybrid   # 4 GPUs, <= 560 s: the hybrid layout with the overlapped stage exchange
#                                          # against one process over NCCL, the stage monitor test (3 GPUs), then
#                                          # BERT-base: late vs overlapped exchange, and profiled shares, with the
#                                          # monitor (exchange ms, MB)
#   bash benchmarks/run_all_gpu.sh rehearse # 2 GPUs: the rehearsal against the lab really run (the GPU suite's
#                                          # check); with 4 GPUs then the four-card lab (needs jsonargparse)
#   bash benchmarks/run_all_gpu.sh seed     # 4 GPUs: the seed's table (2x A100-80GB + 2x RTX3090 emulated), every
#                                          # layout; SEED_WORKLOADS=bert (default, <= 330 s) or gpt124m,gpt1.6b
#                                          # (<= 540 s); $OUT/seed gets the JSON, the plot and each layout's log;
#                                          # SEED_CPU=1: tiny shapes on 4 CPU ranks (a check of the arguments)
# Each step has its own time limit, so one hang cannot take the rest with it.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-out}
mkdir -p "$OUT"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>&1 | tee "$OUT/hardware.txt"

LOGS=$OUT  # where each step's log goes
TAIL=40    # log lines each step shows
step() {  # step NAME SECONDS GPUS command...
    local name=$1 limit=$2 devices=$3; shift 3
    echo "=== $name (GPUs $devices, limit ${limit}s)"
    local t0=$SECONDS
    # SIGTERM to the step's process group at the limit (the benchmarks then report what they measured), SIGKILL
    # 10 s later: nothing is left holding a GPU for the next step.
    CUDA_VISIBLE_DEVICES=$devices timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0))s"
    tail -n "$TAIL" "$LOGS/$name.log"
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
    rebalance)
        # The first round always runs; another starts only if it ends within --deadline-s (the limit is a backstop).
        step rebalance 290 0,1 python3 benchmarks/bench_rebalance.py --deadline-s 240 --out "$OUT/rebalance"
        ;;
    sharded)
        if [ -n "${SHARDED_BIG:-}" ]; then
            step sharded_big 560 0,1 python3 benchmarks/bench_sharded_pair.py --big --steps 5 --timeout 270 \
                --out "$OUT"
        else
            step sharded_pair 560 0,1 python3 benchmarks/bench_sharded_pair.py --steps 8 --timeout 120 --deadline-s 540 \
                ${SHARDED_LEVERS:+--levers "$SHARDED_LEVERS"} --out "$OUT"
        fi
        ;;
    hybrid)
        [ "$gpus" -ge 4 ] || { echo "hybrid needs 4 GPUs (found $gpus)"; exit 1; }
        step hybrid_exact 110 0,1,2,3 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_lab.py -k hybrid
        step stage_monitor 150 0,1,2 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_stage_monitor.py
        step hybrid_bert 280 0,1,2,3 python3 benchmarks/bench_hybrid.py --model bert --fast-card A100-80GB \
            --configs hybridlate,hybrid,hybridprofile --global-batch 160 --monitor --warmup 2 --steps 24 --timeout 90 \
            --out "$OUT/hybrid_bert"
        ;;
    rehearse)
        step rehearse_real 300 0,1 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_rehearse_real.py
        if [ "$gpus" -ge 4 ]; then
            step rehearse_four 280 0,1,2,3 python3 benchmarks/rehearse_check.py --model configs/rehearse_gpt_check.yaml \
                --lab A100-80GB,A100-80GB,RTX3090,RTX3090 --real-gpus --runs hetero_ddp,hetero_fsdp:keep,ddp,fsdp \
                --steps 10 --timeout 120 --out "$OUT/rehearse_four"
        fi
        ;;
    seed)
        # The driver's deadline leaves room for its last layout's kill (5 s + 5 s) and its report; the step's limit
        # is a backstop above it. SIGTERM at the limit still writes what was measured.
        workloads=${SEED_WORKLOADS:-bert}
        deadline=290 limit=325 TAIL=70  # the tail holds both tables of two workloads
        [ "$workloads" = bert ] || { deadline=500 limit=535; }
        if [ -n "${SEED_CPU:-}" ]; then
            cpu="--accelerator cpu --tiny --warmup 1 --steps 2 --layout-s 200" deadline=1500 limit=1600
        else
            [ "$gpus" -ge 4 ] || { echo "seed needs 4 GPUs (found $gpus)"; exit 1; }
            cpu="--warmup 2 --steps 10"
        fi
        step "seed_${workloads//[,.]/}" "$limit" 0,1,2,3 python3 benchmarks/bench_seed_lab.py --workloads "$workloads" $cpu \
            --deadline-s "$deadline" --out "$OUT/seed"
        ;;
    goals)
        # Two lanes of two GPUs, then all four. Each step's limit is a backstop above its --deadline-s (rounds that
        # would end past it are not started; a SIGTERM still reports what was measured). Lane A: P3 on identical
        # cards, NVLink then PCIe class (NCCL_P2P_DISABLE=1); lane B at the same time: P1, mix2 on PCIe class (the
        # two PCIe-class scenarios may share host memory bandwidth for a while). Then P2 (mix4) and P7 (2+2 hosts,
        # 10 GbE paced). Expected ~360-420 s on 4x H100 (from earlier runs: ~6-7 s per fit and ~15-25 s to start a
        # scenario's ranks); the limits add up to 235 + 165 + 110 = 510 s at most (+ 10 s per step to kill).
        # GOALS_P1_LEVERS: the lever configurations of mix2 (comma-separated; default the bf16 one: each adds ~12 s a
        # round, and the third round must still fit; e.g. hetero-explicit-bf16,hetero-explicit-view).
        # GOALS_CPU=1: the same steps on CPU with tiny models and few steps (a check of this script's arguments).
        if [ -n "${GOALS_CPU:-}" ]; then
            cpu="--accelerator cpu --tiny" lab_steps="--warmup 1 --steps 2" host_steps="--warmup 2 --steps 2 --every 2"
        else
            [ "$gpus" -ge 4 ] || { echo "goals needs 4 GPUs (found $gpus)"; exit 1; }
            cpu="" lab_steps="--warmup 4 --steps 16" host_steps="--warmup 8 --steps 40 --every 8"
        fi
        LOGS=${GOALS_WORK:-/tmp/lh_goals}
        rm -rf "$LOGS" && mkdir -p "$LOGS"
        TAIL=16
        rounds=${GOALS_ROUNDS:-3}
        lab="python3 benchmarks/bench_lab.py --models gpt,resnet50 --rounds $rounds $lab_steps $cpu"
        step p3 235 0,1 $lab --scenarios same2,same2-pcie --configs solo,ddp,hetero-equal --deadline-s 220 \
            --out "$LOGS/p3" >"$LOGS/lane_a.txt" 2>&1 &
        step p1 235 2,3 $lab --scenarios mix2 --configs solo,ddp,hetero-explicit,${GOALS_P1_LEVERS:-hetero-explicit-bf16} \
            --deadline-s 210 --out "$LOGS/p1"
        wait
        cat "$LOGS/lane_a.txt"
        step p2 165 0,1,2,3 $lab --scenarios mix4 --configs solo,ddp,hetero-explicit --deadline-s 140 \
            --out "$LOGS/p2"
        step p7 110 0,1,2,3 python3 benchmarks/bench_hosts.py --layout 2+2 --models gpt --links 10gbe \
            --configs solo,ddp,periodic --quick $host_steps --time-limit 80 $cpu --out "$LOGS/p7"
        python3 benchmarks/goals.py --lab "$LOGS/p3/bench_lab.json" "$LOGS/p1/bench_lab.json" \
            "$LOGS/p2/bench_lab.json" --hosts "$LOGS/p7/bench_hosts.json" --out "$LOGS" >"$LOGS/goals.txt" 2>&1
        # At most 8 files come back: the goals (all results inside goals.json), the plots, the logs in one file.
        cp "$LOGS/goals.json" "$LOGS/goals.txt" "$OUT/" 2>/dev/null
        for p in p1 p2 p3; do cp "$LOGS/$p/bench_lab.png" "$OUT/$p.png" 2>/dev/null; done
        cp "$LOGS/p7/bench_hosts.png" "$OUT/p7.png" 2>/dev/null
        { cat "$OUT/hardware.txt"; for f in "$LOGS"/*.log; do echo "=== $f"; tail -n 150 "$f"; done; } >"$OUT/logs.txt"
        rm -f "$OUT/hardware.txt"
        cat "$LOGS/goals.txt"
        ;;
esac
