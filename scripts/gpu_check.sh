#!/usr/bin/env bash
# The one GPU check (docs/gpu.md): gpu-marked tests compiled for real, a few bf16 GRPO steps of policy +
# co-trained draft on the GPU with the torch sampling engine, and the kernel benchmark (docs/benchmarks/gpu/).
#
#   scripts/gpu_check.sh                # a single-GPU machine: CUDA torch >= 2.11, triton, transformers, lightning
#   scripts/gpu_check.sh --cpu-dry-run  # here: the same steps on CPU, kernels under the Triton interpreter, tiny sizes
#   --out DIR                           # where the results go (default docs/benchmarks/gpu, dry run runs/gpu_check_dry_run)
#
# Installs nothing from the network and needs no vLLM. The project goes on PYTHONPATH (a staging folder of
# symlinks laid out as the installed package). A pure-Python package the machine lacks (omegaconf) comes from
# the wheel folder $SPECTRAIN_WHEELS (default .whl, about 250 KiB), filled on a machine with network by
# `scripts/gpu_wheels.sh`. Any failure, or a skipped check, makes it exit non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu-dry-run) ARGS+=(--mode cpu-dry-run); shift ;;
    --out) [[ $# -ge 2 ]] || { echo "usage: $0 [--cpu-dry-run] [--out DIR]" >&2; exit 2; }; ARGS+=(--out "$2"); shift 2 ;;
    *) echo "usage: $0 [--cpu-dry-run] [--out DIR]" >&2; exit 2 ;;
  esac
done

STAGE=$(mktemp -d -t spectrain_gpu_check.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT
if ! "$PY" -c "import omegaconf" 2>/dev/null; then
  WHEELS=${SPECTRAIN_WHEELS:-.whl}
  if ! ls "$WHEELS"/omegaconf-*.whl >/dev/null 2>&1; then
    echo "FAIL: omegaconf is not installed and $WHEELS/ has no omegaconf wheel; on a machine with network run" \
         "scripts/gpu_wheels.sh (it fills $WHEELS/), then carry that folder here" >&2
    exit 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$STAGE/site" "$WHEELS"/*.whl
fi

mkdir -p "$STAGE/src/spectrain"
for entry in spectrain/*; do ln -s "$PWD/$entry" "$STAGE/src/$entry"; done
for sub in kernels callbacks recipes; do ln -s "$PWD/$sub" "$STAGE/src/spectrain/$sub"; done
export PYTHONPATH="$STAGE/src:$STAGE/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# `python -m` / `-c` would put the working directory (this repository, whose spectrain/ lacks kernels/,
# callbacks/ and recipes/) ahead of the staged package: keep it off sys.path (pytest appends its rootdir too)
export PYTHONSAFEPATH=1
"$PY" scripts/gpu_check.py ${ARGS[@]+"${ARGS[@]}"}
