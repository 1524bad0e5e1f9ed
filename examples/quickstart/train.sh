#!/usr/bin/env bash
# Launch the quickstart (or any mm config) with torchrun, on one machine or several.
# On each node: NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0 address> bash examples/quickstart/train.sh
set -euo pipefail
CONFIG="${CONFIG:-examples/quickstart/config.yaml}"

# Accelerator environment, only where it exists (Ascend CANN toolkit).
if [[ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]]; then
  # shellcheck disable=SC1091
  source /usr/local/Ascend/ascend-toolkit/set_env.sh
  export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-1200}"
  export PYTORCH_NPU_ALLOC_CONF="${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}"
fi

# Processes per node: NPROC_PER_NODE, or NPUS_PER_NODE as the MindSpeed-MM scripts name it (both set: equal)
if [[ -n "${NPUS_PER_NODE:-}" && -n "${NPROC_PER_NODE:-}" && "$NPUS_PER_NODE" != "$NPROC_PER_NODE" ]]; then
  echo "train.sh: NPUS_PER_NODE=$NPUS_PER_NODE and NPROC_PER_NODE=$NPROC_PER_NODE disagree; set one" >&2
  exit 2
fi
NPROC_PER_NODE="${NPROC_PER_NODE:-${NPUS_PER_NODE:-2}}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-29500}"

# On an accelerator (an Ascend toolkit or an NVIDIA GPU on this node) the recipe trains with bf16 parameters
# and fp32 gradient reduction; the YAML's fp32 is for CPUs. Overrides given to this script come later and win.
DTYPES=()
if [[ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]] || nvidia-smi -L >/dev/null 2>&1; then
  DTYPES=(parallel.fsdp_plan.param_dtype=bf16 parallel.fsdp_plan.reduce_dtype=fp32)
fi

torchrun \
  --nproc_per_node "$NPROC_PER_NODE" \
  --nnodes "$NNODES" \
  --node_rank "$NODE_RANK" \
  --master_addr "$MASTER_ADDR" \
  --master_port "$MASTER_PORT" \
  -m mm_core.train "$CONFIG" ${DTYPES[@]+"${DTYPES[@]}"} "$@"
