#!/bin/bash
# GPU performance check for mm: bf16 throughput, MFU and peak memory of the quickstart Qwen3 scaled to ~1B
# parameters, on one GPU, eager vs training.compile, chunked loss on vs off; then, where 8 or more devices are
# visible, the 8-rank layouts: FSDP 8 of an 8B-class dense model (Qwen3-8B's dimensions) with compile, a
# Qwen3-MoE with expert parallelism 8, and Ulysses 8 (the dense model at 8 x the sequence). Same form as
# ../shared/device-check.sh, for a session whose task is lent a device machine (the `device` tool).
#
# The goal it checks (issue 30): the dense 8B-class model in bf16 with compile on H100/H200-class devices at
# >= 45% MFU (mm's MFU: model FLOPs / dense bf16 peak, see docs/performance.md), and within 10% of torchtitan
# on the same machine. torchtitan is not installed by this script (the device machine reaches no registry):
# run torchtitan's Qwen3-8B with the same tokens per rank on the same machine and pass its MFU as
# DP_TORCHTITAN_MFU=0.47 (a fraction); without it the summary says the comparison was not made.
# The device image has python3 with torch + CUDA, transformers, safetensors, pyyaml, tqdm, tensorboard, numpy,
# pillow, peft — not pydantic or torchdata — and reaches no registry. So, once, in the project root on the
# CPU machine, fetch the missing wheels for the device's Python 3.12 (as device-check.sh says):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic pydantic-core annotated-types typing-inspection torchdata hatchling pathspec pluggy trove-classifiers
# Then call the device tool's run with carry [".whl"], timeout_s 560 and command
#   PYTHONUNBUFFERED=1 bash tools/bench/device_perf.sh
# Results: $OUT/device-perf.txt (one line per run, then a summary table), each run's log in $OUT/<run>.log.
# Whole script: the 1-device part under 9 minutes on an H200 (install ~0.5 min; runs bounded by `timeout`, see
# run()); the 8-rank part up to 13 more minutes. Under a 10-minute limit per command run the parts apart:
# DP_PART=1 (one device only) then DP_PART=8 (8-rank layouts only); the default DP_PART=all runs both.
# With fewer than 8 visible devices the 8-rank layouts are skipped with a SKIP line (not a failure).
#
# The model: examples/quickstart/model with hidden 2048, 14 layers, 16 query / 8 key-value heads of 128,
# intermediate 6144 and Qwen3's own vocabulary of 151,936 (the quickstart tokenizer's ids < 4096 stay valid; with
# its 4,096-token vocabulary the output head would be 0.1% of the FLOPs and chunked_loss would change nothing),
# embeddings tied as in the quickstart: 1,015,870,976 parameters (transformers Qwen3Config on the meta device;
# 704,706,048 outside the embedding). Data: the quickstart corpus in blocks of 2048 tokens, micro-batch 8,
# gradient accumulation 2 (the quickstart's): 32,768 tokens per step. bf16 parameters, fp32 reduce, AdamW.
# Runs (each reads its settings back from the resolved config.yaml; a key this version lacks is a FAIL line):
#   eager        the defaults (training.compile false; model.loss_cfg.chunked_loss whatever the default is)
#   unchunked    model.loss_cfg.chunked_loss=false
#   compile      training.compile=true
#   compile_unchunked   both, only if time is left
# 8-rank runs (8 processes, one per device; bf16 parameters, fp32 reduce; 20 steps; settings read back too):
#   fsdp8_dense_compile  Qwen3-8B's dimensions (hidden 4096, 36 layers, 32 / 8 heads of 128, intermediate 12288,
#                        vocabulary 151,936, untied: 8.19 B parameters), FSDP over 8, 1 x 4096 tokens per rank,
#                        training.compile=true: the run the goal is about
#   moe_ep8              Qwen3-MoE with Qwen3-30B-A3B's layer dimensions cut to 16 layers (hidden 2048, 128
#                        experts of 768, top 8, 32 / 4 heads of 128: ~10 B parameters), expert parallelism 8,
#                        2 x 2048 tokens per rank
#   ulysses8             the dense 8B-class model, parallel.ulysses_parallel_size=8 over 1 x 32768 tokens (4096
#                        per rank), compile on
# Figures: median over the second half of the steps (the first steps include warm-up / compilation) of
# tokens_per_s, step_time_s, tflops_per_s and mfu from metrics.jsonl; peak_mem_gb is the largest of the run.
#
# Switches: DP_INSTALL_ONLY=1 installs and lists the plugins, then stops; DP_CPU_SMOKE=1 runs the same logic
# on a CPU machine (gloo, the tiny quickstart model, 4 steps; PY picks the interpreter, e.g.
# PY=.venv/bin/python) to prove the script end to end; there DP_SMOKE_DEVICES=8 (default 1) stands for 8
# devices, so the 8-rank layouts run on 8 gloo processes with tiny models. DP_PART=1|8|all (above).
set -uo pipefail
OUT=${OUT:-/tmp/device-out}; mkdir -p "$OUT"; R="$OUT/device-perf.txt"; : > "$R"
PY=${PY:-python3}
SMOKE=${DP_CPU_SMOKE:-0}
PART=${DP_PART:-all}
case "$PART" in 1|8|all) ;; *) echo "device_perf.sh: DP_PART must be 1, 8 or all, got '$PART'" >&2; exit 2;; esac
say() { echo "$*" | tee -a "$R"; }
T_START=$(date +%s)
SITE=${SITE:-/tmp/site}; mkdir -p "$SITE"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || { say "FAIL wheel install"; exit 1; }
fi
export PYTHONPATH=$SITE
for p in mm-parallel mm-core packages/*; do
  d=packages/${p#packages/}; [ -d "$d" ] || continue
  $PY -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" "$d" >>"$OUT/install.log" 2>&1 || { say "FAIL install $d (see install.log)"; exit 1; }
done
export PATH=$SITE/bin:$PATH
[ "${DP_INSTALL_ONLY:-0}" = 1 ] && { mm plugins | tee -a "$R"; exit 0; }
$PY -c "import torch,transformers; print('torch',torch.__version__,'cuda',torch.cuda.is_available(),torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-','transformers',transformers.__version__)" | tee -a "$R"
say "install: $(( $(date +%s) - T_START )) s"

cfg=examples/quickstart/config.yaml
W=${DP_WORK:-/tmp/dp}; rm -rf "$W"; mkdir -p "$W"
common="parallel.fsdp_plan.param_dtype=bf16 parallel.fsdp_plan.reduce_dtype=fp32 tools.tensorboard.enable=false training.progress_bar=false training.save=null training.log_interval=1"
if [ "$SMOKE" = 1 ]; then   # CPU: the tiny quickstart model, a few steps, short limits
  size="training.train_iters=4 training.micro_batch_size=2 data.dataset_param.basic_parameters.seq_len=128"
  export OMP_NUM_THREADS=1; T_EAGER=120; T_COMPILE=150; T_LEFT=0
else
  o=model.config_overrides
  size="$o.hidden_size=2048 $o.num_hidden_layers=14 $o.num_attention_heads=16 $o.num_key_value_heads=8 $o.head_dim=128"
  size="$size $o.intermediate_size=6144 $o.vocab_size=151936 $o.max_position_embeddings=4096 $o.layer_types=null"
  size="$size training.micro_batch_size=8 data.dataset_param.basic_parameters.seq_len=2048 training.train_iters=30"
  size="$size training.lr=3e-4 training.lr_min=3e-5"
  T_EAGER=100; T_COMPILE=200; T_LEFT=330   # compile_unchunked only if this many seconds remain of the 9 min
fi
# the parameter count of the run's model, from its resolved config (transformers on the meta device)
params() {
  $PY - "$1" <<'PY' 2>/dev/null
import sys, torch, yaml
from transformers import AutoConfig, AutoModelForCausalLM
c = yaml.safe_load(open(sys.argv[1]))["model"]
base = AutoConfig.from_pretrained(c["model_name_or_path"])
cfg = type(base).from_dict({**base.to_dict(), **(c.get("config_overrides") or {})})  # as mm applies them
with torch.device("meta"):
    m = AutoModelForCausalLM.from_config(cfg)
print(f"{sum(p.numel() for p in m.parameters()):,}")
PY
}
# run NAME LIMIT_S [overrides...]: one `mm train` as device-check.sh runs it; a line in device-perf.txt and a row
# (JSON) for the summary; a failure or a timeout prints FAIL with the log's last lines and the script goes on
run() { local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
  # RUN_NPROC / RUN_CFG / RUN_SIZE (set on the call) pick the processes, the config and the size of the model;
  # $common and the size are lists of overrides, split on purpose
  # shellcheck disable=SC2086
  timeout -k 10 "$limit" mm train "${RUN_CFG:-$cfg}" --nproc-per-node "${RUN_NPROC:-1}" $common ${RUN_SIZE-$size} "$@" \
    training.output_dir="$W/$name" >"$OUT/$name.log" 2>&1
  local rc=$? wall=$(( $(date +%s) - t0 ))
  $PY - "$W/$name" "$name" "$rc" "$wall" "$limit" <<'PY' | tee -a "$R"
import json, statistics, sys
from pathlib import Path
import yaml
out, name, rc, wall, limit = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
rows = [json.loads(l) for l in open(out / "metrics.jsonl") if l.strip()] if (out / "metrics.jsonl").exists() else []
cfg = yaml.safe_load(open(out / "config.yaml")) if (out / "config.yaml").exists() else {}
row = {"run": name, "rc": rc, "wall_s": int(wall), "steps": len(rows),
       "compile": cfg.get("training", {}).get("compile", "-"),
       "chunked_loss": cfg.get("model", {}).get("loss_cfg", {}).get("chunked_loss", "-")}
if rows:
    tail = rows[len(rows) // 2:]
    med = lambda key: statistics.median(r[key] for r in tail) if all(key in r for r in tail) else None
    row.update(tokens_per_s=med("tokens_per_s"), step_time_s=med("step_time_s"), tflops_per_s=med("tflops_per_s"),
               mfu=med("mfu"), peak_mem_gb=max(r["peak_mem_gb"] for r in rows),
               loss_first=rows[0]["loss"], loss_last=rows[-1]["loss"], tokens_per_step=rows[-1]["tokens"])
(out / "row.json").write_text(json.dumps(row))
if rc == 0 and rows:
    mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
    print(f"ok   {name}: {len(rows)} steps, loss {row['loss_first']:.3f} -> {row['loss_last']:.3f}, median "
          f"tokens/s {row['tokens_per_s']:,.0f}, step {row['step_time_s']:.3f} s, {row['tflops_per_s']:.1f} TFLOP/s, "
          f"MFU {mfu}, peak {row['peak_mem_gb']:.2f} GB, wall {wall} s")
else:
    why = f"timed out after {limit} s" if rc in (124, 137) else f"exit {rc}"
    print(f"FAIL {name}: {why}, {len(rows)} steps logged, wall {wall} s")
PY
  [ $rc -eq 0 ] || say "     $(grep -v '^\s*$' "$OUT/$name.log" | tail -3 | tr '\n' ' ' | cut -c1-400)"
}
# the devices this machine shows (CUDA, else Ascend through torch_npu); DP_SMOKE_DEVICES stands for them on CPU
devices() {
  if [ "$SMOKE" = 1 ]; then echo "${DP_SMOKE_DEVICES:-1}"; return; fi
  $PY - <<'PY' 2>/dev/null || echo 0
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
if not n:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
        n = torch.npu.device_count()
    except Exception:
        n = 0
print(n)
PY
}
NDEV=$(devices)
say "devices: $NDEV visible; DP_PART=$PART"

if [ "$PART" != 8 ]; then
  run eager $T_EAGER
  say "model: $(params "$W/eager/config.yaml") parameters"
  run unchunked $T_EAGER model.loss_cfg.chunked_loss=false
  run compile $T_COMPILE training.compile=true
  if [ $(( $(date +%s) - T_START )) -le $T_LEFT ] || [ "$SMOKE" = 1 ]; then
    run compile_unchunked $T_COMPILE training.compile=true model.loss_cfg.chunked_loss=false
  else say "skip compile_unchunked: $(( $(date +%s) - T_START )) s used"; fi
fi

# ---- 8-rank layouts (one process per device)
moe_cfg=examples/qwen3_moe/config.yaml
o=model.config_overrides
if [ "$SMOKE" = 1 ]; then   # tiny models; 8 query and key-value heads so that Ulysses 8 divides them
  steps8="training.train_iters=3 training.gradient_accumulation_steps=1"
  dense8="$steps8 training.micro_batch_size=1 data.dataset_param.basic_parameters.seq_len=128"
  dense8="$dense8 $o.num_attention_heads=8 $o.num_key_value_heads=8 $o.head_dim=32 $o.tie_word_embeddings=false"
  moe8="$steps8 training.micro_batch_size=1 data.dataset_param.basic_parameters.seq_len=128"
  long8="$dense8 data.dataset_param.basic_parameters.seq_len=512"
  T8=300; T8_COMPILE=400
else
  steps8="training.train_iters=20 training.gradient_accumulation_steps=1 training.lr=3e-4 training.lr_min=3e-5"
  dense8="$steps8 $o.hidden_size=4096 $o.num_hidden_layers=36 $o.num_attention_heads=32 $o.num_key_value_heads=8"
  dense8="$dense8 $o.head_dim=128 $o.intermediate_size=12288 $o.vocab_size=151936 $o.tie_word_embeddings=false"
  dense8="$dense8 $o.max_position_embeddings=40960 $o.layer_types=null training.micro_batch_size=1"
  long8="$dense8 data.dataset_param.basic_parameters.seq_len=32768"
  dense8="$dense8 data.dataset_param.basic_parameters.seq_len=4096"
  moe8="$steps8 $o.hidden_size=2048 $o.num_hidden_layers=16 $o.num_attention_heads=32 $o.num_key_value_heads=4"
  moe8="$moe8 $o.head_dim=128 $o.intermediate_size=6144 $o.moe_intermediate_size=768 $o.num_experts=128"
  moe8="$moe8 $o.num_experts_per_tok=8 $o.vocab_size=151936 $o.tie_word_embeddings=false"
  moe8="$moe8 $o.max_position_embeddings=4096 training.micro_batch_size=2"
  moe8="$moe8 data.dataset_param.basic_parameters.seq_len=2048"
  T8=240; T8_COMPILE=300
fi
if [ "$PART" = 1 ]; then
  say "skip 8-rank layouts: DP_PART=1"
elif [ "$NDEV" -lt 8 ]; then
  say "SKIP 8-rank layouts (fsdp8_dense_compile, moe_ep8, ulysses8): $NDEV device(s) visible, 8 needed"
else
  RUN_NPROC=8 RUN_SIZE="$dense8" run fsdp8_dense_compile $T8_COMPILE training.compile=true
  say "model: $(params "$W/fsdp8_dense_compile/config.yaml") parameters (fsdp8_dense_compile, ulysses8)"
  RUN_NPROC=8 RUN_CFG=$moe_cfg RUN_SIZE="$moe8" run moe_ep8 $T8 parallel.expert_parallel_size=8
  say "model: $(params "$W/moe_ep8/config.yaml") parameters (moe_ep8)"
  RUN_NPROC=8 RUN_SIZE="$long8" run ulysses8 $T8_COMPILE parallel.ulysses_parallel_size=8 training.compile=true
fi
$PY - "$W" <<'PY' | tee -a "$R"
import json, sys
from pathlib import Path
rows = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*/row.json"), key=lambda p: p.stat().st_mtime)]
f = lambda v, spec: "-" if v is None else format(v, spec)
print("\n| run | compile | chunked_loss | result | steps | tokens/s | step s | TFLOP/s | MFU | peak GB | loss first -> last | wall s |")
print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
for r in rows:
    ok = "ok" if r["rc"] == 0 and r["steps"] else ("timeout" if r["rc"] in (124, 137) else f"FAIL rc {r['rc']}")
    loss = f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}" if "loss_first" in r else "-"
    print(f"| {r['run']} | {r['compile']} | {r['chunked_loss']} | {ok} | {r['steps']} | {f(r.get('tokens_per_s'), ',.0f')} | "
          f"{f(r.get('step_time_s'), '.3f')} | {f(r.get('tflops_per_s'), '.1f')} | {f(r.get('mfu'), '.1%')} | "
          f"{f(r.get('peak_mem_gb'), '.2f')} | {loss} | {r['wall_s']} |")
PY
# the goal (header): MFU of the dense 8B-class run with compile, and torchtitan's when given
$PY - "$W" "${DP_TORCHTITAN_MFU:-}" <<'PY' | tee -a "$R"
import json, sys
from pathlib import Path
row_file = Path(sys.argv[1]) / "fsdp8_dense_compile" / "row.json"
titan = float(sys.argv[2]) if sys.argv[2] else None
if not row_file.exists():
    print("goal: not measured (no fsdp8_dense_compile run: fewer than 8 devices, or DP_PART=1)")
    sys.exit(0)
mfu = json.loads(row_file.read_text()).get("mfu")
if mfu is None:
    print("goal: fsdp8_dense_compile logged no MFU (no known peak for this device: set tools.peak_tflops)")
    sys.exit(0)
print(f"goal: MFU >= 45% for the dense 8B-class model with compile: {mfu:.1%} -> {'met' if mfu >= 0.45 else 'NOT met'}")
if titan is None:
    print("goal: within 10% of torchtitan: not compared (set DP_TORCHTITAN_MFU to torchtitan's MFU on this machine)")
else:
    print(f"goal: within 10% of torchtitan ({titan:.1%}): mm / torchtitan {mfu / titan:.3f} -> "
          f"{'met' if mfu >= 0.9 * titan else 'NOT met'}")
PY
say "done in $(( $(date +%s) - T_START )) s"
