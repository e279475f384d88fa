#!/usr/bin/env bash
# Fill the wheel folder that scripts/gpu_check.sh installs from on a GPU machine without network:
# the pure-Python packages spectrain needs that a CUDA PyTorch image usually lacks (omegaconf; PyYAML it needs is common).
#   scripts/gpu_wheels.sh [FOLDER] [PYTHON_VERSION]   (defaults: .whl 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PYVER=${2:-3.12}
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation py \
  --platform any -d "$DEST" "omegaconf==2.4.0"
ls -la "$DEST"
