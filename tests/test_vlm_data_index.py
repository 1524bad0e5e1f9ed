"""vlm_sft under the core loader: token-budget batches cut from its prepared ``sample_lengths()`` hold exactly
those tokens once collated (DataLoader workers read records through the memory-mapped index)."""

from __future__ import annotations

from types import SimpleNamespace

import yaml
from _vlm import make_assets

from mm_core.config.schema import DataConfig
from mm_core.data import EpochIterator, build_collator, build_dataloader
from mm_data_vlm.sft import VLMSFTDataset


def test_token_budget_batches_of_images_hold_their_prepared_lengths(tmp_path):
    data = yaml.safe_load(make_assets(tmp_path).read_text())["data"]
    dp = data["dataset_param"]
    ds = VLMSFTDataset(dp["basic_parameters"], dp["preprocess_parameters"], SimpleNamespace(on_error="raise"))
    lengths = ds.sample_lengths()
    assert len(set(lengths.tolist())) >= 3  # 0-2 images of three sizes
    budget = 3 * int(lengths.max())
    cfg = DataConfig.model_validate(
        {
            "dataset_param": dp,
            "dataloader_param": {
                "max_tokens_per_batch": budget,
                "num_workers": 2,
                "shuffle": True,
                "collate_param": {"collator_id": "qwen3vl"},
            },
        }
    )
    loader = build_dataloader(
        ds, build_collator(cfg, ds), cfg, micro_batch_size=1, dp_size=1, dp_rank=0, seed=3
    )
    it = EpochIterator(loader)
    seen: list[int] = []
    while len(seen) < 2 * len(ds):
        batch = next(it)
        ids = batch["sample_id"].tolist()
        assert batch["attention_mask"].sum(1).tolist() == [int(lengths[i]) for i in ids]
        assert len(ids) * batch["input_ids"].shape[1] <= budget
        assert batch["skipped_samples"] == 0
        seen += ids
    assert sorted(seen[: len(ds)]) == list(range(len(ds)))  # one epoch reads every sample once
