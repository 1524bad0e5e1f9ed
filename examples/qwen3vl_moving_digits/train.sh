#!/usr/bin/env bash
# torchrun launcher; run on every node: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
# NPROC_PER_NODE (or NPUS_PER_NODE).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Accelerator environment, only where it exists (Ascend CANN toolkit).
if [[ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]]; then
  # shellcheck disable=SC1091
  source /usr/local/Ascend/ascend-toolkit/set_env.sh
fi
[[ -d examples/qwen3vl_moving_digits/build ]] || python examples/qwen3vl_moving_digits/build_data.py
# Processes per node: NPROC_PER_NODE, or NPUS_PER_NODE as the MindSpeed-MM scripts name it (both set: equal)
if [[ -n "${NPUS_PER_NODE:-}" && -n "${NPROC_PER_NODE:-}" && "$NPUS_PER_NODE" != "$NPROC_PER_NODE" ]]; then
  echo "train.sh: NPUS_PER_NODE=$NPUS_PER_NODE and NPROC_PER_NODE=$NPROC_PER_NODE disagree; set one" >&2
  exit 2
fi
NPROC_PER_NODE="${NPROC_PER_NODE:-${NPUS_PER_NODE:-2}}"
# On an accelerator (an Ascend toolkit or an NVIDIA GPU on this node) the recipe trains with bf16 parameters
# and fp32 gradient reduction; the YAML's fp32 is for CPUs. Overrides given to this script come later and win.
DTYPES=()
if [[ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]] || nvidia-smi -L >/dev/null 2>&1; then
  DTYPES=(parallel.fsdp_plan.param_dtype=bf16 parallel.fsdp_plan.reduce_dtype=fp32)
fi

torchrun --nproc_per_node "$NPROC_PER_NODE" --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29523}" \
  -m mm_core.train examples/qwen3vl_moving_digits/config.yaml ${DTYPES[@]+"${DTYPES[@]}"} "$@"
