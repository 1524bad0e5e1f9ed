#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv and install mm's packages into it, editable.
# torch is pinned to the CPU build 2.13.0 first, so that nothing pulls a multi-GB CUDA build.
# Usage: bash tools/setup_env.sh [--fresh]      (MM_VENV overrides the location)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MM_VENV:-.venv}"
if [[ "${1:-}" == "--fresh" ]]; then rm -rf "$VENV"; fi
if [[ ! -x "$VENV/bin/python" ]]; then
  PY="$(command -v python3.11 || command -v python3)"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip >/dev/null
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install \
  -e packages/mm-parallel -e "packages/mm-core[lora]" -e packages/mm-models-qwen -e packages/mm-data-text \
  -e packages/mm-data-vlm -e packages/mm-models-kimi -e packages/mm-models-minimax \
  -e packages/mm-models-step -e packages/mm-data-audio \
  -e "packages/mm-models-funasr[paraformer]" -e packages/mm-models-video -e packages/mm-data-video \
  -e packages/mm-models-cosyvoice \
  "pytest>=8" "hatchling>=1.25" "ruff==0.17.6" "mypy==2.4.1" "types-PyYAML"
"$VENV/bin/python" -c "import torch, transformers, mm_core; print('mm env ready: torch', torch.__version__, '| transformers', transformers.__version__)"
