"""MiniMax-M3-VL's image format against transformers' real processor (golden outputs of
``MiniMaxM3VLImageProcessor`` with torchvision and of ``MiniMaxM3VLProcessor.replace_image_token``, written by
``fixtures/make_minimax_golden.py`` with torch 2.14.1, torchvision 0.29.1, transformers 5.24).

Shapes, grids and placeholder texts are compared exactly, and so are the pixel values: the format resizes
with the torch kernel torchvision runs for uint8 bicubic on the CPU (``interpolate(..., antialias=True)``)
and normalises with the processor's float32 operations. Measured: 0 difference on every case, also with
torch's scalar kernels (``ATEN_CPU_CAPABILITY=default``). PIL's own bicubic, for comparison, differs from
that kernel by 1 level of 255 on 0.2-0.7 % of the resized values of ordinary shrinks and enlargements
(1 level = 1 / (255 · std) ≈ 0.015 after normalisation), and by up to 7 levels (≈ 0.10) on 30 % of them
where one side shrinks 9 -> 8 while the other grows (case 150 x 9), which is why the format does not use it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mm_data_vlm.errors import EncodeError
from mm_data_vlm.formats import FORMATS, format_for
from mm_data_vlm.formats.minimax import IMAGE_TOKEN, VISION_END, VISION_START, MiniMaxM3VLFormat

GOLDEN = np.load(Path(__file__).parent / "fixtures" / "minimax_golden.npz")
META = json.loads(str(GOLDEN["meta"]))
CASES = list(enumerate(META["cases"]))  # the last image is RGBA (an alpha ramp): composited onto white


def settings(name: str) -> dict:
    return META["settings"][name]


def image(i: int) -> Image.Image:
    return Image.fromarray(GOLDEN[f"image_{i}"])


@pytest.mark.parametrize(("i", "case"), CASES, ids=[f"{c['settings']}-{c['size']}" for _, c in CASES])
def test_pixels_and_placeholder_match_the_processor(i, case):
    fmt = MiniMaxM3VLFormat(settings(case["settings"]), None, None)
    out = fmt.pixels([image(i)])
    assert out["pixel_values"].dtype == torch.float32 and out["image_grid_thw"].dtype == torch.long
    assert out["image_grid_thw"].tolist() == GOLDEN[f"image_grid_thw_{i}"].tolist()
    expected = torch.from_numpy(GOLDEN[f"pixel_values_{i}"])
    assert out["pixel_values"].shape == expected.shape
    torch.testing.assert_close(out["pixel_values"], expected, rtol=0, atol=0)
    text = fmt.placeholder(*case["size"])
    assert text == case["placeholder"]
    assert text.startswith(VISION_START) and text.endswith(VISION_END)
    assert text.count(IMAGE_TOKEN) == fmt.feature_rows(out)


def test_token_counts_under_the_default_settings():
    fmt = MiniMaxM3VLFormat(settings("default"), None, None)
    for (width, height), patches in zip(META["default_sizes"], META["default_patches"]):
        if patches < 0:  # the processor refuses aspect ratios over 200
            with pytest.raises(EncodeError, match="aspect ratio"):
                fmt.placeholder(width, height)
            continue
        assert fmt.placeholder(width, height).count(IMAGE_TOKEN) == patches // 4, (width, height)
    assert -1 in META["default_patches"]


def test_yaml_max_pixels_acts_as_the_processors_own():
    """``image_max_pixels: 512`` on the small settings gives what a processor built with max_pixels=512
    gives."""
    (i, case), *_ = [(i, c) for i, c in CASES if c["settings"] == "small_max_512"]
    fmt = MiniMaxM3VLFormat(settings("small"), None, 512)
    assert fmt.target_pixels == 512
    out = fmt.pixels([image(i)])
    torch.testing.assert_close(
        out["pixel_values"], torch.from_numpy(GOLDEN[f"pixel_values_{i}"]), rtol=0, atol=0
    )
    assert fmt.placeholder(*case["size"]) == case["placeholder"]


def test_images_of_a_sample_are_concatenated_in_order():
    fmt = MiniMaxM3VLFormat(settings("small"), None, None)
    order = [3, 0, 1]
    out = fmt.pixels([image(i) for i in order])
    expected = np.concatenate([GOLDEN[f"pixel_values_{i}"] for i in order])
    torch.testing.assert_close(out["pixel_values"], torch.from_numpy(expected), rtol=0, atol=0)
    assert out["image_grid_thw"].tolist() == [GOLDEN[f"image_grid_thw_{i}"][0].tolist() for i in order]
    empty = fmt.pixels([])
    assert empty["pixel_values"].shape == (0, 3 * 2 * 4 * 4) and empty["image_grid_thw"].shape == (0, 3)


def test_grey_and_palette_images_become_rgb():
    fmt = MiniMaxM3VLFormat(settings("small"), None, None)
    grey = image(1).convert("L")
    expected = fmt.pixels([grey.convert("RGB")])["pixel_values"]
    torch.testing.assert_close(fmt.pixels([grey])["pixel_values"], expected, rtol=0, atol=0)


def test_extreme_aspect_ratio_is_refused():
    fmt = MiniMaxM3VLFormat(settings("small"), None, None)
    with pytest.raises(EncodeError, match="aspect ratio 201.0 is over 200"):
        fmt.pixels([Image.new("RGB", (402, 2))])


def test_the_format_table_serves_minimax():
    assert FORMATS.get("MiniMaxM3VLImageProcessor") == "minimax:MiniMaxM3VLFormat"
    assert format_for({"image_processor_type": "MiniMaxM3VLImageProcessor"}) is MiniMaxM3VLFormat
    assert format_for({"image_processor_type": "MiniMaxM3VLImageProcessorFast"}) is MiniMaxM3VLFormat


def test_preprocessor_config_is_read_as_the_processor_reads_it():
    kind = {"image_processor_type": "MiniMaxM3VLImageProcessor"}
    default = MiniMaxM3VLFormat(kind, None, None)
    assert (default.min_pixels, default.max_pixels) == (3136, 451584)
    assert default.target_pixels == 451584 and "3,136 to 451,584 pixels" in default.describe()
    legacy = MiniMaxM3VLFormat({**kind, "size": [672, 672]}, None, None)  # a stale default of old checkpoints
    assert (legacy.min_pixels, legacy.max_pixels) == (3136, 451584)
    top = MiniMaxM3VLFormat({**kind, "min_pixels": 1000, "max_pixels": 9000}, None, None)
    assert (top.min_pixels, top.max_pixels) == (1000, 9000)
    yaml = MiniMaxM3VLFormat({**kind, "max_pixels": 9000}, 2000, 4000)
    assert (yaml.min_pixels, yaml.max_pixels) == (2000, 4000)
    assert not MiniMaxM3VLFormat.token_type_ids  # the forward does not read mm_token_type_ids


@pytest.mark.parametrize(
    ("config", "limits", "message"),
    [
        ({}, (0, None), "image_min_pixels: got 0"),
        ({}, (None, -5), "image_max_pixels: got -5"),
        ({}, (5000, 4000), "image_min_pixels: got 5,000, more than image_max_pixels 4,000"),
        ({"resample": 2}, (None, None), "resample: got 2"),
        ({"size": {"height": 5}}, (None, None), "size: {'height': 5} has no shortest_edge"),
        ({"size": {"shortest_edge": 5}}, (None, None), "has no longest_edge"),
        ({"size": [448, 448]}, (None, None), "size: got \\[448, 448\\]"),
    ],
)
def test_unusable_settings_are_refused(config, limits, message):
    """What the processor would refuse when resizing (a size without pixel bounds) is refused up front."""
    kind = {"image_processor_type": "MiniMaxM3VLImageProcessor", **config}
    with pytest.raises(ValueError, match=message):
        MiniMaxM3VLFormat(kind, *limits)
