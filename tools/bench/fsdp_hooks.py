"""FSDP gathering plan under expert parallelism: step time and per-rank peak memory, side by side.

    python tools/bench/fsdp_hooks.py [--nproc 4] [--rounds 3] [--steps 4] [--warmup 2] [--layers 4]

Trains a small Qwen3-MoE (built from a config, random init; default 4 layers, hidden 256, 16 experts of
inter 256, top-4, vocab 4096) on the quickstart text with mm's Trainer, EP 2 (efsdp = nproc / 2), fp32 and
AdamW, micro-batch 2 x 256 tokens per rank, once per row:

- ``(a) plain``: each decoder layer's dense FSDP unit and its expert FSDP unit (over ``efsdp``) are gathered
  by FSDP2 on their own, no prefetch;
- ``(b) hook_modules``: ``parallel.fsdp_plan.hook_modules: [model.layers.{*}]`` (a layer's dense and expert
  units are one group; the first unit of the group to run gathers the others with its own);
- ``(c) + prefetch 1/1``: (b) with ``num_to_forward_prefetch: 1`` and ``num_to_backward_prefetch: 1`` (the
  next group is gathered ahead, forward and backward);
- ``(d) + pregather``: (c) with ``pregather: true`` (the root and the first group are all-gathered right after
  each optimizer step).

Every run is in fresh processes (peak memory is a per-process high-water mark). The rows are interleaved:
round 1 runs a, b, c, d, round 2 runs them again, and so on, so that machine noise hits every row alike; each
figure is the median over the rounds and the spread is the smallest and largest round.

Columns:

- ``step s``: median over the timed steps of the interval between the starts of consecutive steps (so the
  pregather after the optimizer step is counted), slowest rank; the first ``--warmup`` steps are left out
  (the first forward records the execution order);
- ``peak RSS GiB/rank``: the trainer's ``peak_mem_gb`` (``metrics.jsonl``), the largest rank's. On CPU it is
  the process's resident set size high-water mark (``ru_maxrss``): torch, transformers, gloo and the data
  pipeline are in it, so differences between rows, not the absolute value, are what the plan changes. On an
  accelerator it is the allocator's ``max_memory_allocated``;
- ``train peak MiB/rank``: the same high-water mark minus the RSS just before the model is built (what
  training itself holds; glibc is told to return freed memory at once so RSS follows live tensors);
- ``vs (a)``: the row's median over row (a)'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from _ranks import free_port, set_rank_env

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart" / "config.yaml"

HOOKS = ["parallel.fsdp_plan.hook_modules=[model.layers.{*}]"]
PREFETCH = [
    *HOOKS,
    "parallel.fsdp_plan.num_to_forward_prefetch=1",
    "parallel.fsdp_plan.num_to_backward_prefetch=1",
]
ROWS: list[tuple[str, list[str]]] = [
    ("(a) plain", []),
    ("(b) hook_modules", HOOKS),
    ("(c) + prefetch 1/1", PREFETCH),
    ("(d) + pregather", [*PREFETCH, "parallel.fsdp_plan.pregather=true"]),
]


def write_config(directory: Path, args: argparse.Namespace) -> Path:
    """The quickstart recipe (real text, local tokenizer) with a small Qwen3-MoE for the dense model."""
    raw = yaml.safe_load(QUICKSTART.read_text(encoding="utf-8"))
    raw["model"] = {
        "model_id": "qwen3_moe",
        "from_scratch": True,
        "config_overrides": {
            "vocab_size": 4096,
            "hidden_size": args.hidden,
            "intermediate_size": 2 * args.hidden,
            "moe_intermediate_size": args.inter,
            "num_experts": args.experts,
            "num_experts_per_tok": args.top_k,
            "num_hidden_layers": args.layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": max(args.seq, 128),
            "tie_word_embeddings": True,
        },
        "loss_cfg": {"loss_type": "per_token_loss", "router_aux_loss_coef": 0.001},
    }
    raw["data"]["dataset_param"]["preprocess_parameters"]["model_name_or_path"] = str(
        QUICKSTART.parent / "tokenizer"
    )
    raw["data"]["dataset_param"]["basic_parameters"]["dataset_dir"] = str(QUICKSTART.parent / "data")
    path = directory / "moe.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def overrides(args: argparse.Namespace, out: str) -> list[str]:
    return [
        f"training.train_iters={args.warmup + args.steps + 1}",
        "training.log_interval=1",
        "training.save=null",
        "training.progress_bar=false",
        "tools.tensorboard.enable=false",
        f"training.micro_batch_size={args.micro}",
        "training.gradient_accumulation_steps=1",
        f"data.dataset_param.basic_parameters.seq_len={args.seq}",
        "parallel.expert_parallel_size=2",
        "parallel.fsdp_plan.param_dtype=fp32",
        "parallel.fsdp_plan.reduce_dtype=fp32",
        f"training.output_dir={out}",
    ]


def _worker(
    rank: int, world: int, port: int, config: str, extra: list[str], warmup: int, result: str
) -> None:
    set_rank_env(rank, world, port)
    import torch
    import torch.distributed as dist

    from mm_core.config.loader import load_config
    from mm_core.parallel.state import init_distributed
    from mm_core.tools import rss_bytes
    from mm_core.train.metrics import peak_memory_gb
    from mm_core.train.trainer import Trainer

    torch.set_num_threads(1)
    os.chdir(REPO)
    cfg = load_config(config, extra)
    init_distributed()
    trainer = Trainer(cfg, config)
    dist.barrier()
    base = rss_bytes()
    trainer.setup()
    starts: list[float] = []
    step_fn = trainer.train_step

    def timed_step(*a: Any, **kw: Any) -> Any:
        starts.append(time.perf_counter())
        return step_fn(*a, **kw)

    trainer.train_step = timed_step  # type: ignore[method-assign]
    records = trainer.train()
    intervals = [b - a for a, b in zip(starts, starts[1:])][warmup:]
    peak_gb = peak_memory_gb(trainer.state.device)
    mine = {
        "rank": rank,
        "step_s": statistics.median(intervals),
        "peak_gb": peak_gb,
        "train_peak_mib": (peak_gb * 2**30 - base) / 2**20,
        "logged_peak_gb": records[-1]["peak_mem_gb"],
    }
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(result).write_text(json.dumps(everyone), encoding="utf-8")
    dist.destroy_process_group()


def run_row(config: Path, extra: list[str], args: argparse.Namespace) -> dict[str, float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.start_processes(
            _worker,
            args=(args.nproc, free_port(), str(config), overrides(args, tmp) + extra, args.warmup, result),
            nprocs=args.nproc,
            start_method="spawn",
            join=True,
        )
        ranks = json.loads(Path(result).read_text(encoding="utf-8"))
    return {
        "step_s": max(r["step_s"] for r in ranks),
        "peak_gb": max(r["peak_gb"] for r in ranks),
        "train_peak_mib": max(r["train_peak_mib"] for r in ranks),
        "logged_peak_gb": max(r["logged_peak_gb"] for r in ranks),
    }


def _spread(values: list[float], fmt: str) -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="gloo ranks (EP 2, efsdp = nproc / 2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write every run's figures here")
    args = parser.parse_args()
    # freed memory goes back to the OS at once, so RSS follows live tensors (set before workers start)
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    print(
        f"Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts x inter {args.inter}, "
        f"top-{args.top_k}; EP 2 x efsdp {args.nproc // 2} on {args.nproc} gloo ranks x 1 thread, "
        f"{args.micro} x {args.seq} tokens/rank, fp32 AdamW; {args.rounds} interleaved rounds of "
        f"{args.warmup} + {args.steps} steps",
        flush=True,
    )
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in ROWS}
    with tempfile.TemporaryDirectory(prefix="mm-bench-hooks-") as tmp:
        config = write_config(Path(tmp), args)
        for i in range(args.rounds):
            for name, extra in ROWS:
                r = run_row(config, extra, args)
                runs[name].append(r)
                print(
                    f"  round {i + 1} {name}: step {r['step_s']:.3f} s, peak {r['peak_gb']:.3f} GiB "
                    f"(logged {r['logged_peak_gb']:.3f}), train peak {r['train_peak_mib']:.0f} MiB",
                    flush=True,
                )
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    ref = med[ROWS[0][0]]
    print(f"wall time {time.perf_counter() - t0:.0f} s; medians over {args.rounds} rounds (spread: min-max)")
    print(
        "| row | step s | spread | vs (a) | peak RSS GiB/rank | spread | vs (a) "
        "| train peak MiB/rank | spread | vs (a) |"
    )
    print("|---|---:|---|---:|---:|---|---:|---:|---|---:|")
    for name, _ in ROWS:
        m, rs = med[name], runs[name]
        print(
            f"| {name} | {m['step_s']:.3f} | {_spread([r['step_s'] for r in rs], '.3f')} | "
            f"{m['step_s'] / ref['step_s']:.2f} | {m['peak_gb']:.3f} | "
            f"{_spread([r['peak_gb'] for r in rs], '.3f')} | {m['peak_gb'] / ref['peak_gb']:.3f} | "
            f"{m['train_peak_mib']:.0f} | {_spread([r['train_peak_mib'] for r in rs], '.0f')} | "
            f"{m['train_peak_mib'] / ref['train_peak_mib']:.2f} |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
