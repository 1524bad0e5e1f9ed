"""Benchmark expert parallelism on local gloo ranks (CPU): tokens/s, per-rank peak memory and exchange time.

One invocation trains a small Qwen3-MoE (transformers' ``Qwen3MoeForCausalLM``; default 2 layers, hidden 256,
32 experts of inter 256, top-4) for a few steps on ``--world-size`` ranks (default 4) once per layout, each
in fresh processes so that peak memory is per layout:

- ``ep1 (transformers loop)``: FSDP over all ranks with transformers' own per-expert loop,
- ``ep1``: FSDP over all ranks with mm's adapter (grouped matrix products, no exchange),
- ``ep2``, ``ep4``: mm's expert parallelism (experts split over ``ep`` ranks, FSDP over ``efsdp``) with the
  all-to-all dispatcher (``parallel.ep_plan.dispatcher: alltoall``, the default),
- ``ep2 allgather``, ``ep4 allgather``: the same split with the all-gather dispatcher
  (``dispatcher: allgather``): every ep rank all-gathers the tokens of its ep group (padded to the group's
  largest count), computes its local experts' share and the shares are reduce-scattered back.

The all-to-all and all-gather rows of one ep size run in the same invocation, one after the other.

    python tools/bench/moe.py [--world-size 4] [--steps 4] [--warmup 2] [--seq 256] [--micro 2]

Each rank runs one CPU thread. tokens/s is the global tokens of a step over the slowest rank's median step
time; peak memory is the largest per-rank peak resident set size (CPU: the process's whole footprint, so the
differences between rows are what the layout changes); the exchange columns are the wall time spent inside
the token exchanges (dispatch + combine, forward + backward) per step, on the slowest rank, and its share of
the step: the two all-to-alls (and the backward's two) for the ``alltoall`` rows; for the ``allgather`` rows
the all-gathers (token rows, routing weights, expert indices) plus the reduce-scatter of the shares, and in
backward the reduce-scatters and the all-gather that mirror them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "packages" / "mm-parallel" / "src"))


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.inter,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(args.seq, 128),
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg)


def _worker(
    rank: int, world: int, init_file: str, out_dir: str, layout: str, args: argparse.Namespace
) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from mm_parallel.fsdp import apply_fsdp
    from mm_parallel.moe import shard_experts, swap_experts, total_comm_seconds

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ep = 1 if layout.startswith("ep1") else int(layout.split()[0][2:])
    dispatcher = "allgather" if layout.endswith("allgather") else "alltoall"
    model = _model(args)
    names = [n for n, _ in model.named_modules() if n.endswith("mlp.experts")]
    if layout != "ep1 (transformers loop)":
        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        swapped = swap_experts(model, names, mesh["ep"] if ep > 1 else None, dispatcher=dispatcher)
        if ep > 1:
            shard_experts(list(swapped.values()), mesh["efsdp"], gradient_divide_factor=world)
    shard = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    apply_fsdp(model, shard, list(model.model.layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    times, comm = [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, 4096, (args.micro, args.seq), generator=g)
        c0 = total_comm_seconds(model)[0]
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            comm.append(total_comm_seconds(model)[0] - c0)
    rec = {
        "step_s": statistics.median(times),
        "comm_s": statistics.median(comm),
        "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "local_param_mb": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                              for p in model.parameters()) * 4 / 2**20,
    }  # fmt: skip
    Path(out_dir, f"{rank}.json").write_text(json.dumps(rec))
    dist.barrier()
    from mm_parallel.teardown import shutdown_distributed

    shutdown_distributed()  # a clean exit after the last collective (see mm_parallel.teardown)


def run_layout(layout: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(args.world_size, os.path.join(tmp, "rdzv"), tmp, layout, args),
            nprocs=args.world_size,
            start_method="spawn",
        )
        recs = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(args.world_size)]
    step = max(r["step_s"] for r in recs)
    tokens = args.micro * args.seq * args.world_size
    return {
        "layout": layout,
        "tokens_per_s": tokens / step,
        "step_s": step,
        "comm_ms": 1e3 * max(r["comm_s"] for r in recs),
        "comm_share": max(r["comm_s"] for r in recs) / step,
        "peak_gb": max(r["peak_gb"] for r in recs),
        "param_mb": max(r["local_param_mb"] for r in recs),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    eps = [e for e in (2, 4, 8) if e <= args.world_size and args.world_size % e == 0]
    layouts = ["ep1 (transformers loop)", "ep1"] + [f"ep{e}{d}" for e in eps for d in ("", " allgather")]
    print(
        f"Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts x inter {args.inter}, "
        f"top-{args.top_k}; {args.world_size} gloo ranks x 1 thread, {args.micro} x {args.seq} tokens/rank"
    )
    print("| layout | tokens/s | step (s) | exchange (ms/step) | exchange share | peak RSS/rank (GiB) "
          "| params/rank (MiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for layout in layouts:
        r = run_layout(layout, args)
        print(
            f"| {r['layout']} | {r['tokens_per_s']:.0f} | {r['step_s']:.3f} | {r['comm_ms']:.1f} | "
            f"{100 * r['comm_share']:.1f}% | {r['peak_gb']:.3f} | {r['param_mb']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
