#!/usr/bin/env bash
# The device check of a GPU loan, at most 8 minutes and 8 files, that measures even when a step fails: each step runs
# in its own process under its own time limit and its CSV rows are written as they are measured. Steps, most
# important first (arguments pick steps; default: tests-kernels tests-engine tests-fp8 parity decode bandwidth
# e2e):
#   tests-kernels  the `gpu` tests of the kernels and fused ops (one process)
#   tests-engine   the `gpu` tests of CUDA graphs, the engine, beam search and swap (another: an assert that poisons
#                  a CUDA context takes down only its own process)
#   tests-fp8      the `gpu` tests of the CuPy FP8 KV-cache kernels (never run on a GPU before: writes bit for bit
#                  against fp8.quantize, decode against the float64 reference, the fused write, copies and swaps)
#                  and the FP8 vs bf16 decode time of the CuPy kernel at 64 x 512 and 64 x 4,096 (printed to the log)
#   parity         HF parity at Qwen3-0.6B shapes: fp32 greedy tokens with graphs off and on (8 prompts x 32
#                  tokens), bf16 first-step logits (relative error, top-1 agreement)       -> parity_gpu.csv
#   decode         the engine's decode step at 64 x 512 and 64 x 4,096 with graphs on and off, at the engine's
#                  default max_model_len (goal <= 5 ms at 64 x 512)                         -> decode_gpu.csv
#   bandwidth      the CuPy decode kernel in bf16, 50 back-to-back calls between CUDA events, against a measured
#                  device copy (goal >= 85 % of it) at 64 x 512, 64 x 4,096, 8 x 32,768     -> kernels_gpu.csv
#   e2e            the paged engine against HF continuous batching (goal >= 5x)            -> e2e_gpu.csv
#   profile twin   not by default: the digital twin on CUDA        -> profile_gpu.json, twin_gpu.csv
# Besides those: gpu_info.csv and gpu_check.log (everything printed). Files go to $OUT when set (the device tool's
# output folder), else to benchmarks/results/gpu/. Nothing is installed: the lab runs on the GPU image's packages.
#
# `scripts/gpu_check.sh --dry-run [STEPS]` runs every step's Python entry on this CPU with the tiny model and small
# sizes (the CUDA-only parts take their CPU paths; the `gpu` tests are collected, not run), into $OUT or a temporary
# folder: CI runs it, so that an import error, a wrong flag or a missing file is found before a loan. With
# GPU_CHECK_ECHO=1 the script prints each chosen step's command line instead of running it (the tests parse them).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
if [[ ${1:-} == --dry-run ]]; then
  dry=1
  shift
fi
if ((dry)); then
  out="${OUT:-$(mktemp -d)}"
  device=cpu model=tiny backend=auto
  tests_mode=(--collect-only) decode_sizes=(--batch 2 --context 16,40 --steps 3)
  parity_sizes=(--num-prompts 2 --max-tokens 4) e2e_sizes=(--num-requests 4)
  bandwidth=(--dtype float32 --backends torch --shapes 2x64,1x100 --back-to-back 2 --repeats 2)
  profile_sizes=(--grid quick --repeats 1) twin_sizes=(--num-requests 4)
else
  out="${OUT:-benchmarks/results/gpu}"
  device=cuda model=qwen3-0.6b-random backend=cupy
  tests_mode=() decode_sizes=(--batch 64 --context 512,4096 --steps 12)
  parity_sizes=(--num-prompts 8 --max-tokens 32) e2e_sizes=()
  bandwidth=(--dtype bfloat16 --backends torch,cupy --shapes 64x512,64x4096,8x32768 --back-to-back 50 --repeats 5)
  profile_sizes=(--repeats 1) twin_sizes=(--num-requests 64)
fi
mkdir -p "$out"
log="$out/gpu_check.log"
: >"$log"
export PYTHONUNBUFFERED=1
py=$(command -v python3 || command -v python)
steps=" ${*:-tests-kernels tests-engine tests-fp8 parity decode bandwidth e2e} "
failed=0
step() {  # step NAME SECONDS COMMAND...: one bounded step in its own process, if chosen; its output goes to the log
  local title=$1 limit=$2
  shift 2
  [[ $steps == *" $title "* ]] || return 0
  if [[ ${GPU_CHECK_ECHO:-0} == 1 ]]; then
    printf '%q ' "$title" "$limit" "$@"
    echo
    return 0
  fi
  local started=$SECONDS
  echo "=== $title" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  local status=${PIPESTATUS[0]}
  echo "=== $title: exit $status after $((SECONDS - started)) s" | tee -a "$log"
  ((status == 0)) || failed=1
}
if ((dry)) || [[ ${GPU_CHECK_ECHO:-0} == 1 ]]; then
  echo "no GPU asked: model $model on $device" | tee "$out/gpu_info.csv"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu_info.csv"
fi
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)
try:
    import cupy; print('cupy', cupy.__version__)
except ImportError as exc: print('no cupy:', exc)" 2>&1 | tee -a "$log"
step tests-kernels 60 "$py" -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider "${tests_mode[@]}" \
  tests/test_fused_ops.py tests/test_kernels.py
step tests-engine 75 "$py" -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider "${tests_mode[@]}" \
  tests/test_static_decode.py tests/test_engine.py tests/test_engine_beam_search.py tests/test_swap.py
step tests-fp8 70 "$py" -m pytest -m gpu -q -s -rfE --tb=short -p no:cacheprovider "${tests_mode[@]}" \
  tests/test_cupy_fp8.py
step parity 60 "$py" -m lab bench parity --device "$device" --model "$model" --backend "$backend" \
  "${parity_sizes[@]}" --out "$out/parity_gpu.csv"
step decode 75 "$py" -m lab bench decode --device "$device" --model "$model" --backend "$backend" \
  "${decode_sizes[@]}" --out "$out/decode_gpu.csv"
step bandwidth 40 "$py" -m lab bench kernels --device "$device" --block-size 16 "${bandwidth[@]}" \
  --out "$out/kernels_gpu.csv"
step e2e 90 "$py" -m lab bench e2e --device "$device" --model "$model" --backend "$backend" --repeats 1 \
  --systems paged-engine,hf-continuous "${e2e_sizes[@]}" --out "$out/e2e_gpu.csv"
step profile 110 "$py" -m lab profile --model "$model" --device "$device" --backend "$backend" \
  "${profile_sizes[@]}" --out "$out/profile_gpu.json"
step twin 40 "$py" -m simulator twin --model "$model" --device "$device" --backend "$backend" \
  --profile "$out/profile_gpu.json" --repeats 1 "${twin_sizes[@]}" --out "$out/twin_gpu.csv"
echo "files in $out: $(ls "$out" | tr '\n' ' ')" | tee -a "$log"
exit "$failed"
