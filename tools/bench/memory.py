"""Per-rank peak memory and step time of the memory features, in one invocation.

    python tools/bench/memory.py [--steps 2] [--layers 16] [--json out.json]

Trains a ~100M-parameter Qwen3 (hidden 768, 16 layers, vocab 4096; built from a config, random init) on the
quickstart text for a few steps in fresh processes per configuration: 1 process, FSDP on 2 and 4 ranks, and
each feature on top of FSDP x2. Every configuration uses meta-device init (no rank ever holds the whole
model) and fp32 with AdamW.

What is measured (CPU): the resident set size (RSS) of each rank's process, as a delta from the RSS just
before the model is built (torch, transformers, the process group and the data pipeline are already loaded
then, so the delta is what training itself holds). ``peak`` is the high-water mark (``ru_maxrss``) minus that
baseline; ``states`` is the RSS after the last step (activations and gradients are freed by then, so it is
parameters + optimizer states). glibc is told to return freed memory at once (MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_), so RSS follows live tensors instead of the allocator's cache. On an accelerator the
allocator's peak (``max_memory_allocated``) is reported instead. ``estimate`` is what ``mm check`` predicts
for the same configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from _ranks import free_port, set_rank_env

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart" / "config.yaml"
MiB = 2**20

FSDP2 = 2
CONFIGS: list[tuple[str, int, list[str]]] = [
    ("1 process", 1, []),
    ("FSDP x2", 2, []),
    ("FSDP x4", 4, []),
    ("FSDP x2 + recompute (full)", FSDP2, ["model.recompute=true"]),
    (
        "FSDP x2 + recompute (selective: attention)",
        FSDP2,
        ["model.recompute=true", "model.recompute_plan.recompute_granularity=selective"],
    ),
    ("FSDP x2 + activation offload", FSDP2, ["model.activation_offload=true"]),
    ("FSDP x2 + FSDP CPU offload", FSDP2, ["parallel.fsdp_plan.cpu_offload=true"]),
    (
        "FSDP x2 + prefetch (fwd 1, bwd 1)",
        FSDP2,
        ["parallel.fsdp_plan.num_to_forward_prefetch=1", "parallel.fsdp_plan.num_to_backward_prefetch=1"],
    ),
]


def model_dir(layers: int) -> Path:
    from transformers import Qwen3Config

    d = Path(tempfile.mkdtemp(prefix="mm-bench-model-"))
    Qwen3Config(
        vocab_size=4096,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=0,
    ).save_pretrained(d)
    return d


def overrides(model: Path, steps: int, seq: int, micro: int, out: str) -> list[str]:
    return [
        f"model.model_name_or_path={model}",
        f"training.train_iters={steps}",
        "training.log_interval=1",
        "training.save=null",
        "training.progress_bar=false",
        "tools.tensorboard.enable=false",
        "training.init_model_with_meta_device=true",
        f"training.micro_batch_size={micro}",
        "training.gradient_accumulation_steps=1",
        f"data.dataset_param.basic_parameters.seq_len={seq}",
        "parallel.fsdp_plan.param_dtype=fp32",
        "parallel.fsdp_plan.reduce_dtype=fp32",
        f"training.output_dir={out}",
    ]


def _worker(rank: int, world: int, port: int, args: list[str], result: str) -> None:
    set_rank_env(rank, world, port)
    import torch
    import torch.distributed as dist

    from mm_core.config.loader import load_config
    from mm_core.parallel.state import init_distributed
    from mm_core.tools import rss_bytes
    from mm_core.train.trainer import Trainer

    torch.set_num_threads(1)
    os.chdir(REPO)
    cfg = load_config(QUICKSTART, args)
    init_distributed()
    trainer = Trainer(cfg, str(QUICKSTART))
    dist.barrier()
    base = rss_bytes()
    trainer.setup()
    records = trainer.train()
    after = rss_bytes()
    device = trainer.state.device
    if device.type == "cpu":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        states = after - base
    else:
        mod = getattr(torch, device.type)
        peak, states = mod.max_memory_allocated(device), mod.memory_allocated(device)
    times = [r["step_time_s"] for r in records[1:]] or [records[-1]["step_time_s"]]
    mine = {"rank": rank, "peak": peak, "states": states, "step_s": sum(times) / len(times)}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(result).write_text(json.dumps(everyone), encoding="utf-8")
    dist.destroy_process_group()


def estimate(args: list[str], world: int) -> float:
    from mm_core.check import estimate_for_config
    from mm_core.config.loader import load_config

    os.chdir(REPO)
    return estimate_for_config(load_config(QUICKSTART, args), world).total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--only", default=None, help="run only configurations whose name contains this")
    parser.add_argument("--json", default=None, help="also write the results here")
    a = parser.parse_args()
    # freed memory goes back to the OS at once, so RSS follows live tensors (set before workers start)
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    import torch.multiprocessing as mp

    model = model_dir(a.layers)
    rows = []
    print(
        f"model: Qwen3 hidden 768, {a.layers} layers, vocab 4096; micro batch {a.micro} x seq {a.seq} "
        f"per rank; fp32 AdamW; {a.steps} steps",
        flush=True,
    )
    header = (
        "| configuration | ranks | peak MiB/rank (max) | states MiB/rank | estimate MiB | est/peak | step s |"
    )
    print(header + "\n|---|---|---|---|---|---|---|", flush=True)
    for name, world, extra in CONFIGS:
        if a.only and a.only not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            args = overrides(model, a.steps, a.seq, a.micro, tmp) + extra
            result = os.path.join(tmp, "result.json")
            t0 = time.perf_counter()
            mp.start_processes(
                _worker,
                args=(world, free_port(), args, result),
                nprocs=world,
                start_method="spawn",
                join=True,
            )
            ranks = json.loads(Path(result).read_text(encoding="utf-8"))
            est = estimate(args, world)
        peak = max(r["peak"] for r in ranks)
        states = max(r["states"] for r in ranks)
        step = max(r["step_s"] for r in ranks)
        row = {"name": name, "world": world, "peak_mib": peak / MiB, "states_mib": states / MiB}
        row.update(estimate_mib=est / MiB, step_s=step, wall_s=time.perf_counter() - t0, ranks=ranks)
        rows.append(row)
        print(
            f"| {name} | {world} | {peak / MiB:.0f} | {states / MiB:.0f} | {est / MiB:.0f} | "
            f"{est / peak:.2f} | {step:.2f} |",
            flush=True,
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
