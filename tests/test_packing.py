"""Packing SFT, vision-language and audio samples (``data.dataloader_param.packing: true``).

- the config: packing needs ``max_tokens_per_batch`` (the row length), a collator that cannot pack is an
  error naming the key; the sampler fills a micro-batch while the sum of the lengths fits the budget;
- the packed row: positions restart per sample, labels -100 at each sample's first token, ``cu_seq_lens``;
- parity, fp32 on one process with transformers' sdpa attention (documents found from the restarting
  positions): the same samples collated by the family's real collator padded and packed give the same loss
  (global per-token mean) and gradients within 1e-5, for Qwen3 on text (``sft``), Qwen3-VL with images
  (``qwen3vl``, 3-D rope positions per sample) and Qwen3-ASR (``audio``). A control run packed with
  positions that do not restart (attention across samples) is far off, so the comparison can fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from _mm import QUICKSTART, REPO

from mm_core.config.schema import DataConfig, MMConfig
from mm_core.data import (
    EpochIterator,
    TokenBudgetBatchSampler,
    build_collator,
    build_dataloader,
    build_dataset,
)
from mm_core.errors import ConfigError
from mm_core.train.loss import IGNORE_INDEX, count_units, shift_labels, token_losses

KEY = "data.dataloader_param.packing"


def _data(data: dict[str, Any], packing: bool, budget: int) -> DataConfig:
    dl = {**data.get("dataloader_param", {}), "shuffle": False, "dynamic_batch_buffer": 1}
    dl.update(max_tokens_per_batch=budget, packing=packing)
    return DataConfig.model_validate({**data, "dataloader_param": dl})


def _text_data() -> dict[str, Any]:
    return {
        "dataset_param": {
            "dataset_type": "reference_lines",
            "basic_parameters": {"num_samples": 12, "cutoff_len": 40},
            "preprocess_parameters": {"model_name_or_path": str(REPO / "examples/quickstart/tokenizer")},
        },
        "dataloader_param": {"collate_param": {"collator_id": "sft"}},
    }


# ------------------------------------------------------------------------------------------- the config
def test_packing_needs_a_budget_and_a_packing_collator():
    with pytest.raises(ValueError, match="packing: true needs data.dataloader_param.max_tokens_per_batch"):
        DataConfig.model_validate(
            {"dataset_param": {"dataset_type": "x"}, "dataloader_param": {"packing": True}}
        )
    base = {
        "data": {
            "dataset_param": {"dataset_type": "x"},
            "dataloader_param": {"packing": True, "max_tokens_per_batch": 64},
        },
        "model": {"model_id": "qwen3", "loss_cfg": {"loss_type": "per_sample_loss"}},
        "training": {"train_iters": 1},
    }
    with pytest.raises(ValueError, match="per_sample_loss would weigh as one sample"):
        MMConfig.model_validate(base)
    base["model"] = {"model_id": "qwen3"}
    with pytest.raises(ValueError, match="not supported with context parallelism"):
        MMConfig.model_validate({**base, "parallel": {"ulysses_parallel_size": 2}})
    MMConfig.model_validate(base)
    import _plugin_datasets  # noqa: F401  (registers reference_lines)

    cfg = _data({**_text_data(), "dataloader_param": {}}, True, 64)
    ds = build_dataset(cfg, seed=1)
    with pytest.raises(ConfigError, match=rf"^{KEY}: true, but the collator 'default_collate'"):
        build_collator(cfg, ds)


def test_sampler_fills_rows_up_to_the_budget_and_the_row_is_packed():
    import _plugin_datasets  # noqa: F401

    cfg = _data(_text_data(), True, 64)
    ds = build_dataset(cfg, seed=1)
    lengths = ds.sample_lengths()
    it = EpochIterator(
        build_dataloader(ds, build_collator(cfg, ds), cfg, micro_batch_size=1, dp_size=1, dp_rank=0, seed=1)
    )
    seen: list[int] = []
    while len(seen) < len(ds):  # one epoch
        batch = next(it)
        ids = batch["sample_id"].tolist()
        n = [int(lengths[i]) for i in ids]
        following = len(seen) + len(ids)  # the row is full: the next sample would not fit
        assert sum(n) <= 64 and (following == len(ds) or sum(n) + int(lengths[following]) > 64)
        assert len(ids) > 1 or following == len(ds)
        assert batch["input_ids"].shape == (1, sum(n)) and "attention_mask" not in batch
        starts = torch.tensor([0, *n]).cumsum(0)
        assert (
            batch["cu_seq_lens_q"].tolist() == starts.tolist() and batch["cu_seq_lens_q"].dtype == torch.int32
        )
        assert batch["max_length_q"] == max(n)
        expected_pos = torch.cat([torch.arange(k) for k in n])
        assert batch["position_ids"][0].tolist() == expected_pos.tolist()
        labels = torch.cat([ds[i]["labels"] for i in ids])
        labels[starts[:-1]] = IGNORE_INDEX
        assert batch["labels"][0].tolist() == labels.tolist()
        seen += ids
    assert seen == list(range(len(seen)))  # the order is kept (buffer 1, no shuffle)
    # a row is filled by the sum of the lengths, also when the samples after the first are shorter
    sampler = TokenBudgetBatchSampler(
        np.array([11, 5, 10, 16, 3]),
        dp_size=1,
        dp_rank=0,
        max_tokens=42,
        buffer=1,
        shuffle=False,
        seed=0,
        drop_last=False,
        packed=True,
    )
    assert list(sampler) == [[0, 1, 2, 3], [4]]


# ---------------------------------------------------------------------------------------------- parity
def _loss_and_grads(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    batch = dict(batch)
    targets = shift_labels(batch.pop("labels"))
    batch.pop("sample_id", None)
    batch.pop("skipped_samples", None)
    logits = model(**batch, use_cache=False).logits
    loss = token_losses(logits, targets).sum() / count_units(targets, "per_token_loss")
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def _check_parity(model: torch.nn.Module, data: dict[str, Any], indices: list[int], budget: int) -> None:
    torch.manual_seed(0)
    padded_cfg, packed_cfg = _data(data, False, budget), _data(data, True, budget)
    ds = build_dataset(padded_cfg, seed=1)
    samples = [ds[i] for i in indices]
    padded = build_collator(padded_cfg, ds)(samples)
    packed = build_collator(packed_cfg, ds)(samples)
    assert padded["input_ids"].shape[0] == len(indices) and packed["input_ids"].shape[0] == 1
    model.train()
    loss_a, grads_a = _loss_and_grads(model, padded)
    loss_b, grads_b = _loss_and_grads(model, packed)
    assert abs(loss_a - loss_b) <= 1e-5 * max(1.0, abs(loss_a)), (loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    worst = max((grads_a[n] - grads_b[n]).abs().max().item() for n in grads_a)
    assert worst <= 1e-5, worst
    # control: the same row with positions that do not restart lets samples attend to each other
    crossed = {**packed, "position_ids": torch.arange(packed["input_ids"].shape[1]).unsqueeze(0)}
    loss_c, _ = _loss_and_grads(model, crossed)
    assert abs(loss_c - loss_a) > 1e-4, (loss_a, loss_c)


def test_qwen3_text_sft_packed_matches_padded():
    import _plugin_datasets  # noqa: F401
    from _tiny import QWEN3
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**{**QWEN3, "vocab_size": 4096}, attn_implementation="sdpa"))
    _check_parity(model, _text_data(), [0, 3, 5, 7, 8], 256)


def test_qwen3_vl_packed_matches_padded(tmp_path: Path):
    from _vlm import make_assets
    from transformers import Qwen3VLConfig

    from mm_models_qwen.qwen3_vl import Qwen3VLForTraining

    cfg = yaml.safe_load(make_assets(tmp_path, n=8).read_text())
    config = Qwen3VLConfig.from_pretrained(cfg["model"]["model_name_or_path"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3VLForTraining(config).float()
    _check_parity(model, cfg["data"], [0, 1, 2, 3, 4], 1024)  # 2, 1, 1, 0 and 2 images


def test_qwen3_asr_packed_matches_padded(tmp_path: Path):
    from _audio import make_audio_assets
    from transformers import AutoConfig

    from mm_models_qwen.qwen3_asr import Qwen3ASRForTraining

    cfg = yaml.safe_load(make_audio_assets(tmp_path, "qwen3_asr").read_text())
    config = AutoConfig.from_pretrained(cfg["model"]["model_name_or_path"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3ASRForTraining(config).float()
    _check_parity(model, cfg["data"], [0, 1, 2, 3, 4, 5], 2048)


assert QUICKSTART.exists()


# --------------------------------------------------------------------------------------- mm train, 2 ranks
def test_two_rank_training_packed_matches_padded(tmp_path_factory):
    """``mm train`` on 2 ranks (FSDP), 3 steps: each step reads all 8 samples, as 2 padded micro-batches of
    4 (budget 64 = 4 x 16) or as 2 packed rows of 4 samples each (35 and 42 tokens, budget 42). The same
    samples per step give the same losses, gradient norms and token counts."""
    from _mm import assert_close_series, train_layouts

    raw = yaml.safe_load(QUICKSTART.read_text(encoding="utf-8"))
    raw["data"] = _text_data()
    raw["data"]["dataset_param"]["basic_parameters"]["num_samples"] = 8
    raw["data"]["dataloader_param"].update(shuffle=False, dynamic_batch_buffer=1)
    raw["training"].update(plugin=["_plugin_datasets"], train_iters=3, gradient_accumulation_steps=1)
    config = tmp_path_factory.mktemp("cfg") / "packing.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    common = [
        "training.log_interval=1",
        "training.seed=5",
        "training.lr_warmup_ratio=0.0",
        "training.progress_bar=false",
        "training.save=null",
        "tools.tensorboard.enable=false",
    ]
    runs = train_layouts(
        tmp_path_factory,
        config,
        [
            ("padded", 2, [f"{KEY.replace('packing', 'max_tokens_per_batch')}=64"]),
            ("packed", 2, [f"{KEY.replace('packing', 'max_tokens_per_batch')}=42", f"{KEY}=true"]),
        ],
        common,
        timeout=300,
    )
    padded, packed = runs["padded"], runs["packed"]
    assert len(padded) == len(packed) == 3
    for field in ("loss", "grad_norm"):
        assert_close_series([r[field] for r in packed], [r[field] for r in padded], 1e-5, field)
    assert [r["tokens"] for r in packed] == [r["tokens"] for r in padded] == [77] * 3
