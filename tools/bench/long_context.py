"""Context parallelism on one long sequence: per-rank peak memory and tokens/s at cp = 1, 2, 4 (Ulysses,
ring and Ulysses x ring), in one invocation.

    python tools/bench/long_context.py [--seq 8192] [--steps 2] [--json out.json]

A tiny Qwen3 (hidden 64, 4 query heads and 2 key/value heads of dim 16, 2 layers, vocab 1024; random init,
fp32) runs forward + backward on one sequence of ``--seq`` tokens, in fresh gloo processes per
configuration (cp = 1 uses transformers' ``sdpa``; cp > 1 uses mm's context-parallel attention exactly as
the trainer wires it). With 2 key/value heads, Ulysses 4 also exercises the key/value head repeat.
Parameters are replicated (the model is tiny): the memory measured is activations and gradients.

Memory (CPU): the high-water mark of each rank's resident set (``ru_maxrss``) minus its RSS just before the
first step, with glibc told to return freed memory at once, so it follows live tensors; the largest rank is
reported. On an accelerator the allocator peak would be the measure. Time: the slowest rank's step time after
one warm-up step; tokens/s = sequence length / step time.
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

MiB = 2**20
CONFIGS = [  # (name, ring, ulysses)
    ("cp=1 (sdpa)", 1, 1),
    ("Ulysses 2", 1, 2),
    ("ring 2", 2, 1),
    ("Ulysses 4", 1, 4),
    ("ring 4", 4, 1),
    ("Ulysses 2 x ring 2", 2, 2),
]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(
    rank: int, world: int, init_file: str, ring: int, ulysses: int, args: dict, out_file: str
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mm_core.config.schema import ModelConfig, ParallelConfig
    from mm_core.models.facts import ModelFacts
    from mm_core.models.plan import plan_of
    from mm_core.parallel.context import (
        ContextParallel,
        plan_context_parallel,
        use_context_parallel_attention,
    )
    from mm_core.parallel.state import init_parallel_state
    from mm_core.train.loss import loss_sum, shift_labels

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    state = init_parallel_state(
        ParallelConfig(ring_attention_size=ring, ulysses_parallel_size=ulysses), "cpu"
    )
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=args["seq"],
        use_cache=False,
    )
    model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    context = None
    if ring * ulysses > 1:
        mcfg = ModelConfig(model_id="qwen3", loss_cfg={"loss_type": "per_token_loss"})
        facts = ModelFacts.of(model)
        cp = plan_context_parallel(model, facts, plan_of(model), mcfg, state.sizes)
        use_context_parallel_attention(model, cp, facts)
        context = ContextParallel(state)
    ids = torch.randint(0, config.vocab_size, (1, args["seq"]), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "position_ids": torch.arange(args["seq"])[None]}
    targets = shift_labels(ids.clone())
    if context is not None:
        batch, targets = context.shard(batch, targets)

    base = _rss()
    times = []
    for step in range(args["steps"] + 1):
        dist.barrier()
        t0 = time.perf_counter()
        out = model(**batch, use_cache=False)
        loss = loss_sum(out.logits, targets, "per_token_loss") / args["seq"]
        loss.backward()
        model.zero_grad(set_to_none=True)
        del out, loss
        dist.barrier()
        if step:  # the first step warms up
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    stats = torch.tensor([peak, sum(times) / len(times)], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out_file).write_text(json.dumps({"peak_mib": stats[0].item() / MiB, "step_s": stats[1].item()}))
    dist.destroy_process_group()


def run(name: str, ring: int, ulysses: int, args: dict) -> dict:
    import torch.multiprocessing as mp

    world = ring * ulysses
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "0")
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "result.json")
        mp.start_processes(
            _worker,
            args=(world, os.path.join(tmp, "rdzv"), ring, ulysses, args, out_file),
            nprocs=world,
            start_method="spawn",
        )
        result = json.loads(Path(out_file).read_text())
    result.update(name=name, cp=world, tokens_per_s=args["seq"] / result["step_s"])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192, help="sequence length (tokens)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--json", type=Path, help="also write the results here")
    ns = parser.parse_args(argv)
    args = {"seq": ns.seq, "steps": ns.steps}
    results = []
    print(f"one sequence of {ns.seq} tokens, tiny Qwen3, fp32, CPU/gloo, {ns.steps} timed steps", flush=True)
    print("| layout | cp | peak memory per rank (MiB) | vs cp=1 | step (s) | tokens/s |")
    print("|---|---|---|---|---|---|", flush=True)
    for name, ring, ulysses in CONFIGS:
        r = run(name, ring, ulysses, args)
        results.append(r)
        ratio = r["peak_mib"] / results[0]["peak_mib"]
        print(
            f"| {name} | {r['cp']} | {r['peak_mib']:.0f} | {ratio:.2f} | {r['step_s']:.2f} | "
            f"{r['tokens_per_s']:.0f} |",
            flush=True,
        )
    if ns.json:
        ns.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
