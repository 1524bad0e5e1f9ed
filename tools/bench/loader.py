"""Is the data loader on the critical path? mm's step fed by its loader vs the same step fed from memory.

Both arms run mm's ``Trainer.train_step`` on the same model and mesh, in the same processes, alternating in
rounds so that machine noise hits both alike. The *loader* arm takes each step's micro-batches from the
trainer's own loader (``data.dataloader_param.num_workers`` worker processes, ``--workers``) exactly as
``Trainer.train`` does; the *memory* arm iterates a list of micro-batches drawn from that loader beforehand.
Prints the median step time of each, the ratio (loader / memory; 1.00 = the loader costs nothing), the time
the step waited in ``next()`` for its batches, and the loader's CPU time per micro-batch (dataset
``__getitem__`` + collate, one thread, measured in the rank process).

    python tools/bench/loader.py --nproc 2 --workers 2 --rounds 6 --steps 6 [--tokenize] [key=value ...]

``--tokenize`` swaps the quickstart's prepared (pre-tokenised, memory-mapped) ``text_pretrain`` dataset for
one that tokenises and packs raw documents in every ``__getitem__`` (about 10x the CPU work per sample).

Reading the result: the loader's workers are processes beside the ranks. With the training step on an
accelerator the rank's CPU mostly waits for the device and the workers use otherwise idle cores; on a CPU-only
box every worker CPU-millisecond is taken from the ranks' compute (here 2 ranks and 2 x ``--workers`` workers
share the cores), so the ratio also contains that CPU share, printed as "loader CPU / step". Overlap itself
(prefetch) is shown by the wait in ``next()``: near zero means the batch was ready when the step asked for it.
Each loader round first runs enough untimed steps to drain what the workers prefetched while the memory arm
ran, so the timed steps pay for the batches they consume.

The ranks are started with ``torch.multiprocessing.spawn``, as ``mm train --nproc-per-node`` starts them
(``elastic_launch``, start method spawn). A spawned process keeps spawn as its default start method, so its
loader workers would be spawned too, each importing torch, mm and the dataset before its first batch, at
every epoch start unless ``persistent_workers`` (18-23 s per epoch start measured here); mm's loader forks
them instead (as in ranks started by torchrun). The epoch-start wait is reported apart.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _ranks import set_rank_env, spawn_ranks

REPO = Path(__file__).resolve().parents[2]
ARMS = ("loader", "memory")
TOKENIZE_TYPE = "bench_text_tokenize_per_sample"
BLOCKS_PER_DOCUMENT = 4  # samples of the on-the-fly dataset per source document (an epoch's length)


class TokenizePerSample(torch.utils.data.Dataset):
    """Raw documents tokenised and packed in every ``__getitem__`` (no prepared cache).

    Sample ``i`` starts at document ``i % n``: that document and the ones after it are tokenised until the
    packed stream (``mm_data_text.packing`` rules: eos after each document, positions restart per document)
    holds block ``i // n`` of ``seq_len`` tokens, which is returned."""

    def __init__(
        self,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any = None,
        *,
        seed: int = 0,
    ) -> None:
        from mm_core.data.params import BASIC, PREPROCESS, read_params
        from mm_data_text.pretrain import BASIC_FIELDS, PREPROCESS_FIELDS
        from mm_data_text.sources import TEXT_SUFFIXES, read_documents, resolve_paths
        from mm_data_text.tokenizer import eos_id, load_tokenizer, pad_id

        basic = read_params(basic_param, BASIC_FIELDS, BASIC)
        pre = read_params(preprocess_param, PREPROCESS_FIELDS, PREPROCESS)
        self.seq_len: int = basic["seq_len"]
        files = resolve_paths(basic["dataset"], basic["dataset_dir"], TEXT_SUFFIXES)
        self.docs = [d for f in files for d in read_documents(f, basic["text_key"], basic["txt_document"])]
        self.tokenizer = load_tokenizer(pre["model_name_or_path"])
        self.eos = eos_id(self.tokenizer) if pre["add_eos"] else None
        self.pad_token_id = pad_id(self.tokenizer)

    def __len__(self) -> int:
        return len(self.docs) * BLOCKS_PER_DOCUMENT

    def __getitem__(self, index: int) -> dict[str, Any]:
        from mm_data_text.packing import pack_documents

        n = len(self.docs)
        block = index // n
        need = (block + 1) * self.seq_len
        token_lists: list[list[int]] = []
        total, d = 0, index % n
        while total < need:
            ids = self.tokenizer(self.docs[d % n], add_special_tokens=True, verbose=False)["input_ids"]
            token_lists.append(ids)
            total += len(ids) + (self.eos is not None)
            d += 1
        item: dict[str, Any] = pack_documents(token_lists, self.seq_len, self.eos).block(block)
        item["sample_id"] = index
        return item


def _loader_cpu_ms(trainer: Any, batches: int) -> float:
    """CPU milliseconds (this thread) per micro-batch of the trainer's dataset + collate, in this process."""
    loader = trainer.loader
    dataset, collate = loader.dataset, loader.collate_fn
    mbs = trainer.cfg.training.micro_batch_size
    order = [int(i) for i in torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))]
    collate([dataset[i] for i in order[:mbs]])  # warm caches (tokenizer, page cache)
    t0 = time.thread_time()
    for b in range(batches):
        idx = [order[(b * mbs + j) % len(order)] for j in range(mbs)]
        collate([dataset[i] for i in idx])
    return (time.thread_time() - t0) / batches * 1e3


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    # one thread per process, loader workers included
    set_rank_env(rank, world, port, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.chdir(REPO)
    from mm_core.config import load_config
    from mm_core.registry import data_register
    from mm_core.train import Trainer

    data_register.register(TOKENIZE_TYPE)(TokenizePerSample)
    overrides = [
        "training.progress_bar=false",
        "training.save=null",
        f"data.dataloader_param.num_workers={args.workers}",
    ]
    if args.tokenize:
        overrides.append(f"data.dataset_param.dataset_type={TOKENIZE_TYPE}")
    cfg = load_config(args.config, [*overrides, *args.overrides])
    trainer = Trainer(cfg, args.config).setup()
    dl = cfg.data.dataloader_param
    grad_accum = cfg.training.grad_accum
    # micro-batches the workers hold ready: a loader round first consumes them untimed
    depth = dl.num_workers * (dl.prefetch_factor or 2) if dl.num_workers else 0
    drain = math.ceil(depth / grad_accum)
    memory = [trainer._next_micro_batches() for _ in range(args.steps)]

    waits: list[float] = []  # seconds each timed loader step waited in next()
    epoch_waits: list[float] = []  # seconds waited in next() by steps (timed or not) that began an epoch

    def loader_step(timed: bool) -> None:
        epoch = trainer.batches.epoch
        t0 = time.perf_counter()
        micro = trainer._next_micro_batches()
        t1 = time.perf_counter()
        trainer.train_step(micro)
        if trainer.batches.epoch != epoch:
            epoch_waits.append(t1 - t0)
        elif timed:
            waits.append(t1 - t0)

    cpu: dict[str, list[float]] = {"loader": [], "memory": []}  # rank process CPU s per step (all threads)

    def block(arm: str, fn: Any) -> float:
        """Wall seconds per step of ``args.steps`` steps of ``fn(i)`` between barriers."""
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(args.steps):
            fn(i)
        c1 = time.process_time()
        dist.barrier()
        cpu[arm].append((c1 - c0) / args.steps)
        return (time.perf_counter() - t0) / args.steps

    def memory_round() -> float:
        return block("memory", lambda i: trainer.train_step([dict(b) for b in memory[i]]))

    def loader_round() -> float:
        for _ in range(drain):
            loader_step(False)
        return block("loader", lambda i: loader_step(True))

    memory_round()  # warm-up both
    loader_round()
    waits.clear()
    epoch_waits.clear()
    cpu["loader"].clear()
    cpu["memory"].clear()
    loader_t, memory_t = [], []
    for r in range(args.rounds):  # alternate which arm goes first
        if r % 2:
            memory_t.append(memory_round())
            loader_t.append(loader_round())
        else:
            loader_t.append(loader_round())
            memory_t.append(memory_round())
    cpu_ms = _loader_cpu_ms(trainer, args.cpu_batches)
    stats = {
        "loader": loader_t,
        "memory": memory_t,
        "wait_ms": [w * 1e3 for w in waits],
        "epoch_wait_ms": [w * 1e3 for w in epoch_waits],
        "cpu_ms": cpu_ms,
        "rank_cpu": cpu,
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, stats)
    if rank == 0:
        out["ranks"] = gathered
        out["layout"] = trainer.state.sizes.layout
        out["dataset"] = f"{cfg.data.dataset_param.dataset_type} ({len(trainer.loader.dataset)} samples)"
        out["micro"] = (cfg.training.micro_batch_size, grad_accum, depth, drain, dl.persistent_workers)
        out["tokens_per_step"] = sum(b["input_ids"].numel() for b in memory[0]) * world
    dist.barrier()
    dist.destroy_process_group()


def _fmt(xs: list[float], scale: float = 1e3) -> str:
    return ", ".join(f"{x * scale:.0f}" for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(REPO / "examples/quickstart/config.yaml"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="data.dataloader_param.num_workers")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per timed block")
    parser.add_argument("--cpu-batches", type=int, default=40, help="micro-batches timed for loader CPU")
    parser.add_argument("--tokenize", action="store_true", help="tokenise and pack in every __getitem__")
    parser.add_argument("--json", help="also write the raw figures to this file")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = spawn_ranks(_worker, args.nproc, args)
    ranks = out["ranks"]
    # a step ends when the slowest rank ends (the barriers make every rank's block time that of the slowest)
    loader_t, memory_t = ranks[0]["loader"], ranks[0]["memory"]
    loader_s, memory_s = statistics.median(loader_t), statistics.median(memory_t)
    mbs, grad_accum, depth, drain, persistent = out["micro"]
    waits = [w for r in ranks for w in r["wait_ms"]]
    epoch_waits = [w for r in ranks for w in r["epoch_wait_ms"]]
    cpu_ms = statistics.median(r["cpu_ms"] for r in ranks)
    print(
        f"layout: {out['layout']}, dataset {out['dataset']}, micro-batch {mbs} x {grad_accum} accumulation, "
        f"{args.workers} loader workers per rank ({depth} micro-batches prefetched; {drain} untimed steps "
        f"before each loader block), {args.rounds} alternating rounds of {args.steps} steps"
    )
    print("| input | step time ms (median) | per round |")
    print("|---|---:|---|")
    print(f"| loader, {args.workers} workers | {loader_s * 1e3:.1f} | {_fmt(loader_t)} |")
    print(f"| pre-materialised list | {memory_s * 1e3:.1f} | {_fmt(memory_t)} |")
    paired = statistics.median(a / b for a, b in zip(loader_t, memory_t))
    print(
        f"ratio loader / pre-materialised: {loader_s / memory_s:.3f} (of the medians), "
        f"{paired:.3f} (median of the rounds' ratios)"
    )
    rank_cpu = {arm: statistics.median(c for r in ranks for c in r["rank_cpu"][arm]) for arm in ARMS}
    print(
        f"rank process CPU per step (all its threads, workers excluded), median over ranks and rounds: "
        f"loader {rank_cpu['loader'] * 1e3:.1f} ms, pre-materialised {rank_cpu['memory'] * 1e3:.1f} ms, "
        f"ratio {rank_cpu['loader'] / rank_cpu['memory']:.3f}"
    )
    print(
        f"wait in next() per step (epoch starts excluded), all ranks: "
        f"median {statistics.median(waits):.2f} ms, "
        f"max {max(waits):.1f} ms over {len(waits)} steps"
    )
    if epoch_waits:
        print(
            f"wait in next() at an epoch start ({'persistent' if persistent else 'new'} workers), "
            f"all ranks: {', '.join(f'{w:.0f}' for w in epoch_waits)} ms"
        )
    share = grad_accum * cpu_ms / (memory_s * 1e3)
    print(
        f"loader CPU per micro-batch (dataset + collate, one thread): {cpu_ms:.2f} ms; "
        f"x {grad_accum} per step = {share:.2%} of the step time (per rank)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(dict(out), indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
