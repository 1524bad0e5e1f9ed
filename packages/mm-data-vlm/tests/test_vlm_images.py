"""Images that used to kill or stall training: decompression bombs, oversize images, huge real images, and
dataset files that are not UTF-8. Each is a one-line DataError naming the file (or skipped and counted)."""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from mm_core.errors import ConfigError, DataError
from mm_data_vlm.images import DEFAULT_MAX_SOURCE_PIXELS, load_image, reduce_factor
from mm_data_vlm.processor_build import build_qwen_vl_processor
from mm_data_vlm.sft import VLMSFTDataset

TARGET = 56 * 112  # the test processor's max_pixels


def png_header(width: int, height: int) -> bytes:
    """A 45-byte PNG: signature, IHDR claiming ``width`` x ``height`` RGB (correct CRC), IEND; no pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def smooth_image(width: int, height: int) -> Image.Image:
    """A real RGB image (gradients, so PNG encodes it quickly and small)."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    rgb = np.stack([x + 0 * y, y + 0 * x, (x + y) / 2], axis=-1).astype(np.uint8)
    return Image.fromarray(rgb)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vlm_images")
    (root / "img").mkdir()
    smooth_image(56, 56).save(root / "img" / "ok.png")
    (root / "img" / "bomb.png").write_bytes(png_header(30000, 30000))
    (root / "img" / "big_header.png").write_bytes(png_header(10000, 10000))  # 1e8 px: over the default limit
    big = smooth_image(4000, 4000)
    big.save(root / "img" / "big.jpg", quality=90)
    big.save(root / "img" / "big.png", compress_level=1)
    build_qwen_vl_processor(["Which? yes no 7"] * 20, root / "proc", max_pixels=TARGET)
    return root


def record(image: str) -> dict:
    return {
        "messages": [{"role": "user", "content": "<image>Which?"}, {"role": "assistant", "content": "7"}],
        "images": [image],
    }


def dataset(root: Path, images: list[str], on_error: str = "raise", **pre) -> VLMSFTDataset:
    (root / "d.json").write_text(json.dumps([record(i) for i in images]), encoding="utf-8")
    return VLMSFTDataset(
        {"dataset_dir": str(root), "dataset": "d.json", "cutoff_len": 4096},
        {"model_name_or_path": str(root / "proc"), **pre},
        SimpleNamespace(on_error=on_error),
    )


def test_the_crafted_header_is_45_bytes(root: Path) -> None:
    data = (root / "img" / "bomb.png").read_bytes()
    assert len(data) == 45
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(root / "img" / "big_header.png") as im:  # a valid header: Pillow reads its size
            assert im.size == (10000, 10000)


# ---------------------------------------------------------------------------------------- bombs and limits
@pytest.mark.parametrize("image", ["bomb.png", "big_header.png"])
def test_bomb_is_one_line_data_error_naming_the_file(root: Path, image: str) -> None:
    ds = dataset(root, [f"img/{image}", "img/ok.png"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with pytest.raises(DataError) as info:
            ds[0]
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{root / 'd.json'}[0]: image {root / 'img' / image} "), msg
    assert "before decoding" in msg, msg


def test_bomb_is_skipped_and_counted_under_on_error_skip(root: Path) -> None:
    ds = dataset(root, ["img/bomb.png", "img/big_header.png", "img/ok.png"], on_error="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        sample = ds[0]
    assert sample["skipped_samples"] == 2 and sample["sample_id"] == 2
    assert len(ds.skipped) == 2
    assert "bomb.png" in ds.skipped[0] and "big_header.png" in ds.skipped[1]
    assert "image_max_source_pixels = 89,478,485" in ds.skipped[1]


def test_pillow_warning_turned_error_is_also_a_data_error(root: Path) -> None:
    # under ``-W error`` Pillow's DecompressionBombWarning is raised; it must not bypass on_error
    ds = dataset(root, ["img/big_header.png", "img/ok.png"], on_error="skip", image_max_source_pixels=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        sample = ds[0]
    assert sample["skipped_samples"] == 1
    assert "decompression-bomb" in ds.skipped[0]


def test_limit_is_configurable_and_checked_from_the_header(root: Path) -> None:
    ds = dataset(root, ["img/ok.png"], image_max_source_pixels=56 * 56 - 1)
    with pytest.raises(DataError, match=r"is 56x56 = 3,136 pixels \(read from its header\), over .*= 3,135"):
        ds[0]
    assert dataset(root, ["img/ok.png"], image_max_source_pixels=56 * 56)[0]["image_grid_thw"].tolist() == [
        [1, 4, 4]
    ]
    assert Image.MAX_IMAGE_PIXELS == DEFAULT_MAX_SOURCE_PIXELS, "Pillow's global limit must not change"


@pytest.mark.parametrize("bad", [0, -5, "big", 1.5, True])
def test_bad_limit_is_a_config_error(root: Path, bad) -> None:
    with pytest.raises(ConfigError, match=r"preprocess_parameters\.image_max_source_pixels: got"):
        dataset(root, ["img/ok.png"], image_max_source_pixels=bad)


# ---------------------------------------------------------------------------------------- reduced decoding
def test_reduce_factor_keeps_twice_the_target_size() -> None:
    assert reduce_factor(4000 * 4000, TARGET) == 25
    assert reduce_factor(500 * 500, TARGET) == 3
    assert reduce_factor(56 * 56, TARGET) == 1
    assert reduce_factor(9400 * 9400, 1003520) == 4  # the image at Qwen-VL's usual max_pixels
    assert reduce_factor(4000 * 4000, None) == 1


def test_big_jpeg_is_decoded_at_reduced_size_by_the_decoder(root: Path) -> None:
    im = load_image(root / "img" / "big.jpg", target_pixels=TARGET)
    # 1/8 scale straight from the JPEG decoder (500 x 500), then reduce(3): 167. A full decode followed by
    # reduce(25) would give 160, so this size proves the draft path was taken.
    assert im.size == (167, 167) and im.mode == "RGB"
    assert min(im.size) >= 2 * int(TARGET**0.5)  # still twice the target's side for the processor's resize


def test_big_png_is_reduced_before_the_processor(root: Path) -> None:
    im = load_image(root / "img" / "big.png", target_pixels=TARGET)
    assert im.size == (160, 160) and im.mode == "RGB"


@pytest.mark.parametrize("image", ["big.jpg", "big.png"])
def test_reduced_image_gives_the_same_grid_and_similar_pixels(root: Path, image: str) -> None:
    ds = dataset(root, [f"img/{image}"])
    sample = ds[0]
    with Image.open(root / "img" / image) as src:
        full = ds.processor.images([src.convert("RGB")])
    assert sample["image_grid_thw"].tolist() == full["image_grid_thw"].tolist() == [[1, 4, 4]]
    diff = (sample["pixel_values"] - full["pixel_values"]).abs().mean().item()
    assert diff < 0.02, diff  # values are normalised to [-1, 1]; a smooth image barely changes


def test_small_images_are_not_reduced(root: Path) -> None:
    im = load_image(root / "img" / "ok.png", target_pixels=TARGET)
    assert im.size == (56, 56)
    assert load_image(root / "img" / "big.png", target_pixels=None).size == (4000, 4000)


def test_palette_and_alpha_images_come_back_rgb(root: Path, tmp_path: Path) -> None:
    smooth_image(900, 900).convert("P").save(tmp_path / "p.png")
    smooth_image(900, 900).convert("RGBA").save(tmp_path / "rgba.png")
    for name in ("p.png", "rgba.png"):
        im = load_image(tmp_path / name, target_pixels=TARGET)
        assert im.mode == "RGB" and im.size == (180, 180), (name, im.size)


# ---------------------------------------------------------------------------------------- dataset encoding
@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_non_utf8_dataset_names_the_file_line_and_byte_offset(
    root: Path, tmp_path: Path, suffix: str
) -> None:
    good = json.dumps(record("img/ok.png"))
    bad = json.dumps({**record("img/ok.png"), "note": "caf\u00e9"}, ensure_ascii=False).encode("latin-1")
    if suffix == ".jsonl":
        data = good.encode() + b"\n" + bad + b"\n"
        line = 2
    else:
        data = b"[\n" + good.encode() + b",\n" + bad + b"\n]\n"
        line = 3
    offset = data.index(b"\xe9")
    path = tmp_path / f"d{suffix}"
    path.write_bytes(data)
    with pytest.raises(DataError) as info:
        VLMSFTDataset(
            {"dataset_dir": str(root), "dataset": str(path)},
            {"model_name_or_path": str(root / "proc")},
            SimpleNamespace(on_error="raise"),
        )
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}:{line}: not valid UTF-8 at byte offset {offset} "), msg


# ---------------------------------------------------------------------------------------- local files only
def test_processor_that_is_not_a_local_folder_is_one_line(root: Path, tmp_path: Path) -> None:
    import time

    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        VLMSFTDataset(
            {"dataset_dir": str(root), "dataset": "d.json"},
            {"model_name_or_path": "Qwen/Qwen3-VL-2B-Instruct"},
            SimpleNamespace(on_error="raise"),
        )
    assert time.monotonic() - start < 5
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(
        "data.dataset_param.preprocess_parameters.model_name_or_path: 'Qwen/Qwen3-VL-2B-Instruct' is not a "
        "local folder"
    ), msg


# ------------------------------------------------------------------------------------ preflight (mm check)
def _preflight(root: Path, images: list[str], on_error: str = "raise") -> list[str]:
    (root / "d.json").write_text(json.dumps([record(i) for i in images]), encoding="utf-8")
    return VLMSFTDataset.preflight(
        {"dataset_dir": str(root), "dataset": "d.json", "cutoff_len": 4096},
        {"model_name_or_path": str(root / "proc")},
        SimpleNamespace(on_error=on_error),
    )


def test_preflight_encodes_the_first_record(root: Path) -> None:
    head, first = _preflight(root, ["img/big.jpg", "img/absent.png"])  # only the first record is read
    expected_head = f"1 file(s), 0.0 MiB ({root / 'd.json'}); processor {root / 'proc'}: qwen-vl images ("
    assert head.startswith(expected_head), head
    assert "at most 6,272 pixels), sources over 89,478,485 refused" in head, head
    expected = len(dataset(root, ["img/big.jpg"])[0]["input_ids"])
    assert first == f"first record: {expected:,} tokens, 1 image(s) (cutoff_len 4096)"


def test_preflight_refuses_a_bad_first_record_unless_skipping(root: Path) -> None:
    with pytest.raises(DataError, match=r"d\.json\[0\]: image .*absent\.png does not exist"):
        _preflight(root, ["img/absent.png", "img/ok.png"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with pytest.raises(DataError, match=r"d\.json\[0\]: image .*big_header\.png is 10000x10000"):
            _preflight(root, ["img/big_header.png"])
        _, first = _preflight(root, ["img/big_header.png"], on_error="skip")
    assert first.startswith("first record would be skipped (on_error: skip): "), first
