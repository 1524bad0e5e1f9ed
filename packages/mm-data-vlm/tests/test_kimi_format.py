"""Kimi K2.5's image format against transformers' real processor (golden outputs of ``Kimi_K25ImageProcessor``
with torchvision and of ``Kimi_K25Processor``, written by ``fixtures/make_kimi_golden.py``).

Pixels are compared exactly: the format resizes with the same torch kernel torchvision runs for uint8 bicubic
on the CPU (``interpolate(..., antialias=True)``) and normalises with the same float32 operations, so any
difference is a change of rule, not rounding. (PIL's own bicubic differs from that kernel by at most 1 of 255
on about 1 % of the resized values: 2/255 ≈ 0.0078 after normalisation.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mm_data_vlm.formats.kimi import IMAGE_PREFIX, MEDIA_END, MEDIA_PAD, KimiK25Format

GOLDEN = np.load(Path(__file__).parent / "fixtures" / "kimi_golden.npz")
META = json.loads(str(GOLDEN["meta"]))
SIZES = [tuple(s) for s in META["sizes"]]
SMALL = {"image_processor_type": "Kimi_K25ImageProcessor", **META["small"]}


def small_format(**kwargs: int | None) -> KimiK25Format:
    return KimiK25Format(SMALL, kwargs.get("min_pixels"), kwargs.get("max_pixels"))


def image(i: int) -> Image.Image:
    return Image.fromarray(GOLDEN[f"image_{i}"])


@pytest.mark.parametrize("i", range(len(SIZES)))
def test_pixels_match_the_reference_processor(i):
    fmt = small_format()
    assert image(i).size == SIZES[i]
    out = fmt.pixels([image(i)])
    assert out["image_grid_thw"].dtype == torch.long
    assert out["image_grid_thw"].tolist() == GOLDEN[f"grid_{i}"].tolist()
    ref = torch.from_numpy(GOLDEN[f"pixel_values_{i}"])
    assert out["pixel_values"].dtype == torch.float32
    torch.testing.assert_close(out["pixel_values"], ref, rtol=0, atol=0)


def test_several_images_concatenate_in_order():
    fmt = small_format()
    out = fmt.pixels([image(i) for i in range(len(SIZES))])
    ref = np.concatenate([GOLDEN[f"pixel_values_{i}"] for i in range(len(SIZES))])
    torch.testing.assert_close(out["pixel_values"], torch.from_numpy(ref), rtol=0, atol=0)
    grids = np.concatenate([GOLDEN[f"grid_{i}"] for i in range(len(SIZES))])
    assert out["image_grid_thw"].tolist() == grids.tolist()
    assert fmt.feature_rows(out) == int(GOLDEN["small_tokens"].sum())


def test_placeholder_matches_the_processor_token_counts():
    fmt = small_format()
    for i, (w, h) in enumerate(SIZES):
        text = fmt.placeholder(w, h)
        pads = int(GOLDEN[f"pads_{i}"])  # what Kimi_K25Processor.replace_image_token wrote for the real grid
        assert pads == int(GOLDEN["small_tokens"][i])  # == _get_num_multimodal_tokens of the size
        assert text == IMAGE_PREFIX + MEDIA_PAD * pads + MEDIA_END
        assert fmt.feature_rows(fmt.pixels([image(i)])) == text.count(fmt.image_token)


def test_default_settings_token_counts():
    fmt = KimiK25Format({"image_processor_type": "Kimi_K25ImageProcessor"}, None, None)
    for (w, h), tokens in zip(GOLDEN["default_sizes"].tolist(), GOLDEN["default_tokens"].tolist()):
        assert fmt.placeholder(w, h).count(MEDIA_PAD) == tokens, (w, h)
    assert fmt.target_pixels == 16384 * 14 * 14


def test_special_tokens_and_inputs():
    assert KimiK25Format.image_token == "<|media_pad|>"
    assert set(KimiK25Format.special_tokens) == {
        "<|media_begin|>",
        "<|media_content|>",
        "<|media_pad|>",
        "<|media_end|>",
    }
    assert KimiK25Format.token_type_ids is False
    assert KimiK25Format.processor_types == ("Kimi_K25ImageProcessor",)


def test_max_pixels_sets_the_patch_budget_and_min_pixels_is_refused():
    fmt = small_format(max_pixels=12 * 16)  # 12 patches of 4x4
    assert fmt.max_patches == 12 and fmt.target_pixels == 12 * 16
    out = fmt.pixels([image(2)])  # 64x48: 16 x 12 patches -> scaled by 1/4 to 16x12 pixels
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert fmt.placeholder(64, 48).count(MEDIA_PAD) == 4
    with pytest.raises(ValueError, match="image_min_pixels"):
        small_format(min_pixels=100)
    with pytest.raises(ValueError, match="image_max_pixels"):
        small_format(max_pixels=15)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"size": {"max_height": 8, "max_width": 4}}, "size"),
        ({"patch_size": 0}, "patch_size"),
        ({"do_resize": False}, "do_resize"),
        ({"resample": 2}, "resample"),
        ({"image_mean": [0.5, 0.5]}, "image_mean"),
    ],
)
def test_unusable_processor_settings_are_refused(override, key):
    with pytest.raises(ValueError, match=key):
        KimiK25Format({**SMALL, **override}, None, None)


def test_non_rgb_images_are_converted():
    fmt = small_format()
    grey = Image.fromarray(GOLDEN["image_0"][..., 0])
    out = fmt.pixels([grey])
    rgb = fmt.pixels([grey.convert("RGB")])
    torch.testing.assert_close(out["pixel_values"], rgb["pixel_values"], rtol=0, atol=0)
