"""Checks the committed quickstart assets when this package is tested inside the mm repository."""

from pathlib import Path

import pytest

from mm_data_text.collators import LLMPretrainCollator, SFTCollator
from mm_data_text.packing import IGNORE_INDEX
from mm_data_text.pretrain import TextPretrainDataset
from mm_data_text.sft import SFTDataset

QUICKSTART = Path(__file__).resolve().parents[3] / "examples" / "quickstart"
pytestmark = pytest.mark.skipif(
    not (QUICKSTART / "tokenizer" / "tokenizer.json").is_file(), reason="quickstart assets not present"
)


def test_quickstart_tokenizer_and_data():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(QUICKSTART / "tokenizer"))
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert {"<|im_start|>", "<|im_end|>"} <= set(tokenizer.all_special_tokens)
    assert 4000 <= len(tokenizer) <= 4096

    basic = {"dataset_dir": str(QUICKSTART / "data"), "dataset": "python_reference.jsonl", "seq_len": 256}
    pretrain = TextPretrainDataset(basic, {"model_name_or_path": str(QUICKSTART / "tokenizer")}, None, seed=0)
    assert pretrain.num_documents == 79 and len(pretrain) > 100
    batch = LLMPretrainCollator({"collator_id": "llm_pretrain"}, pretrain)([pretrain[0], pretrain[1]])
    assert batch["input_ids"].shape == (2, 256)

    basic = {
        "dataset_dir": str(QUICKSTART / "data"),
        "dataset": "python_reference_chat.jsonl",
        "cutoff_len": 512,
    }
    sft = SFTDataset(basic, {"model_name_or_path": str(QUICKSTART / "tokenizer")}, None, seed=0)
    assert len(sft) + sft.num_skipped == 79
    item = sft[0]
    labelled = item["input_ids"][item["labels"] != IGNORE_INDEX]
    assert tokenizer.decode(labelled).endswith("<|im_end|>")
    batch = SFTCollator({"collator_id": "sft", "pad_to_multiple_of": 64}, sft)([sft[0], sft[1]])
    assert batch["input_ids"].shape[1] % 64 == 0
