"""Benchmark the FSDP2 Muon optimizer step on local gloo ranks (CPU).

One invocation runs every world size given (default 2 and 4) on the same model: 16 linear weights of
a tiny 4-layer transformer (qkv, out, up, down; about 7.9M parameters), sharded with FSDP2. For each
optimizer it times ``step()`` and prints a markdown table:

- mm_parallel.optim.Muon with ns_dtype float32 and bfloat16,
- torch.optim.AdamW on the same DTensor parameters,
- torch.optim.Muon on the FSDP2 DTensor parameters as they are (DTensor redistributes implicitly),
- Muon from the ``muon-fsdp2`` PyPI package (gather/scatter per parameter), if installed.

    python tools/bench/muon.py [--world-sizes 2,4] [--steps 3] [--dim 384] [--ffn 1792]

Each rank runs with one CPU thread. Step time is the slowest rank's median over ``--steps`` timed
steps after ``--warmup`` untimed ones. Bytes are payload sent to other ranks by one rank in one step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "mm-parallel" / "src"))


class _Layer(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(3 * dim, dim) * dim**-0.5)
        self.out = nn.Parameter(torch.randn(dim, dim) * dim**-0.5)
        self.up = nn.Parameter(torch.randn(ffn, dim) * dim**-0.5)
        self.down = nn.Parameter(torch.randn(dim, ffn) * ffn**-0.5)


def _build(args: argparse.Namespace, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.ModuleList([_Layer(args.dim, args.ffn) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return model


def _set_grads(model: nn.Module, seed: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=generator)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)


def _optimizers(
    args: argparse.Namespace,
) -> dict[str, Callable[[list[nn.Parameter]], Any]]:
    from mm_parallel.optim import Muon

    makers: dict[str, Callable[[list[nn.Parameter]], Any]] = {
        "mm Muon (ns fp32)": lambda ps: Muon(ps, lr=0.02, ns_dtype=torch.float32),
        "mm Muon (ns bf16)": lambda ps: Muon(ps, lr=0.02, ns_dtype=torch.bfloat16),
        "torch.optim.AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "torch.optim.Muon (bf16, DTensor)": lambda ps: torch.optim.Muon(ps, lr=0.02),
    }
    try:
        import muon_fsdp2

        makers["muon-fsdp2 (bf16)"] = lambda ps: muon_fsdp2.Muon(
            [{"params": ps, "use_muon": True, "lr": 0.02, "rms_scale": False}]
        )
    except ImportError as error:
        print(f"muon-fsdp2 is not installed ({error}); skipping it. `pip install muon-fsdp2` to include it.")
    return makers


def _worker(rank: int, world: int, init_file: str, out_file: str, args: argparse.Namespace) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, dict[str, Any]] = {}
    for name, make in _optimizers(args).items():
        model = _build(args, mesh)
        params = list(model.parameters())
        opt = make(params)
        times: list[float] = []
        comm = None
        for step in range(args.warmup + args.steps):
            _set_grads(model, seed=step)
            dist.barrier()
            start = time.perf_counter()
            if step == args.warmup and "DTensor" in name:
                with CommDebugMode() as mode:
                    opt.step()
                comm = {str(k): v for k, v in mode.get_comm_counts().items()}
            else:
                opt.step()
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                times.append(elapsed)
        entry: dict[str, Any] = {"step_s": statistics.median(times)}
        stats = getattr(opt, "last_step_stats", None)
        if stats is not None:
            entry.update(stats.as_dict())
        if comm is not None:
            entry["dtensor_collectives"] = comm
        results[name] = entry
        del opt, model, params
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out_file).write_text(json.dumps(gathered))
    from mm_parallel.teardown import shutdown_distributed

    shutdown_distributed()  # exiting right after all_gather_object could abort the process (see teardown.py)


def _run_world(world: int, args: argparse.Namespace) -> list[dict[str, dict[str, Any]]]:
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "result.json")
        mp.start_processes(
            _worker,
            args=(world, os.path.join(tmp, "rdzv"), out_file, args),
            nprocs=world,
            start_method="spawn",
        )
        return json.loads(Path(out_file).read_text())


def _table(world: int, ranks: list[dict[str, dict[str, Any]]], muon_params: int) -> str:
    names = list(ranks[0])
    step = {n: max(r[n]["step_s"] for r in ranks) for n in names}
    peers = [n for n in names if "mm Muon" not in n and "AdamW" not in n]
    lines = [
        (
            f"**{world} ranks** (P = {muon_params / 1e6:.2f}M Muon parameters, 4P/W = "
            f"{4 * muon_params / world / 2**20:.2f} MiB)"
        ),
        "",
        (
            "| optimizer | step (s) | speed-up vs peers | sent/rank/step (MiB) | NS CPU time max/min (s) "
            "| NS CPU max/min | NS wall max/min | NS est. cost max/min |"
        ),
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        speedup = (
            ", ".join(f"{step[p] / step[n]:.1f}x vs {p.split(' ')[0]}" for p in peers) if "mm" in n else ""
        )
        sent = ns = ratio = wall = cost = ""
        if "bytes_sent" in ranks[0][n]:
            sent = f"{max(r[n]['bytes_sent'] for r in ranks) / 2**20:.2f}"
            cpu = [r[n]["ns_cpu_seconds"] for r in ranks]
            ns = f"{max(cpu):.3f} / {min(cpu):.3f}"
            ratio = f"{max(cpu) / max(min(cpu), 1e-9):.2f}"
            walls = [r[n]["ns_seconds"] for r in ranks]
            wall = f"{max(walls) / max(min(walls), 1e-9):.2f}"
            costs = [r[n]["ns_cost"] for r in ranks]
            cost = f"{max(costs) / max(min(costs), 1):.2f}"
        elif "muon-fsdp2" in n:
            # gather + scatter of fp32 shards for every non-owned matrix
            sent = f"~{8 * muon_params / world * (world - 1) / world / 2**20:.2f} (fp32, est.)"
        elif "DTensor" in n:
            sent = "implicit: " + ", ".join(
                f"{k.split('.')[-1]}x{v}" for k, v in ranks[0][n].get("dtensor_collectives", {}).items()
            )
        lines.append(f"| {n} | {step[n]:.3f} | {speedup} | {sent} | {ns} | {ratio} | {wall} | {cost} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated gloo world sizes")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--ffn", type=int, default=1792)
    args = parser.parse_args(argv)
    muon_params = args.layers * (4 * args.dim**2 + 2 * args.dim * args.ffn)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1 thread per rank, "
        f"{args.layers * 4} matrices, {muon_params:,} parameters\n"
    )
    for world in (int(w) for w in args.world_sizes.split(",")):
        start = time.perf_counter()
        ranks = _run_world(world, args)
        print(_table(world, ranks, muon_params))
        print(
            f"\n({time.perf_counter() - start:.0f}s wall for {world} ranks)\n",
            flush=True,
        )


if __name__ == "__main__":
    main()
