"""vlm_sft + qwen3vl: image tokens match the grids, labels only on replies, bad images named or skipped."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from mm_core.errors import DataError
from mm_data_vlm.collators import Qwen3VLCollator
from mm_data_vlm.processor_build import build_qwen_vl_processor
from mm_data_vlm.sft import VLMSFTDataset


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    (root / "img").mkdir()
    for name, (w, h) in {"a": (56, 56), "b": (112, 56)}.items():
        Image.fromarray(np.full((h, w, 3), 128, np.uint8)).save(root / "img" / f"{name}.png")
    (root / "img" / "bad.png").write_bytes(b"not a png")
    recs = [
        {
            "messages": [{"role": "user", "content": "<image>Which?"}, {"role": "assistant", "content": "7"}],
            "images": ["img/a.png"],
        },
        {
            "conversations": [
                {"from": "human", "value": "<image><image>Both?"},
                {"from": "gpt", "value": "yes"},
            ],
            "images": ["img/a.png", "img/b.png"],
        },
        {
            "messages": [{"role": "user", "content": "<image>Bad?"}, {"role": "assistant", "content": "no"}],
            "images": ["img/bad.png"],
        },
    ]
    (root / "d.json").write_text(json.dumps(recs))
    build_qwen_vl_processor(["Which? Both? yes no 7"] * 20, root / "proc", max_pixels=56 * 112)
    return root


def make(root, on_error="raise"):
    return VLMSFTDataset(
        {"dataset_dir": str(root), "dataset": "d.json"},
        {"model_name_or_path": str(root / "proc")},
        SimpleNamespace(on_error=on_error),
    )


def test_image_tokens_labels_and_collate(root):
    ds = make(root)
    s0, s1 = ds[0], ds[1]
    assert int((s0["input_ids"] == ds.image_token_id).sum()) == int(s0["image_grid_thw"].prod()) // 4
    assert s1["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8]]
    assert s1["pixel_values"].shape[0] == 16 + 32
    text = ds.processor.tokenizer.decode([t for t in s0["labels"].tolist() if t != -100])
    assert text == "7<|im_end|>"
    batch = Qwen3VLCollator({"collator_id": "qwen3vl"}, ds)([s0, s1])
    assert batch["image_grid_thw"].shape == (3, 3) and batch["pixel_values"].shape[0] == 16 + 16 + 32
    assert int(batch["mm_token_type_ids"].sum()) == 4 + 4 + 8 and batch["skipped_samples"] == 0


def test_corrupt_image_is_named_or_skipped(root):
    with pytest.raises(DataError, match=r"d\.json\[2\].*bad\.png"):
        make(root)[2]
    sample = make(root, "skip")[2]
    assert sample["skipped_samples"] == 1 and sample["sample_id"] == 0
