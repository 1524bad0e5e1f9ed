"""Packed vs padded micro-batches of SFT samples: real (non-padding) tokens per second at equal memory.

    python tools/bench/packing.py [--samples 192] [--budget 1024] [--hidden 256] [--layers 4] [--rounds 2]
                                  [--attn sdpa mm_varlen]

Every side trains the same Qwen3 (vocabulary 4,096, ``--hidden``, ``--layers``; fp32 AdamW, random init),
with each attention of ``--attn``: transformers' ``sdpa``, and/or mm's document-aware ``mm_varlen``, which
attends each sample of a packed row alone and each padded row up to its length (the documents' lengths
computed once per micro-batch, as mm's trainer does), on the same ``--samples`` samples of real text (the
Python reference manual, ``pydoc_data.topics``, tokenised with the quickstart tokenizer; lengths 16 to 512
tokens, most short, as in chat data), in the same order, with the same token budget per micro-batch
(``max_tokens_per_batch: --budget``), so a micro-batch never holds more than ``--budget`` token positions on
any side:

- padded: mm's token-budget sampler (``count x longest <= budget``) and the ``sft`` collator right-padding
  each micro-batch, twice: ``padded_order`` keeps the order (``dynamic_batch_buffer: 1``, what fixed-size
  batches of shuffled data look like) and ``padded_sorted`` sorts by length inside windows of 256 samples
  (mm's default, which removes most padding when the window holds the whole set);
- packed: ``data.dataloader_param.packing: true``: the sampler fills one row up to ``budget`` tokens in all
  and the ``sft`` collator packs it (positions restarting per sample, no attention across samples).

One epoch is timed per side (attention x batching); the sides alternate for ``--rounds`` rounds (the best
epoch of each side counts). Printed: positions computed (real + padding), real tokens, seconds, real tokens/s,
the ratio packed / padded per attention, and each packed side against the fastest padded side of the run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
#: the attentions a run can compare (``--attn``)
ATTENTIONS = ("sdpa", "mm_varlen")
TOKENIZER = REPO / "examples" / "quickstart" / "tokenizer"


def make_samples(n: int, seed: int) -> list[torch.Tensor]:
    """``n`` token sequences of real text, lengths drawn log-uniformly from 16 to 512."""
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)
    stream = tok("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)["input_ids"]
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(16), np.log(512), n)).astype(int)
    out, pos = [], 0
    for n_tok in lengths:
        out.append(torch.tensor(stream[pos : pos + n_tok], dtype=torch.long))
        pos = (pos + n_tok) % (len(stream) - 512)
    return out


class Samples(torch.utils.data.Dataset):
    def __init__(self, ids: list[torch.Tensor]) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone(), "sample_id": i}

    def sample_lengths(self) -> np.ndarray:
        return np.array([len(x) for x in self.ids], dtype=np.int64)


def batches(ds: Samples, budget: int, packing: bool, buffer: int) -> list[dict[str, Any]]:
    """One epoch of micro-batches, built by mm's sampler and ``sft`` collator."""
    from mm_core.config.schema import DataConfig
    from mm_core.data import build_collator, build_dataloader

    cfg = DataConfig.model_validate(
        {
            "dataset_param": {"dataset_type": "bench"},
            "dataloader_param": {
                "shuffle": False,
                "drop_last": False,
                "max_tokens_per_batch": budget,
                "packing": packing,
                "dynamic_batch_buffer": buffer,
                "collate_param": {"collator_id": "sft"},
            },
        }
    )
    loader = build_dataloader(
        ds, build_collator(cfg, ds), cfg, micro_batch_size=1, dp_size=1, dp_rank=0, seed=0
    )
    return list(loader)


def epoch(
    model: torch.nn.Module, opt: torch.optim.Optimizer, micro: list[dict[str, Any]], varlen: bool
) -> float:
    from mm_core.models.varlen import document_kwargs
    from mm_core.train.loss import count_units, shift_labels, token_losses

    start = time.perf_counter()
    for batch in micro:
        batch = {k: v for k, v in batch.items() if k not in ("sample_id", "skipped_samples")}
        if varlen:  # as mm's trainer: the documents' lengths once per micro-batch, timed with the step
            batch = {**batch, **document_kwargs(batch)}
        targets = shift_labels(batch.pop("labels"))
        logits = model(**batch, use_cache=False).logits
        loss = token_losses(logits, targets).sum() / count_units(targets, "per_token_loss").clamp(min=1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=192)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--attn", nargs="+", choices=ATTENTIONS, default=["sdpa"], help="attentions, each with every batching"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import mm_data_text.collators  # noqa: F401  (registers the sft collator)
    from mm_core.models.varlen import VARLEN_ATTENTION, register_varlen_attention

    register_varlen_attention()
    ds = Samples(make_samples(args.samples, seed=0))
    real = int(ds.sample_lengths().sum())
    batchings = {
        "padded_order": batches(ds, args.budget, False, 1),
        "padded_sorted": batches(ds, args.budget, False, 256),
        "packed": batches(ds, args.budget, True, 1),
    }
    sides = [(attn, name) for attn in args.attn for name in batchings]
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(args.rounds):
        for attn, name in sides:
            torch.manual_seed(0)
            config = Qwen3Config(
                vocab_size=4096,
                hidden_size=args.hidden,
                intermediate_size=4 * args.hidden,
                num_hidden_layers=args.layers,
                num_attention_heads=max(args.hidden // 64, 2),
                num_key_value_heads=max(args.hidden // 128, 1),
                head_dim=64,
                attn_implementation=attn,
            )
            model = Qwen3ForCausalLM(config).train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            micro, varlen = batchings[name], attn == VARLEN_ATTENTION
            epoch(model, opt, micro[:2], varlen)  # warm-up
            best[attn, name] = min(best[attn, name], epoch(model, opt, micro, varlen))
    print(f"{args.samples} samples, {real:,} real tokens; budget {args.budget} positions per micro-batch")
    for attn, name in sides:
        micro = batchings[name]
        positions = sum(int(b["input_ids"].numel()) for b in micro)
        widest = max(int(b["input_ids"].numel()) for b in micro)
        print(
            f"{attn:>9} {name:>13}: {len(micro):4d} micro-batches, {positions:7,} positions "
            f"({real / positions:5.1%} real), largest {widest} <= {args.budget}, {best[attn, name]:7.2f} s, "
            f"{real / best[attn, name]:8,.0f} real tokens/s"
        )
    for attn in args.attn:
        for name in ("padded_order", "padded_sorted"):
            print(f"{attn}: packed / {name} real tokens/s: {best[attn, name] / best[attn, 'packed']:.2f}x")
    fastest = min((key for key in sides if key[1] != "packed"), key=lambda key: best[key])
    for attn in args.attn:
        ratio = best[fastest] / best[attn, "packed"]
        print(f"{attn} packed / fastest padded side ({' '.join(fastest)}): {ratio:.2f}x")


if __name__ == "__main__":
    main()
