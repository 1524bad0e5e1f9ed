"""The image-format table: a processor folder picks its family's format by ``image_processor_type``, an
unknown type is a ConfigError naming the key and the known types, a tokenizer without the format's tokens
is refused; the collator batches any family's pixel inputs (concatenated in sample order) and per-token
fields."""

from __future__ import annotations

import json

import pytest
import torch

from mm_core.data.bpe import write_bytelevel_bpe
from mm_core.errors import ConfigError
from mm_data_vlm.collators import VLMCollator
from mm_data_vlm.encode import VisionProcessor
from mm_data_vlm.formats import FORMATS, format_for
from mm_data_vlm.formats.qwen import QwenVLFormat
from mm_data_vlm.processor_build import build_qwen_vl_processor

KEY = "data.dataset_param.preprocess_parameters"


def test_format_is_chosen_by_image_processor_type_with_or_without_backend_suffix():
    for kind in ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil", "Qwen2VLImageProcessorFast"):
        assert format_for({"image_processor_type": kind}) is QwenVLFormat
    for kind, target in FORMATS.items():  # every entry imports and serves its type
        assert format_for({"image_processor_type": kind}).__name__ == target.split(":")[1]


def test_unknown_processor_type_names_the_key_and_the_known_types(tmp_path):
    build_qwen_vl_processor(["a b c"] * 10, tmp_path)
    config = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**config, "image_processor_type": "Blip"}))
    with pytest.raises(ConfigError, match=rf"{KEY}.model_name_or_path: .*'Blip' is not one .*Qwen2VL"):
        VisionProcessor.load(str(tmp_path), None, None, KEY)


def test_tokenizer_without_the_formats_tokens_is_refused(tmp_path):
    build_qwen_vl_processor(["a b c"] * 10, tmp_path)
    config = (tmp_path / "preprocessor_config.json").read_text()
    plain = tmp_path / "plain"
    write_bytelevel_bpe(
        ["a b c"] * 10, 300, plain, special_tokens=("<|endoftext|>",), chat_template="{{ '' }}"
    )
    (plain / "preprocessor_config.json").write_text(config)
    with pytest.raises(ConfigError, match=r"lacks the qwen-vl image tokens <\|vision_start\|>"):
        VisionProcessor.load(str(plain), None, None, KEY)


def test_collator_concatenates_any_pixel_inputs_in_sample_order():
    def sample(n: int, patches: int, crops: int) -> dict:
        out = {"input_ids": torch.arange(n), "labels": torch.arange(n), "sample_id": n}
        if patches:
            out["pixel_values"] = torch.full((patches, 3, 2, 2), float(n))  # a 4-D layout (Kimi K2.5)
            out["image_grid_thw"] = torch.tensor([[1, 1, patches]])
        if crops:
            out["patch_pixel_values"] = torch.full((crops, 3, 4, 4), float(n))
        return out

    batch = VLMCollator({"collator_id": "vlm"})([sample(3, 2, 0), sample(5, 0, 0), sample(4, 1, 2)])
    assert "mm_token_type_ids" not in batch  # the samples carry none
    assert batch["input_ids"].shape == (3, 5) and batch["attention_mask"].sum().item() == 12
    assert batch["labels"][0, 3:].tolist() == [-100, -100]
    assert batch["pixel_values"][:, 0, 0, 0].tolist() == [3.0, 3.0, 4.0]
    assert batch["image_grid_thw"].tolist() == [[1, 1, 2], [1, 1, 1]]
    assert batch["patch_pixel_values"].shape == (2, 3, 4, 4)
    assert batch["sample_id"].tolist() == [3, 5, 4]
