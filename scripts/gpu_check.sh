#!/usr/bin/env bash
# GPU checks in one go (< 10 minutes on an H100/H200): the `gpu` tests, the GPU kernel and e2e benchmarks, the twin.
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
# The digital twin on CUDA: profile Qwen3-0.6B shapes (random weights, bf16, CuPy kernels), then the twin.
timeout 150 python -m lab profile --model qwen3-0.6b-random --device cuda --backend cupy --repeats 2 \
  --out "$out/profile_gpu.json" 2>&1 | tail -n 12 | tee "$out/twin_gpu.log"
timeout 90 python -m lab twin --model qwen3-0.6b-random --device cuda --backend cupy --profile "$out/profile_gpu.json" \
  --num-requests 64 --repeats 2 --out "$out/twin_gpu.csv" 2>&1 | tail -n 16 | tee -a "$out/twin_gpu.log"
