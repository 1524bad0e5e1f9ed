#!/usr/bin/env bash
# The CosyVoice3 speech example end to end on one node: build the data if needed, train the three stages in
# order (LM, flow, vocoder; each on NPROC_PER_NODE ranks, default 2), export each with mm convert dcp-to-hf,
# then speak a held-out sentence and measure every stage (synthesize.py). `python` is the mm environment's
# (mm train / mm convert run as python -m mm_core.cli). Extra arguments go to every
# `mm train` (e.g. training.train_iters=2).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Accelerator environment, only where it exists (Ascend CANN toolkit).
if [[ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]]; then
  # shellcheck disable=SC1091
  source /usr/local/Ascend/ascend-toolkit/set_env.sh
fi
EXAMPLE=examples/speech_cosyvoice
RUNS=outputs/speech_cosyvoice
[[ -d $EXAMPLE/build ]] || python $EXAMPLE/build_data.py
# Processes per node: NPROC_PER_NODE, or NPUS_PER_NODE as the MindSpeed-MM scripts name it (both set: equal)
if [[ -n "${NPUS_PER_NODE:-}" && -n "${NPROC_PER_NODE:-}" && "$NPUS_PER_NODE" != "$NPROC_PER_NODE" ]]; then
  echo "train.sh: NPUS_PER_NODE=$NPUS_PER_NODE and NPROC_PER_NODE=$NPROC_PER_NODE disagree; set one" >&2
  exit 2
fi
NPROC_PER_NODE="${NPROC_PER_NODE:-${NPUS_PER_NODE:-2}}"
# On an accelerator (an Ascend toolkit or an NVIDIA GPU on this node) the stages train with bf16 parameters
# and fp32 gradient reduction; the YAMLs' fp32 is for CPUs. Extra arguments come later and win.
DTYPES=()
if [[ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]] || nvidia-smi -L >/dev/null 2>&1; then
  DTYPES=(parallel.fsdp_plan.param_dtype=bf16 parallel.fsdp_plan.reduce_dtype=fp32)
fi
for stage in lm flow vocoder; do
  start=$(date +%s)
  python -m mm_core.cli train "$EXAMPLE/$stage.yaml" --nproc-per-node "$NPROC_PER_NODE" ${DTYPES[@]+"${DTYPES[@]}"} "$@"
  echo "train.sh: $stage trained in $(( $(date +%s) - start )) s"
  rm -rf "$RUNS/$stage/hf"
  python -m mm_core.cli convert dcp-to-hf "$RUNS/$stage/checkpoints" "$RUNS/$stage/hf"
done
python $EXAMPLE/synthesize.py
