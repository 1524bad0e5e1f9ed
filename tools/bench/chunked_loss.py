"""Chunked linear + cross-entropy loss vs the loss of the full logits: peak memory and tokens/s, side by side.

    python tools/bench/chunked_loss.py [--vocab 151936] [--seq 4096] [--hidden 256] [--rounds 2] [--steps 3]

Trains a Qwen3 with Qwen's vocabulary (151,936, tied embeddings; hidden ``--hidden``, 2 layers; built from a
config, random init) on the quickstart text packed to ``--seq`` tokens, one sample per step, fp32 AdamW, in a
fresh process per run, with ``model.loss_cfg.chunked_loss`` false and true (``--chunk`` tokens per chunk).
The runs alternate for ``--rounds`` rounds so machine noise hits both alike. Per configuration: the peak
resident memory of the process above its baseline before the model is built (CPU; the allocator peak on an
accelerator; the measure and the worker are those of ``tools/bench/memory.py``), the median step time of the
steps after the first, tokens/s, and the ratios chunked / full.

The goal (issue 17): peak memory at least 40% lower, tokens/s at most 5% lower.

    python tools/bench/chunked_loss.py --vs-vocab 4096 --micro 2 --seq 2048 --chunk 1024 --rounds 1

instead compares vocabularies, the chunked loss on in every run: ``--vocab`` with ``loss_chunk_size: auto``
(and with ``--chunk`` tokens when it is a number), against ``--vs-vocab`` with ``auto``, and prints what the
large vocabulary adds to the peak (the goal of issue 30: at most 1.0 GB at 151,936 vs 4,096, 2 x 2048 tokens,
hidden 256).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import free_port  # noqa: E402  (the bench folder's shared helpers)
from memory import MiB, _worker, overrides  # noqa: E402


def model_dir(vocab: int, hidden: int) -> Path:
    from transformers import Qwen3Config

    d = Path(tempfile.mkdtemp(prefix="mm-bench-vocab-"))
    Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=0,
    ).save_pretrained(d)
    return d


def run(args: list[str]) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        out = [*args, f"training.output_dir={tmp}/run"]
        mp.start_processes(
            _worker, args=(1, free_port(), out, result), nprocs=1, start_method="spawn", join=True
        )
        return json.loads(Path(result).read_text(encoding="utf-8"))[0]


def compare_vocab(a: argparse.Namespace, base: list[str]) -> None:
    """``--vs-vocab``: the extra peak of ``--vocab`` over ``--vs-vocab``, chunked loss on (see the top)."""
    large, small = model_dir(a.vocab, a.hidden), model_dir(a.vs_vocab, a.hidden)
    configs = {
        f"vocab {a.vs_vocab:,}, chunk auto": [f"model.model_name_or_path={small}"],
        f"vocab {a.vocab:,}, chunk auto": [f"model.model_name_or_path={large}"],
    }
    if a.chunk != "auto":
        configs[f"vocab {a.vocab:,}, chunk {a.chunk}"] = [
            f"model.model_name_or_path={large}",
            f"model.loss_cfg.loss_chunk_size={a.chunk}",
        ]
    seen: dict[str, list[dict]] = {name: [] for name in configs}
    for r in range(a.rounds):
        for name, extra in configs.items():
            res = run([*base, "model.loss_cfg.chunked_loss=true", *extra])
            seen[name].append(res)
            print(f"  round {r + 1} {name}: peak {res['peak'] / MiB:.0f} MiB", flush=True)
    ref_name = next(iter(configs))
    ref = max(x["peak"] for x in seen[ref_name])
    print("\n| run | peak MiB | over the small vocabulary, GB |\n|---|---:|---:|")
    for name, results in seen.items():
        peak = max(x["peak"] for x in results)
        print(f"| {name} | {peak / MiB:.0f} | {(peak - ref) / 1e9:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=1, help="sequences per step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunk", default="auto", help="model.loss_cfg.loss_chunk_size: auto or tokens")
    parser.add_argument("--vs-vocab", type=int, default=None, help="compare vocabularies (docstring)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    a = parser.parse_args()
    if a.chunk != "auto" and not a.chunk.isdigit():
        parser.error(f"--chunk: auto or a number of tokens, got {a.chunk!r}")
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    print(
        f"model: Qwen3 vocab {a.vocab:,} (tied), hidden {a.hidden}, 2 layers; 1 process, 1 thread; "
        f"{a.micro} x {a.seq} tokens per step, fp32 AdamW; {a.steps} steps per run (the first not timed), "
        f"{a.rounds} rounds",
        flush=True,
    )
    if a.vs_vocab is not None:
        base = overrides(Path("unused"), a.steps, a.seq, a.micro, "unused")[1:-1]  # model and dir per run
        compare_vocab(a, base)
        return
    model = model_dir(a.vocab, a.hidden)
    base = overrides(model, a.steps, a.seq, a.micro, "unused")[:-1]  # the output dir is set per run
    configs = {
        "full logits": ["model.loss_cfg.chunked_loss=false"],
        f"chunked ({a.chunk} tokens)": [
            "model.loss_cfg.chunked_loss=true",
            f"model.loss_cfg.loss_chunk_size={a.chunk}",
        ],
    }
    seen: dict[str, list[dict]] = {name: [] for name in configs}
    for r in range(a.rounds):
        for name, extra in configs.items():
            res = run([*base, *extra])
            seen[name].append(res)
            print(
                f"  round {r + 1} {name}: peak {res['peak'] / MiB:.0f} MiB, step {res['step_s']:.2f} s",
                flush=True,
            )
    rows = {}
    for name, results in seen.items():
        step = statistics.median(x["step_s"] for x in results)
        rows[name] = {"peak": max(x["peak"] for x in results), "step": step, "tps": a.micro * a.seq / step}
    full, chunked = rows["full logits"], rows[next(n for n in configs if n.startswith("chunked"))]
    print("\n| loss | peak MiB | step s | tokens/s |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['peak'] / MiB:.0f} | {row['step']:.2f} | {row['tps']:.0f} |")
    print(
        f"\nchunked / full: peak memory {chunked['peak'] / full['peak']:.3f} "
        f"({1 - chunked['peak'] / full['peak']:.1%} lower), tokens/s {chunked['tps'] / full['tps']:.3f}"
    )


if __name__ == "__main__":
    sys.exit(main())
