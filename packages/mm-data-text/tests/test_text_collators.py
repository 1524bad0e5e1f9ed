import pytest
import torch

from mm_core.errors import ConfigError, DataError
from mm_data_text.collators import LLMPretrainCollator, SFTCollator
from mm_data_text.packing import pack_documents


class FakeDataset:
    pad_token_id = 7


def sample(n, sample_id):
    ids = torch.arange(1, n + 1)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(n), "sample_id": sample_id}


def test_sft_pads_to_longest():
    batch = SFTCollator({"collator_id": "sft", "model_name": "qwen2"}, FakeDataset())(
        [sample(3, 4), sample(5, 9)]
    )
    assert set(batch) == {"input_ids", "labels", "position_ids", "attention_mask", "sample_id"}
    assert batch["input_ids"].tolist() == [[1, 2, 3, 7, 7], [1, 2, 3, 4, 5]]
    assert batch["labels"].tolist() == [[1, 2, 3, -100, -100], [1, 2, 3, 4, 5]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["sample_id"].tolist() == [4, 9] and batch["sample_id"].dtype == torch.long
    assert all(v.dtype == torch.long for v in batch.values())


def test_sft_pad_to_multiple_and_pad_labels():
    collate = SFTCollator({"pad_to_multiple_of": 8, "ignore_pad_token_for_loss": False}, FakeDataset())
    batch = collate([sample(3, 0), sample(5, 1)])
    assert batch["input_ids"].shape == (2, 8)
    assert batch["labels"][0].tolist() == [1, 2, 3, 7, 7, 7, 7, 7]
    assert batch["attention_mask"].sum().item() == 8


def test_llm_pretrain_stacks_blocks():
    stream = pack_documents([[1, 2, 3], [4, 5, 6, 7, 8]], seq_len=4, eos_id=0)
    features = [dict(stream.block(i), sample_id=i) for i in range(len(stream))]
    batch = LLMPretrainCollator({"collator_id": "llm_pretrain"}, None)(features)
    assert set(batch) == {"input_ids", "labels", "position_ids", "sample_id"}
    assert torch.equal(batch["input_ids"], torch.stack([f["input_ids"] for f in features]))
    assert torch.equal(batch["labels"], torch.stack([f["labels"] for f in features]))
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    with pytest.raises(DataError, match="different lengths"):
        LLMPretrainCollator({}, None)([sample(3, 0), sample(4, 1)])


def test_collate_param_errors():
    with pytest.raises(
        ConfigError,
        match=r"collate_param\.pad_to_multiple: unknown key; did you mean "
        r"'pad_to_multiple_of'",
    ):
        SFTCollator({"pad_to_multiple": 8}, None)
    with pytest.raises(ConfigError, match=r"collate_param\.pad_to_multiple_of: got 0; expected a positive"):
        LLMPretrainCollator({"pad_to_multiple_of": 0}, None)


def test_works_with_a_dataloader():
    data = [sample(n, i) for i, n in enumerate([2, 6, 4, 3])]
    loader = torch.utils.data.DataLoader(data, batch_size=2, collate_fn=SFTCollator({}, FakeDataset()))
    shapes = [tuple(b["input_ids"].shape) for b in loader]
    assert shapes == [(2, 6), (2, 4)]
