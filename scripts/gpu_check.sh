#!/usr/bin/env bash
# GPU checks in one go (about 6 minutes on an H200, at most 10): the `gpu` tests, the digital twin on CUDA, the
# GPU kernel and e2e benchmarks, most important first. Arguments pick steps (tests profile twin kernels e2e; default
# all), e.g. `scripts/gpu_check.sh profile twin` to redo the twin alone. Seven files go to $OUT when set (the device
# tool's output folder, which returns at most eight), else to benchmarks/results/: gpu_info.csv, gpu_check.log
# (everything printed), profile_gpu.json, twin_gpu.csv, twin_steps_gpu.csv (each real step's measured and modelled
# time), kernels_gpu.csv, e2e_gpu.csv.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
log="$out/gpu_check.log"
: >"$log"
export PYTHONUNBUFFERED=1
py=$(command -v python3 || command -v python)
steps=" ${*:-tests profile twin kernels e2e} "
step() {  # step NAME SECONDS COMMAND...: one bounded step, if chosen; its output goes to the log too
  local title=$1 limit=$2
  shift 2
  [[ $steps == *" $title "* ]] || return 0
  local started=$SECONDS
  echo "=== $title" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  echo "=== $title: exit ${PIPESTATUS[0]} after $((SECONDS - started)) s" | tee -a "$log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu_info.csv"
"$py" -c "import torch, cupy, transformers; print('torch', torch.__version__, 'cupy', cupy.__version__,
'transformers', transformers.__version__)" 2>&1 | tee -a "$log"
# The `gpu` tests live in these files (kernel numerics and contracts vs the float64 reference; HF parity on CUDA,
# plain, chunked prefill and swap preemption; seeded sampling and beam search on CUDA; swap_blocks device <->
# pinned host): about 60 s on an H200. Naming the files keeps pytest from collecting the app's tests, whose
# Streamlit and plotly a GPU image may lack. (The CPU-side launcher and compiled-code checks are CI's.)
step tests 150 "$py" -m pytest -m gpu -q -rfE --tb=short --durations=8 -p no:cacheprovider \
  tests/test_kernels.py tests/test_swap.py tests/test_engine.py tests/test_engine_beam_search.py
# The digital twin on CUDA: profile Qwen3-0.6B shapes (random weights, bf16, CuPy kernels; 156 scenario runs,
# about 2 minutes on an H200 when they were 147, before the long-context decodes to 8,192 tokens), then the twin.
step profile 170 "$py" -m lab profile --model qwen3-0.6b-random --device cuda --backend cupy --repeats 2 \
  --out "$out/profile_gpu.json"
step twin 60 "$py" -m simulator twin --model qwen3-0.6b-random --device cuda --backend cupy \
  --profile "$out/profile_gpu.json" --num-requests 64 --repeats 2 --out "$out/twin_gpu.csv" \
  --steps-out "$out/twin_steps_gpu.csv"
step kernels 60 "$py" -m lab bench kernels --device cuda --dtype bfloat16 --backends torch,cupy \
  --batch 1,8,64 --context 512,4096,32768 --block-size 16 --repeats 20 --out "$out/kernels_gpu.csv"
# One run per system (each about 35 s with its warm-up on an H200: the 0.6B model's 256-token decodes are bound by
# kernel launches); HF's static batching is left to the CPU bench.
step e2e 150 "$py" -m lab bench e2e --device cuda --model qwen3-0.6b-random --backend cupy --repeats 1 \
  --systems paged-engine,paged-engine-chunked,hf-continuous --out "$out/e2e_gpu.csv"
