#!/usr/bin/env bash
# GPU checks in one go (about 5 minutes on an H100/H200, at most 9): the `gpu` tests, the digital twin on CUDA, the
# GPU kernel and e2e benchmarks, most important first. Six files go to $OUT when set (the device tool's output
# folder, which returns at most eight), else to benchmarks/results/: gpu_info.csv, gpu_check.log (everything
# printed), profile_gpu.json, twin_gpu.csv, kernels_gpu.csv, e2e_gpu.csv.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
log="$out/gpu_check.log"
: >"$log"
export PYTHONUNBUFFERED=1
py=$(command -v python3 || command -v python)
step() {  # step SECONDS TITLE COMMAND...: one bounded step; its output goes to the log too
  local limit=$1 title=$2
  shift 2
  local started=$SECONDS
  echo "=== $title" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  echo "=== $title: exit ${PIPESTATUS[0]} after $((SECONDS - started)) s" | tee -a "$log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu_info.csv"
"$py" -c "import torch, cupy, transformers; print('torch', torch.__version__, 'cupy', cupy.__version__,
'transformers', transformers.__version__)" 2>&1 | tee -a "$log"
# The `gpu` tests live in these files (kernel numerics and contracts vs the float64 reference; HF parity on CUDA,
# plain, chunked prefill and swap preemption; swap_blocks device <-> pinned host). Naming the files keeps pytest from
# collecting the app's tests, whose Streamlit and plotly a GPU image may lack. The launcher checks (CPU-side) follow.
step 150 "gpu tests" "$py" -m pytest -m gpu -q -rfE --tb=short --durations=8 -p no:cacheprovider \
  tests/test_kernels.py tests/test_swap.py tests/test_engine.py
step 40 "cupy launcher tests" "$py" -m pytest -q -p no:cacheprovider tests/test_cupy_launcher.py
# The digital twin on CUDA: profile Qwen3-0.6B shapes (random weights, bf16, CuPy kernels), then the twin.
step 110 "profile" "$py" -m lab profile --model qwen3-0.6b-random --device cuda --backend cupy --repeats 2 \
  --out "$out/profile_gpu.json"
step 60 "twin" "$py" -m lab twin --model qwen3-0.6b-random --device cuda --backend cupy \
  --profile "$out/profile_gpu.json" --num-requests 64 --repeats 2 --out "$out/twin_gpu.csv"
step 80 "kernel bench" "$py" -m lab bench kernels --device cuda --dtype bfloat16 --backends torch,cupy \
  --batch 1,8,64 --context 512,4096,32768 --block-size 16 --repeats 20 --out "$out/kernels_gpu.csv"
step 100 "e2e bench" "$py" -m lab bench e2e --device cuda --model qwen3-0.6b-random --backend cupy --repeats 1 \
  --out "$out/e2e_gpu.csv"
