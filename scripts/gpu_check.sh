#!/usr/bin/env bash
# GPU checks in one go (< 5 minutes on an H100/H200): the `gpu` tests, then the GPU kernel benchmark.
# CSVs and logs go to $OUT when set (the device tool's output folder), else to benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu_info.csv"
# All `gpu` tests (kernel numerics and contracts vs the float64 reference; HF parity on CUDA, plain, chunked
# prefill and swap preemption; swap_blocks device <-> pinned host), then the CPU-side launcher and compiled-code
# checks, which run here as well.
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -n 40 | tee "$out/gpu_tests.log"
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_cupy_launcher.py 2>&1 | tail -n 5 | tee -a "$out/gpu_tests.log"
timeout 120 python -m lab bench kernels --device cuda --dtype bfloat16 --backends torch,cupy \
  --batch 1,8,64 --context 512,4096,32768 --block-size 16 --repeats 20 --out "$out/kernels_gpu.csv" \
  2>&1 | tee "$out/kernels_gpu.log"
if [ -f lab/bench/e2e.py ]; then
  timeout 120 python -m lab bench e2e --device cuda --model qwen3-0.6b-random --backend cupy --out "$out/e2e_gpu.csv" \
    2>&1 | tee "$out/e2e_gpu.log"
fi
