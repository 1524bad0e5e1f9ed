"""Token-budget (dynamic) batching, ``data.dataloader_param.max_tokens_per_batch``.

- the loader: a dataset without ``sample_lengths()`` or a sample longer than the budget is a config error
  naming the key; ``training.micro_batch_size`` plays no part;
- equal-length blocks (text_pretrain) under a budget of ``micro_batch_size * seq_len`` train bit-identically
  to fixed batches of ``micro_batch_size``;
- per-token normalisation stays global and exact: 2 ranks whose micro-batches hold different numbers of
  tokens give the losses and gradient norms of 1 process that reads the same samples (the 2-rank global
  micro-batch is rank 0's greedy cut followed by rank 1's, which is exactly what 1 process with 2
  accumulation steps reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _launch import run_in_one_launch
from _mm import QUICKSTART, REPO, assert_close_series, read_metrics
from _plugin_datasets import ReferenceLines

from mm_core.config.schema import DataConfig
from mm_core.data import EpochIterator, build_collator, build_dataloader
from mm_core.errors import ConfigError

KEY = "data.dataloader_param.max_tokens_per_batch"
COMMON = [
    "training.log_interval=1",
    "training.seed=5",
    "training.lr_warmup_ratio=0.0",
    "training.progress_bar=false",
    "training.save=null",
    "tools.tensorboard.enable=false",
]


# ------------------------------------------------------------------------------------------- the loader
class Plain(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.tensor([float(i)]), "sample_id": i}


class Lengths(Plain):
    def sample_lengths(self) -> Any:
        return torch.arange(1, 9).numpy()  # sample i has i + 1 tokens


def _loader(ds: Any, dataloader: dict[str, Any], *, mbs: int = 2, dp: int = 1, rank: int = 0) -> Any:
    cfg = DataConfig.model_validate(
        {"dataset_param": {"dataset_type": "ids"}, "dataloader_param": dataloader}
    )
    return build_dataloader(
        ds, torch.utils.data.default_collate, cfg, micro_batch_size=mbs, dp_size=dp, dp_rank=rank, seed=1
    )


def test_a_budget_needs_sample_lengths_and_room_for_the_longest_sample():
    with pytest.raises(ConfigError, match=rf"^{KEY}: dataset 'ids' has no sample_lengths\(\)"):
        _loader(Plain(), {"max_tokens_per_batch": 16})
    with pytest.raises(
        ConfigError, match=rf"^{KEY}: 7 is smaller than sample 7, which has 8 tokens; raise it"
    ):
        _loader(Lengths(), {"max_tokens_per_batch": 7})
    with pytest.raises(ConfigError, match=r"fewer than the 9 data-parallel ranks"):
        _loader(Lengths(), {"max_tokens_per_batch": 8}, dp=9)


def test_micro_batch_size_plays_no_part_under_a_budget():
    def batches(mbs: int) -> list[list[int]]:
        it = EpochIterator(_loader(Lengths(), {"max_tokens_per_batch": 10}, mbs=mbs))
        return [next(it)["sample_id"].tolist() for _ in range(4)]

    assert batches(1) == batches(5)
    for batch in batches(1):
        assert len(batch) * (max(batch) + 1) <= 10


# ------------------------------------------------------------------------------------ through training
def _train_here(config: Path, overrides: list[str]) -> list[dict[str, Any]]:
    """Train in this process (a 1-rank gloo group, see the ``group`` fixture); the logged records."""
    from mm_core.config.loader import load_config
    from mm_core.train.trainer import Trainer

    return Trainer(load_config(str(config), overrides), str(config)).setup().train()


def test_equal_length_blocks_under_a_budget_train_bit_identically_to_fixed_batches(group, tmp_path):
    common = [*COMMON, "data.dataset_param.basic_parameters.seq_len=32", "training.train_iters=4"]
    common += ["training.micro_batch_size=4", "training.gradient_accumulation_steps=2"]
    fixed = _train_here(QUICKSTART, [*common, f"training.output_dir={tmp_path / 'fixed'}"])
    budget = _train_here(QUICKSTART, [*common, f"{KEY}=128", f"training.output_dir={tmp_path / 'budget'}"])
    for field in ("loss", "grad_norm", "tokens"):  # 128 = 4 blocks x 32 tokens
        assert [r[field] for r in budget] == [r[field] for r in fixed], field
    assert [r["tokens"] for r in fixed] == [2 * 4 * 32] * 4


def _reference_config(tmp_path: Path) -> Path:
    raw = yaml.safe_load(QUICKSTART.read_text(encoding="utf-8"))
    raw["data"]["dataset_param"] = {
        "dataset_type": "reference_lines",
        "basic_parameters": {"num_samples": 120, "cutoff_len": 32},
        "preprocess_parameters": {"model_name_or_path": "examples/quickstart/tokenizer"},
    }
    raw["data"]["dataloader_param"].update(
        max_tokens_per_batch=96, dynamic_batch_buffer=16, collate_param={"collator_id": "sft"}
    )
    raw["training"].update(plugin=["_plugin_datasets"], train_iters=5)
    path = tmp_path / "reference_lines.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return path


def _steps(config: Path, ds: ReferenceLines, dp: int, accumulation: int, steps: int) -> list[list[list[int]]]:
    """The samples of each training step, per micro-batch (accumulation steps, each the ranks in order)."""
    cfg = DataConfig.model_validate(yaml.safe_load(config.read_text(encoding="utf-8"))["data"])
    collate = build_collator(cfg, ds)
    its = [
        EpochIterator(build_dataloader(ds, collate, cfg, micro_batch_size=1, dp_size=dp, dp_rank=r, seed=5))
        for r in range(dp)
    ]
    return [[next(it)["sample_id"].tolist() for _ in range(accumulation) for it in its] for _ in range(steps)]


def test_per_token_normalisation_stays_global_with_uneven_ranks(group, tmp_path):
    config = _reference_config(tmp_path)
    data = yaml.safe_load(config.read_text(encoding="utf-8"))["data"]["dataset_param"]
    ds = ReferenceLines(data["basic_parameters"], data["preprocess_parameters"], seed=5)
    two_ranks, one_rank = _steps(config, ds, 2, 1, 5), _steps(config, ds, 1, 2, 5)
    assert two_ranks == one_rank  # the same samples, cut into the same micro-batches, in every step
    lengths = ds.sample_lengths()
    tokens = [[int(lengths[b].sum()) for b in step] for step in two_ranks]
    assert sum(r0 != r1 for r0, r1 in tokens) >= 3, f"the ranks should hold different token counts: {tokens}"

    out = tmp_path / "two"
    two_rank_run = (
        "two",
        str(config),
        [*COMMON, "training.gradient_accumulation_steps=1", f"training.output_dir={out}"],
    )
    run_in_one_launch(2, [two_rank_run], REPO, timeout=300)
    two = read_metrics(out)
    one = _train_here(
        config, [*COMMON, "training.gradient_accumulation_steps=2", f"training.output_dir={tmp_path}"]
    )
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one] == [sum(t) for t in tokens]
    for field in ("loss", "grad_norm"):
        assert_close_series([r[field] for r in two], [r[field] for r in one], 1e-5, field)
