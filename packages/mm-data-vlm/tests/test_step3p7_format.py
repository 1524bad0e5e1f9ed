"""The Step 3.7 image format against transformers' own processor (which needs torchvision, absent here): the
golden file ``fixtures/step3p7_golden.npz`` holds what ``Step3p7ImageProcessor`` + ``Step3p7Processor`` gave
for seven tiny images (made by ``fixtures/make_step3p7_golden.py``; global view 32², crops 16², ViT patch 4)
and the placeholder text for 21 image sizes under the default configuration (728², 504², longest side 3024).

Pixels: the format resizes with the ATen kernel torchvision calls (bilinear, antialiased, native ``uint8``
on AVX2/AVX-512/ARM CPUs), so on such a CPU (the golden file's, too) the values are identical: measured
maximum difference 0.0. Elsewhere torchvision and the format both resize in float32 and round, which
differs from the golden file's native path by up to 2 ``uint8`` levels (measured 0.0300 after
normalisation, on 14-18 % of the values); that is the tolerance there. (PIL's own bilinear resize would
differ by 1 level, 0.0150, on 4-6 % of the values.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mm_data_vlm.formats.step import DEFAULTS, IM_PATCH, Step3p7Format, _native_uint8, plan_crops

GOLDEN = np.load(Path(__file__).parent / "fixtures" / "step3p7_golden.npz")
TINY = json.loads(str(GOLDEN["tiny_config"]))
IMAGES = [Image.fromarray(GOLDEN[f"image_{i}"]) for i in range(len(GOLDEN["tiny_sizes"]))]
#: one uint8 level after normalisation, for the channel with the smallest std
LEVEL = 1 / (255 * min(DEFAULTS["image_std"]))


def tiny() -> Step3p7Format:
    return Step3p7Format({"image_processor_type": "Step3p7ImageProcessor", **TINY}, None, None)


def test_pixels_match_the_transformers_processor():
    out = tiny().pixels(IMAGES)
    assert set(out) == {"pixel_values", "pixel_values_local", "num_local_patches"}
    assert (
        out["num_local_patches"].tolist() == GOLDEN["num_local_patches"].tolist() == [0, 3, 12, 3, 16, 5, 12]
    )
    assert out["num_local_patches"].dtype == torch.long
    atol = 1e-6 if _native_uint8() else 2 * LEVEL + 1e-6
    for key in ("pixel_values", "pixel_values_local"):
        want = torch.from_numpy(GOLDEN[key])
        assert out[key].dtype == torch.float32
        assert out[key].shape == want.shape  # [7, 3, 32, 32] and [51, 3, 16, 16]
        torch.testing.assert_close(out[key], want, rtol=0, atol=atol)


def test_placeholder_text_matches_the_transformers_processor():
    fmt = tiny()
    for image, text in zip(IMAGES, GOLDEN["tiny_text"]):
        assert fmt.placeholder(*image.size) == str(text), image.size
    default = Step3p7Format({"image_processor_type": "Step3p7ImageProcessor"}, None, None)
    for (width, height), text in zip(GOLDEN["default_sizes"].tolist(), GOLDEN["default_text"]):
        assert default.placeholder(width, height) == str(text), (width, height)


def test_image_tokens_equal_vision_rows_image_by_image():
    """The dataset's contract: per image and per sample, the placeholder's image tokens equal the rows the
    vision tower gives for the pixel inputs (the crop count comes from the size alone)."""
    fmt = tiny()
    for image in IMAGES:
        pixels = fmt.pixels([image])
        assert fmt.placeholder(*image.size).count(IM_PATCH) == fmt.feature_rows(pixels)
        assert pixels["pixel_values_local"].shape[0] == fmt.plan(*image.size).crops
    total = sum(fmt.placeholder(*im.size).count(IM_PATCH) for im in IMAGES)
    assert fmt.feature_rows(fmt.pixels(IMAGES)) == total == 4 * 7 + 51


def test_a_sample_without_crops_concatenates_with_others():
    """Every key is present for every sample with images (crops: zero rows), so the collator's concatenation
    along dim 0 gives the forward's layout for the whole batch."""
    fmt = tiny()
    small, large = fmt.pixels([IMAGES[0]]), fmt.pixels([IMAGES[2]])
    assert small["pixel_values_local"].shape == (0, 3, 16, 16)
    batch = {k: torch.cat([small[k], large[k]]) for k in small}
    assert batch["num_local_patches"].tolist() == [0, 12]
    assert batch["pixel_values_local"].shape[0] == 12


def test_crop_plan_rules():
    # (width, height) -> (window, columns, rows) under the default configuration
    cases = {
        (728, 728): (0, 0, 0),  # fits the global view
        (700, 300): (
            300,
            3,
            1,
        ),  # fits but elongated: window = shorter side; 700 % 300 = 100 > 60: snapped up
        (1100, 600): (504, 2, 1),  # remainders 92 and 96 <= 20 % of 504: not snapped up
        (3000, 400): (400, 8, 1),  # ratio > 4: window = min(shorter side, 504)
        (2000, 30): (504, 4, 4),  # extreme aspect: squared to 2000 x 2000 first
    }
    for (w, h), want in cases.items():
        plan = plan_crops(w, h, 728, 504, 3024)
        assert (plan.window, plan.columns, plan.rows) == want, (w, h)
    assert plan_crops(2000, 30, 728, 504, 3024).square_pad


def test_unusable_settings_are_refused():
    with pytest.raises(ValueError, match="image_min_pixels/image_max_pixels"):
        Step3p7Format({}, None, 1024 * 1024)
    with pytest.raises(ValueError, match="patch_size: got 500"):
        Step3p7Format({"patch_size": 500}, None, None)
    with pytest.raises(ValueError, match="square"):
        Step3p7Format({"size": {"height": 728, "width": 504}}, None, None)
    assert Step3p7Format({}, None, None).target_pixels == 3024 * 3024
