"""Data at scale: preparation, start-up and per-rank memory of a prepared corpus; padding and speed of
token-budget batching.

``text`` — two corpora built from the Python language reference bundled with the standard library, repeated
with variation (every copy reorders the paragraphs with its own seed and numbers them) to ``--sizes`` MB as
JSONL, tokenised with the quickstart tokenizer:

- prepare: ``mm data prepare``'s work (``TextPretrainDataset.prepare``) with ``--workers`` local processes;
- start-up: on ``--nproc`` local ranks at once (separate processes, as under torchrun), the time to build the
  dataset from the prepared cache (the median of 5 builds per rank), and each rank's resident memory after
  building it and reading ``--reads`` random blocks, minus the rank's memory before (``VmRSS`` of
  /proc/self/status; anonymous and file-backed pages shown apart);
- before: the same start-up with in-memory tokenisation (what every rank did before preparation existed:
  read every document, tokenise, pack), on the smallest corpus only unless ``--before-all``.

The goal (issue 13): start-up and RSS ratio of the largest to the smallest corpus at most 1.5.

``vlm`` — the digits VLM data with mixed image sizes (``examples/qwen3vl_digits/build_data.py
--mixed-sizes``, needs scikit-learn), the tiny Qwen3-VL of the example trained for ``--steps`` steps on one
process, fixed micro-batches of ``--micro-batch-size`` vs ``data.dataloader_param.max_tokens_per_batch``
(default: the padded size of a fixed micro-batch of the longest samples): the share of padding among the
tokens the loader hands out, and real (non-padding) tokens per second of training.

    python tools/bench/data.py text [--sizes 10,200] [--nproc 2] [--workers 2]
    python tools/bench/data.py vlm [--steps 40] [--micro-batch-size 16]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "examples" / "quickstart" / "tokenizer"
MB = 1 << 20


def _paragraphs() -> list[str]:
    from pydoc_data.topics import topics

    return [p.strip() for t in sorted(topics) for p in topics[t].split("\n\n") if p.strip()]


def write_corpus(path: Path, megabytes: int) -> int:
    """JSONL of documents (about 2 KB each) until ``megabytes``; returns the number of documents."""
    paragraphs = _paragraphs()
    docs, size, copy = 0, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * MB:
            order = list(range(len(paragraphs)))
            random.Random(copy).shuffle(order)
            doc: list[str] = []
            for i in order:
                doc.append(f"[{copy}.{i}] {paragraphs[i]}")
                if sum(len(p) for p in doc) > 2000:
                    line = json.dumps({"text": "\n\n".join(doc)}) + "\n"
                    f.write(line)
                    size += len(line.encode())
                    docs += 1
                    doc = []
                    if size >= megabytes * MB:
                        break
            copy += 1
    return docs


def _rss() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return out


def _basic(corpus: Path, cache: Path) -> dict[str, Any]:
    return {"dataset": str(corpus), "seq_len": 1024, "cache_dir": str(cache)}


def _rank(corpus: str, cache: str, reads: int, in_memory: bool, start: Any, queue: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import numpy as np
    import torch  # noqa: F401 - imported before measuring, as in a training process

    from mm_data_text.pretrain import TextPretrainDataset, encode_documents
    from mm_data_text.tokenizer import load_tokenizer

    load_tokenizer(str(TOKENIZER))  # the tokenizer is loaded (and its memory counted) before the baseline
    start.wait()
    base = _rss()
    t0 = time.perf_counter()
    if in_memory:
        from mm_data_text.packing import pack_documents
        from mm_data_text.sources import read_documents

        tok = load_tokenizer(str(TOKENIZER))
        stream = pack_documents(
            encode_documents(tok, read_documents(Path(corpus)), tok.eos_token_id), 1024, None
        )
        n, get = len(stream), stream.block
        startup = time.perf_counter() - t0
    else:
        times = []
        for _ in range(5):  # the median of 5 builds: each one finds and maps the prepared cache
            t0 = time.perf_counter()
            ds = TextPretrainDataset(
                _basic(Path(corpus), Path(cache)), {"model_name_or_path": str(TOKENIZER)}
            )
            times.append(time.perf_counter() - t0)
            assert not ds.built, "the corpus must be prepared before the start-up is measured"
        startup = statistics.median(times)
        n, get = len(ds), ds.__getitem__
    built = _rss()
    rng = np.random.default_rng(0)
    for i in rng.integers(0, n, reads):
        get(int(i))
    after = _rss()
    queue.put(
        {
            "startup_s": startup,
            "blocks": n,
            "built_MiB": built["VmRSS"] - base["VmRSS"],
            **{k: after[k] - base[k] for k in after},
        }
    )


def _ranks(corpus: Path, cache: Path, nproc: int, reads: int, in_memory: bool) -> list[dict[str, float]]:
    ctx = mp.get_context("spawn")
    start, queue = ctx.Barrier(nproc), ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(str(corpus), str(cache), reads, in_memory, start, queue))
        for _ in range(nproc)
    ]
    for p in procs:
        p.start()
    rows = [queue.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a rank failed (exit {p.exitcode})")
    return rows


def bench_text(args: argparse.Namespace) -> None:
    from mm_data_text.pretrain import TextPretrainDataset

    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="mm_bench_data_"))
    results = []
    try:
        for mb in sizes:
            corpus, cache = work / f"corpus_{mb}mb.jsonl", work / f"cache_{mb}"
            docs = write_corpus(corpus, mb)
            t0 = time.perf_counter()
            TextPretrainDataset.prepare(
                _basic(corpus, cache), {"model_name_or_path": str(TOKENIZER)}, workers=args.workers
            )
            prepare_s = time.perf_counter() - t0
            tokens_mb = sum(f.stat().st_size for f in cache.rglob("*.tok")) / MB
            rows = _ranks(corpus, cache, args.nproc, args.reads, in_memory=False)
            before = None
            if mb == sizes[0] or args.before_all:
                before = _ranks(corpus, cache, args.nproc, args.reads, in_memory=True)
            results.append((mb, docs, prepare_s, tokens_mb, rows, before))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def mean(rows: list[dict[str, float]], key: str) -> float:
        return statistics.mean(r[key] for r in rows)

    print(f"{args.nproc} ranks, {args.workers} preparation processes, seq_len 1024, {args.reads} reads")
    print("RSS = growth of the rank's resident memory: after building the dataset, and after the reads")
    print("split into private (anonymous) and file-backed pages (code of the libraries; no shard is mapped)")
    head = ["corpus", "docs", "blocks", "prepare s", "shards MB", "start-up s", "RSS built", "anon read",
            "file read", "| before: start-up s", "RSS"]  # fmt: skip
    print("  ".join(f"{h:>10}" for h in head))
    for mb, docs, prep, tok_mb, rows, before in results:
        cells = [f"{mb} MB", docs, int(rows[0]["blocks"]), f"{prep:.1f}", f"{tok_mb:.1f}",
                 f"{mean(rows, 'startup_s'):.4f}", f"{mean(rows, 'built_MiB'):.2f}",
                 f"{mean(rows, 'RssAnon'):.2f}", f"{mean(rows, 'RssFile'):.1f}"]  # fmt: skip
        if before:
            cells += [f"| {mean(before, 'startup_s'):.2f}", f"{mean(before, 'VmRSS'):.1f}"]
        print("  ".join(f"{c:>10}" for c in cells))
    small, large = results[0], results[-1]
    for key, label in (("startup_s", "start-up"), ("built_MiB", "RSS after start-up"),
                       ("RssAnon", "private RSS after reads"),
                       ("RssFile", "file-backed RSS after reads")):  # fmt: skip
        ratio = mean(large[4], key) / max(mean(small[4], key), 1e-9)
        print(f"{label} ratio {large[0]} MB / {small[0]} MB: {ratio:.2f}")


# ------------------------------------------------------------------------------------------------- vlm
def _train(cfg: Path, out: Path, overrides: list[str]) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mm_core.cli", "train", str(cfg), *overrides, f"training.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _padding(cfg_path: Path, overrides: list[str], micro_batches: int) -> tuple[int, int]:
    """(real, padded) tokens of the first ``micro_batches`` micro-batches the run reads (one rank)."""
    from mm_core.config import load_config
    from mm_core.data import EpochIterator, build_collator, build_dataloader, build_dataset

    cfg = load_config(str(cfg_path), overrides)
    dataset = build_dataset(cfg.data, cfg.training.seed)
    loader = build_dataloader(
        dataset,
        build_collator(cfg.data, dataset),
        cfg.data,
        micro_batch_size=cfg.training.micro_batch_size,
        dp_size=1,
        dp_rank=0,
        seed=cfg.training.seed,
    )
    batches = EpochIterator(loader)
    real = padded = 0
    for _ in range(micro_batches):
        batch = next(batches)
        real += int(batch["attention_mask"].sum())
        padded += int(batch["input_ids"].numel())
    return real, padded


def bench_vlm(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="mm_bench_vlm_"))
    try:
        build = work / "build"
        subprocess.run([sys.executable, "examples/qwen3vl_digits/build_data.py", "--out", str(build),
                        "--mixed-sizes"], cwd=REPO, check=True, capture_output=True)  # fmt: skip
        cfg = REPO / "examples" / "qwen3vl_digits" / "config.yaml"
        common = [
            f"data.dataset_param.basic_parameters.dataset_dir={build / 'data'}",
            f"data.dataset_param.preprocess_parameters.model_name_or_path={build / 'processor'}",
            "data.dataset_param.preprocess_parameters.image_min_pixels=784",
            "data.dataset_param.preprocess_parameters.image_max_pixels=12544",
            f"data.dataset_param.basic_parameters.cache_dir={work / 'cache'}",
            f"model.model_name_or_path={build / 'model'}",
            f"training.micro_batch_size={args.micro_batch_size}",
            f"training.train_iters={args.steps}",
            "training.log_interval=1",
            "training.save=null",
            "training.progress_bar=false",
            "tools.tensorboard.enable=false",
        ]
        # the budget: what the longest samples need in a fixed micro-batch, so no batch gets more memory
        budget = args.max_tokens or args.micro_batch_size * 34
        runs = {"fixed": common, "budget": [*common, f"data.dataloader_param.max_tokens_per_batch={budget}"]}
        rows = {}
        for name, overrides in runs.items():
            metrics = _train(cfg, work / name, overrides)[args.warmup :]
            accum = 1
            for item in overrides:
                if item.startswith("training.gradient_accumulation_steps="):
                    accum = int(item.split("=")[1])
            real, padded = _padding(cfg, overrides, args.steps * accum)
            tokens = sum(r["tokens"] for r in metrics)
            seconds = sum(r["step_time_s"] for r in metrics)
            rows[name] = (real, padded, tokens / len(metrics), tokens / seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"digits VLM, images of 28/56/84/112 px (19-34 tokens per sample), 1 process, {args.steps} steps")
    print(f"fixed: micro_batch_size {args.micro_batch_size}; budget: max_tokens_per_batch {budget}")
    print(f"{'':>8} {'padding share':>14} {'real tokens/step':>17} {'real tokens/s':>14}")
    for name, (real, padded, per_step, speed) in rows.items():
        print(f"{name:>8} {(padded - real) / padded:>14.1%} {per_step:>17.1f} {speed:>14.1f}")
    (fr, fp, _, fs), (br, bp, _, bs) = rows["fixed"], rows["budget"]
    print(f"padding tokens per real token: fixed {(fp - fr) / fr:.3f}, budget {(bp - br) / br:.3f}; "
          f"real tokens/s budget / fixed: {bs / fs:.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("text")
    t.add_argument("--sizes", default="10,200", help="corpus sizes in MB, smallest first")
    t.add_argument("--nproc", type=int, default=2)
    t.add_argument("--workers", type=int, default=2)
    t.add_argument("--reads", type=int, default=256)
    t.add_argument("--before-all", action="store_true")
    v = sub.add_parser("vlm")
    v.add_argument("--steps", type=int, default=40)
    v.add_argument("--warmup", type=int, default=5, help="first steps left out of the speed")
    v.add_argument("--micro-batch-size", type=int, default=16)
    v.add_argument("--max-tokens", type=int, default=None, help="default: micro-batch-size x 34")
    args = parser.parse_args()
    bench_text(args) if args.what == "text" else bench_vlm(args)


if __name__ == "__main__":
    main()
