#!/usr/bin/env bash
# GPU checks in one go (at most 8 minutes): the `gpu` tests (fused kernels, CUDA graphs equal to eager and HF, kernel
# numerics, HF parity), the decode step per batch and context with and without graphs, the e2e benchmark, the kernel
# benchmark and the digital twin, most important first. Arguments pick steps (tests decode e2e kernels profile twin;
# default all), e.g. `scripts/gpu_check.sh profile twin` to redo the twin alone. Eight files go to $OUT when set (the
# device tool's output folder, which returns at most eight), else to benchmarks/results/: gpu_info.csv,
# gpu_check.log (everything printed), decode_gpu.csv, e2e_gpu.csv, kernels_gpu.csv, profile_gpu.json, twin_gpu.csv,
# twin_steps_gpu.csv (each real step's measured and modelled time).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
log="$out/gpu_check.log"
: >"$log"
export PYTHONUNBUFFERED=1
py=$(command -v python3 || command -v python)
steps=" ${*:-tests decode e2e kernels profile twin} "
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
# The `gpu` tests live in these files (fused kernels and kernel numerics vs the float64 reference in bf16/fp16/fp32;
# CUDA graph replays equal to the eager forward and to HF; HF parity on CUDA, plain, chunked prefill and swap
# preemption, alone and sharing its pinned host pool with the offload tier; seeded sampling and beam search;
# swap_blocks device <-> pinned host). Naming the files keeps pytest from collecting the app's tests, whose
# Streamlit and plotly a GPU image may lack. (The CPU-side launcher, ledger and compiled-code checks are CI's.)
step tests 120 "$py" -m pytest -m gpu -q -rfE --tb=short --durations=8 -p no:cacheprovider \
  tests/test_fused_ops.py tests/test_static_decode.py tests/test_kernels.py tests/test_swap.py tests/test_engine.py \
  tests/test_engine_beam_search.py
# The decode step of Qwen3-0.6B shapes at batch 1, 8, 64 x contexts 512, 4,096, CUDA graphs on and off, and the
# kernels one step launches (torch profiler): the lean-decode goal is <= 5 ms at 64 x 512.
step decode 75 "$py" -m lab bench decode --device cuda --model qwen3-0.6b-random --backend cupy --batch 1,8,64 \
  --context 512,4096 --steps 12 --out "$out/decode_gpu.csv"
# One run per system; HF's static batching is left to the CPU bench. The goal: >= 5x HF continuous batching.
step e2e 90 "$py" -m lab bench e2e --device cuda --model qwen3-0.6b-random --backend cupy --repeats 1 \
  --systems paged-engine,paged-engine-chunked,hf-continuous --out "$out/e2e_gpu.csv"
step kernels 40 "$py" -m lab bench kernels --device cuda --dtype bfloat16 --backends torch,cupy \
  --batch 1,8,64 --context 512,4096,32768 --block-size 16 --repeats 20 --out "$out/kernels_gpu.csv"
# The digital twin on CUDA: profile Qwen3-0.6B shapes (random weights, bf16, CuPy kernels; about 2 minutes on an
# H200 eagerly, less with graphs), then the twin.
step profile 110 "$py" -m lab profile --model qwen3-0.6b-random --device cuda --backend cupy --repeats 1 \
  --out "$out/profile_gpu.json"
step twin 40 "$py" -m simulator twin --model qwen3-0.6b-random --device cuda --backend cupy \
  --profile "$out/profile_gpu.json" --num-requests 64 --repeats 1 --out "$out/twin_gpu.csv" \
  --steps-out "$out/twin_steps_gpu.csv"
