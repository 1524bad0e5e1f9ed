#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install mm's packages into it, editable.
# torch is pinned to the CPU build 2.13.0 first, so that nothing pulls a multi-GB CUDA build.
#
# Usage: bash tools/setup_env.sh [--fresh] [--freeze]
#   MM_DEPS=pinned (default)  .venv: every third-party package at its version in constraints.txt, the set the
#                             whole suite passed with (CI installs this way: reproducible, and an upstream
#                             release cannot turn main red)
#   MM_DEPS=latest            .venv-latest: the newest releases the packages' declared ranges allow
#                             (`MM_DEPS=latest bash tools/run_tests.sh` runs the suite on them: drift shows
#                             here before users meet it; to try a new transformers minor, raise the bound in
#                             the packages' pyproject.toml first)
#   --fresh                   remove the environment first
#   --freeze                  after installing, write the environment's versions to constraints.txt
#   MM_VENV                   overrides the environment's location
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/_env_name.sh
fresh=0
freeze=0
for arg in "$@"; do
  case "$arg" in
    --fresh) fresh=1 ;;
    --freeze) freeze=1 ;;
    *) echo "setup_env: unknown option $arg (accepted: --fresh, --freeze)" >&2; exit 2 ;;
  esac
done
if [[ $fresh -eq 1 ]]; then rm -rf "$VENV"; fi
if [[ ! -x "$VENV/bin/python" ]]; then
  PY="$(command -v python3.11 || command -v python3)"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
PINS=()
if [[ "$MM_DEPS" == pinned ]]; then PINS=(-c constraints.txt); else PINS=(--upgrade --upgrade-strategy eager); fi
"${PIP[@]}" install --upgrade pip >/dev/null
"${PIP[@]}" install "torch==2.13.0"
# torch stays the CPU build 2.13.0 in both modes (an eager upgrade would pull the newest CUDA build)
"${PIP[@]}" install "${PINS[@]}" "torch==2.13.0" \
  -e packages/mm-parallel -e "packages/mm-core[lora,wandb,swanlab]" -e packages/mm-models-qwen -e packages/mm-data-text \
  -e packages/mm-data-vlm -e packages/mm-models-kimi -e packages/mm-models-minimax \
  -e packages/mm-models-step -e packages/mm-data-audio \
  -e "packages/mm-models-funasr[paraformer]" -e packages/mm-models-video -e packages/mm-data-video \
  -e packages/mm-models-cosyvoice \
  "pytest>=8" "hatchling>=1.25" "ruff==0.17.6" "mypy==2.4.1" "types-PyYAML"
# swanlab pulls in the deprecated pynvml shim, whose .pth redirect warns (FutureWarning) at every import of
# torch.cuda; nvidia-ml-py, installed beside it, provides the same pynvml module without it
"${PIP[@]}" uninstall -y pynvml >/dev/null
if [[ $freeze -eq 1 ]]; then
  { grep '^#' constraints.txt; "${PIP[@]}" freeze --exclude-editable | sed 's/+cpu$//'; } > constraints.txt.new
  mv constraints.txt.new constraints.txt
  echo "setup_env: wrote the versions of $VENV to constraints.txt"
fi
"$VENV/bin/python" -c "import torch, transformers, mm_core; print('mm env ready ($MM_DEPS): torch', torch.__version__, '| transformers', transformers.__version__)"
