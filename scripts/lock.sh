#!/usr/bin/env bash
# Regenerate requirements.txt (the exact, fully pinned install) from requirements.in (the loose direct dependencies).
# The lock is resolved for CPython 3.11 against PyTorch's CPU wheel (given with --find-links, default /opt/wheels),
# so it holds no CUDA runtime packages (--upgrade-package torch: the unsuffixed pin below must not steer uv to the
# index's CUDA build); its torch line is written without the wheel's local "+cpu" suffix, so the
# same line installs the CPU wheel where one lies on disk and the index's CUDA build on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels="${TORCH_WHEELS:-/opt/wheels}"
uv pip compile requirements.in --python-version 3.11 --find-links "$wheels" --no-header --annotation-style line \
  --upgrade-package torch --quiet -o requirements.txt "$@"
sed -i -E 's/^torch==([0-9.]+)\+[a-z0-9]+/torch==\1/' requirements.txt
sed -i '1i # Compiled from requirements.in by scripts/lock.sh (uv pip compile); do not edit by hand.' requirements.txt
