#!/usr/bin/env bash
# The main job end to end on the built-in tiny default: install, train a tiny Qwen3 on the Python language
# reference with FSDP2 on 2 local processes, save a DCP checkpoint, export Hugging Face weights.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
source tools/_env_name.sh
rm -rf outputs/quickstart
"$VENV/bin/mm" train examples/quickstart/config.yaml --nproc-per-node 2 "$@"
"$VENV/bin/mm" convert dcp-to-hf outputs/quickstart/checkpoints outputs/quickstart/hf
"$VENV/bin/python" - <<'PY'
import json
rows = [json.loads(l) for l in open("outputs/quickstart/metrics.jsonl")]
print(f"loss: step {rows[0]['step']} {rows[0]['loss']:.3f} -> step {rows[-1]['step']} {rows[-1]['loss']:.3f}")
print("checkpoint: outputs/quickstart/checkpoints/" + open("outputs/quickstart/checkpoints/latest").read().strip())
print("Hugging Face export: outputs/quickstart/hf (AutoModelForCausalLM.from_pretrained loads it)")
PY
