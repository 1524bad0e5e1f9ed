"""vlm_sft's record index: built once and only mapped afterwards; token counts prepared without decoding
images and equal to what training encodes; .json and .jsonl read alike; stale files named; changed images
caught; refused records decided without opening their images."""

from __future__ import annotations

import json
import logging
import pickle
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mm_core.errors import DataError
from mm_data_vlm import index as index_module
from mm_data_vlm import sft as sft_module
from mm_data_vlm.images import load_image, loaded_size
from mm_data_vlm.processor_build import build_qwen_vl_processor
from mm_data_vlm.records import iter_records, read_record
from mm_data_vlm.sft import VLMSFTDataset

MIN_PIXELS, MAX_PIXELS = 28 * 28, 112 * 112  # the sizes below give grids from 2x2 to 8x8 patches

# name: (width, height, format); big ones are decoded at a reduced size (JPEG draft, PNG reduce)
IMAGES = {
    "s28.png": (28, 28, "PNG"),
    "s56x84.png": (56, 84, "PNG"),
    "s112.png": (112, 112, "PNG"),
    "odd.png": (30, 200, "PNG"),
    "pal.png": (300, 300, "P"),
    "big.jpg": (1000, 800, "JPEG"),
    "big.png": (1201, 899, "PNG"),
    "thin.png": (2, 500, "PNG"),  # aspect ratio over 200: Qwen-VL's resize refuses it
}


def _image(width: int, height: int, seed: int) -> Image.Image:
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    rgb = np.stack([x + 0 * y, y + 0 * x, (x * seed + y) % 256], axis=-1).astype(np.uint8)
    return Image.fromarray(rgb)


def _save(path: Path, width: int, height: int, kind: str, seed: int = 1) -> None:
    im = _image(width, height, seed)
    if kind == "P":
        im.convert("P").save(path)
    else:
        im.save(path, format=kind)


def rec(
    images: list[str], question: str = "What is shown?", answer: str = "a cat", sharegpt: bool = False
) -> dict:
    text = "<image>" * len(images) + question
    if sharegpt:
        turns = [{"from": "human", "value": text}, {"from": "gpt", "value": answer}]
        return {"conversations": turns, "images": images}
    return {
        "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": answer}],
        "images": images,
    }


def mixed_records() -> list[dict]:
    names = [n for n in IMAGES if n != "thin.png"]
    out = []
    for i, name in enumerate(names):
        out.append(rec([name], question=f"What is in picture {i}?", answer=f"label {i}", sharegpt=i % 2 == 1))
    out.append(rec(["s28.png", "big.jpg"], question="Both?", answer="yes"))
    out.append(rec([], question="No picture at all?", answer="none"))
    two_turns = rec(["s56x84.png"], question="First?", answer="one")
    two_turns["messages"] += [
        {"role": "user", "content": "<image>Second?"},
        {"role": "assistant", "content": "two"},
    ]
    two_turns["images"].append("big.png")
    out.append(two_turns)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vlm_index")
    for name, (w, h, kind) in IMAGES.items():
        _save(root / name, w, h, kind)
    words = "What is shown in picture Both yes no none First Second one two label a cat 0 1 2 3 4 5 6 7 8 9"
    build_qwen_vl_processor([words] * 20, root / "proc", min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return root


def write_jsonl(path: Path, records: list[Any], blank_every: int = 0) -> None:
    lines = []
    for i, r in enumerate(records):
        lines.append(json.dumps(r))
        if blank_every and i % blank_every == 0:
            lines.append("   ")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def make(
    root: Path, dataset: str | list[str], on_error: str = "raise", basic: dict | None = None, **pre: Any
) -> VLMSFTDataset:
    return VLMSFTDataset(
        {"dataset_dir": str(root), "dataset": dataset, "cutoff_len": 512, **(basic or {})},
        {"model_name_or_path": str(root / "proc"), **pre},
        SimpleNamespace(on_error=on_error),
    )


def reference(ds: VLMSFTDataset, path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Each record of ``path`` encoded directly (no index): ``(where, sample)``."""
    out = []
    for where, obj in iter_records(path):
        messages, images = read_record(obj, ds.dataset_dir)
        target = ds.processor.target_pixels
        loaded = [load_image(p, target_pixels=target) for p in images]
        pixels = ds.processor.images(loaded) if images else {}
        ids, labels = ds.processor.encode_sizes(messages, [im.size for im in loaded])
        out.append((where, {"input_ids": ids, "labels": labels, **pixels}))
    return out


# ------------------------------------------------------------------------------------------ lengths
def test_loaded_size_is_the_size_load_image_returns(root: Path) -> None:
    target = MAX_PIXELS
    for name in IMAGES:
        assert (
            loaded_size(root / name, target_pixels=target)
            == load_image(root / name, target_pixels=target).size
        )
    assert loaded_size(root / "big.jpg", target_pixels=target) == (500, 400)  # JPEG draft at 1/2
    assert loaded_size(root / "big.png", target_pixels=target) == (301, 225)  # reduce(4), rounded up


def test_prepared_lengths_equal_encoded_lengths_for_mixed_sizes(root: Path) -> None:
    write_jsonl(root / "mixed.jsonl", mixed_records())
    ds = make(root, "mixed.jsonl")
    lengths = ds.sample_lengths()
    samples = [ds[i] for i in range(len(ds))]
    assert lengths.tolist() == [len(s["input_ids"]) for s in samples]
    grids = {tuple(g) for s in samples for g in s.get("image_grid_thw", torch_empty()).tolist()}
    assert len(grids) >= 5, grids  # the sizes really give different grids
    assert lengths.dtype == np.int64 and len(set(lengths.tolist())) >= 5


def torch_empty() -> Any:
    import torch

    return torch.zeros((0, 3), dtype=torch.long)


# -------------------------------------------------------------------------------- .json and .jsonl alike
@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_samples_are_those_of_encoding_the_records_directly(
    root: Path, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = mixed_records()
    path = root / f"same{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(records, indent=1), encoding="utf-8")
    else:
        write_jsonl(path, records, blank_every=3)  # blank lines are no records but count as lines
    monkeypatch.setattr(index_module, "UNIT_BYTES", 200)  # several work units per file
    ds = make(root, path.name, basic={"preprocessing_num_workers": 1})
    assert ds.prepared.payload["units"] > 3
    expected = reference(ds, path)
    assert len(ds) == len(expected) == len(records)
    for i, (where, ref) in enumerate(expected):
        assert ds.index.where(i) == where
        sample = ds[i]
        for key in ("input_ids", "labels"):
            assert sample[key].tolist() == ref[key], (where, key)
        if "pixel_values" in ref:
            assert sample["image_grid_thw"].tolist() == ref["image_grid_thw"].tolist()
            assert bool((sample["pixel_values"] == ref["pixel_values"]).all())
        else:
            assert "pixel_values" not in sample


@pytest.mark.slow  # two spawned preparation processes, each importing torch and transformers
def test_parallel_preparation_gives_the_same_index(root: Path, tmp_path: Path, monkeypatch) -> None:
    write_jsonl(root / "par.jsonl", mixed_records() * 4, blank_every=5)
    (root / "par.json").write_text(json.dumps(mixed_records()), encoding="utf-8")
    monkeypatch.setattr(index_module, "UNIT_BYTES", 1000)
    one = make(
        root,
        ["par.jsonl", "par.json"],
        basic={"cache_dir": str(tmp_path / "a"), "preprocessing_num_workers": 1},
    )
    two = make(
        root,
        ["par.jsonl", "par.json"],
        basic={"cache_dir": str(tmp_path / "b"), "preprocessing_num_workers": 2},
    )
    assert two.built and two.prepared.payload["units"] > 2
    for name in index_module.COLUMNS:
        assert one.index.column(name).tolist() == two.index.column(name).tolist(), name
    assert [two.index.where(i) for i in range(len(two))] == [one.index.where(i) for i in range(len(one))]
    assert two.source_sizes == [len(mixed_records()) * 4, len(mixed_records())]


# ------------------------------------------------------------------------- construction only maps the index
def test_construction_maps_the_index_without_parsing_records(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 5_000
    images = ["s28.png", "s56x84.png", "s112.png", "odd.png"]
    with open(tmp_path / "many.jsonl", "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps(rec([images[i % 4]], question="What is shown?", answer=str(i % 10))))
            f.write("\n")
    basic = {"dataset_dir": str(root), "dataset": str(tmp_path / "many.jsonl"), "cutoff_len": 512}
    pre = {"model_name_or_path": str(root / "proc")}
    start = time.perf_counter()
    first = VLMSFTDataset(basic, pre, SimpleNamespace(on_error="raise"))
    build_s = time.perf_counter() - start
    assert first.built and len(first) == n

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a record was parsed or indexed while only mapping the index")

    monkeypatch.setattr(sft_module, "build_index", never)
    monkeypatch.setattr(sft_module, "parse_record", never)
    monkeypatch.setattr(sft_module, "read_media", never)
    start = time.perf_counter()
    again = VLMSFTDataset(basic, pre, SimpleNamespace(on_error="raise"))
    reopen_s = time.perf_counter() - start
    assert not again.built and len(again) == n
    assert isinstance(again.index.column("offset"), np.memmap)
    assert not any(isinstance(v, list) and len(v) >= n for v in vars(again).values())
    lengths = again.sample_lengths()
    assert len(set(lengths.tolist())) == 4  # four image sizes, four lengths (answers are one token)
    print(f"\n{n:,} records: indexed in {build_s:.2f} s, constructed again in {reopen_s * 1000:.0f} ms")
    assert reopen_s < build_s / 5


# --------------------------------------------------------------------------------------- stale sources
def test_stale_file_is_named_and_rebuilt(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = root / "stale.jsonl"
    write_jsonl(path, mixed_records()[:3])
    assert make(root, "stale.jsonl").built
    write_jsonl(path, mixed_records()[:4])
    with caplog.at_level(logging.WARNING, logger="mm_core.data.cache"):
        ds = make(root, "stale.jsonl")
    assert ds.built and len(ds) == 4
    assert f"{path.resolve()}: size changed" in caplog.text


def test_cache_stale_error_names_the_file(root: Path) -> None:
    path = root / "stale_error.jsonl"
    write_jsonl(path, mixed_records()[:3])
    make(root, "stale_error.jsonl")
    write_jsonl(path, mixed_records()[:2])
    with pytest.raises(DataError, match=rf"{path.resolve()}: size changed .*cache_stale: rebuild"):
        make(root, "stale_error.jsonl", basic={"cache_stale": "error"})


def test_changed_settings_prepare_a_new_index(root: Path) -> None:
    write_jsonl(root / "settings.jsonl", mixed_records()[:3])
    small = make(root, "settings.jsonl", image_max_pixels=56 * 56)
    large = make(root, "settings.jsonl")
    assert large.built and small.prepared.path != large.prepared.path
    assert small.sample_lengths().tolist() != large.sample_lengths().tolist()
    assert make(root, "settings.jsonl", basic={"cutoff_len": 64}).built is False  # decided when mapping


# ----------------------------------------------------------------------------- images at training time
def test_image_changed_after_preparation_is_a_clear_error(root: Path, tmp_path: Path) -> None:
    _save(tmp_path / "changing.png", 56, 56, "PNG")
    write_jsonl(root / "changing.jsonl", [rec([str(tmp_path / "changing.png")]), rec(["s28.png"])])
    ds = make(root, "changing.jsonl")
    assert len(ds[0]["input_ids"]) == ds.sample_lengths()[0]
    _save(tmp_path / "changing.png", 112, 112, "PNG")  # not a source: the cache stays current
    ds = make(root, "changing.jsonl")
    assert not ds.built
    with pytest.raises(DataError) as info:
        ds[0]
    msg = str(info.value)
    assert msg.startswith(f"{root / 'changing.jsonl'}:1: "), msg
    assert "an image changed since preparation" in msg and "changing.png" in msg and "--overwrite" in msg, msg
    assert make(root, "changing.jsonl", "skip")[0]["skipped_samples"] == 1


def test_no_image_is_opened_for_an_over_long_record(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path / "long.png", 112, 112, "PNG")  # 16 image tokens
    records = [rec([str(tmp_path / "long.png")]), rec([], question="Short?", answer="yes")]
    write_jsonl(root / "long.jsonl", records)
    probe = make(root, "long.jsonl", basic={"cutoff_len": 4096})
    long_len, short_len = probe.sample_lengths().tolist()
    assert long_len > short_len + 16
    (tmp_path / "long.png").unlink()  # a decode would fail with "cannot read image"

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an image was opened for a record that is refused")

    monkeypatch.setattr(sft_module, "load_image", never)
    cutoff = {"cutoff_len": long_len - 1}
    with pytest.raises(
        DataError, match=rf"long\.jsonl:1: {long_len} tokens .* exceed .*cutoff_len = {long_len - 1}"
    ):
        make(root, "long.jsonl", basic=cutoff)[0]
    ds = make(root, "long.jsonl", "skip", basic=cutoff)
    assert ds.sample_lengths().tolist() == [short_len, short_len]  # replaced by the next record
    sample = ds[0]
    assert sample["skipped_samples"] == 1 and sample["sample_id"] == 1 and "cutoff_len" in ds.skipped[0]


# ------------------------------------------------------------------------------------ records refused
def test_invalid_records_are_named_at_preparation_or_skipped(root: Path) -> None:
    path = root / "invalid.jsonl"
    lines = [json.dumps(rec(["s28.png"])), "", "{not json", json.dumps({"messages": []}), json.dumps(rec([]))]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{path}:3: not valid JSON"):
        make(root, "invalid.jsonl")
    ds = make(root, "invalid.jsonl", "skip")
    assert ds.prepared.payload["status"] == {"ok": 2, "invalid": 2}
    assert [ds.index.where(i) for i in range(len(ds))] == [f"{path}:{k}" for k in (1, 3, 4, 5)]
    sample = ds[1]
    assert sample["sample_id"] == 3 and sample["skipped_samples"] == 2
    assert ds.skipped == [
        f"{path}:3: not valid JSON (Expecting property name enclosed in double quotes)",
        f"{path}:4: the conversation must be a non-empty list of turns",
    ]
    assert ds.sample_lengths().tolist()[1:3] == [ds.sample_lengths()[3]] * 2


def test_missing_and_refused_images(root: Path) -> None:
    records = [rec(["absent.png"]), rec(["thin.png"]), rec(["s28.png"])]
    (root / "missing.json").write_text(json.dumps(records), encoding="utf-8")
    with pytest.raises(DataError, match=r"missing\.json\[0\]: image .*absent\.png does not exist"):
        make(root, "missing.json")
    ds = make(root, "missing.json", "skip")
    assert ds.prepared.payload["status"] == {"ok": 1, "missing image": 1, "refused": 1}
    assert ds[0]["sample_id"] == 2
    assert "absent.png does not exist" in ds.skipped[0]
    assert ds.skipped[1].startswith(f"{root / 'missing.json'}[1]: the image processor refused the image")


# --------------------------------------------------------------------------------- mixing, prepare, verify
def test_sources_weights_prepare_and_verify(root: Path, tmp_path: Path) -> None:
    write_jsonl(root / "a.jsonl", mixed_records()[:3])
    (root / "b.json").write_text(json.dumps(mixed_records()[:5]), encoding="utf-8")
    basic = {
        "dataset_dir": str(root),
        "dataset": ["a.jsonl", "b.json"],
        "weights": [1, 3],
        "cache_dir": str(tmp_path),
    }
    pre = {"model_name_or_path": str(root / "proc")}
    lines = VLMSFTDataset.prepare(basic, pre, SimpleNamespace(on_error="raise"), workers=1)
    assert lines[0].startswith(f"prepared: {tmp_path}/vlm_sft-"), lines
    assert lines[1].startswith("2 file(s), 8 records (8 ok); 8 usable within cutoff_len 2048: "), lines
    lines = VLMSFTDataset.prepare(basic, pre, SimpleNamespace(on_error="raise"))
    assert lines[0].startswith("already prepared (current): "), lines
    ds = VLMSFTDataset(basic, pre, SimpleNamespace(on_error="raise"))
    assert ds.source_sizes == [3, 5] and ds.source_weights == [1.0, 3.0]
    assert VLMSFTDataset.verify(basic, pre, SimpleNamespace(on_error="raise")) == []
    tokens = ds.prepared.path / "tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[-1] ^= 1  # same size, same name: only the hash can tell
    tokens.write_bytes(bytes(data))
    problems = VLMSFTDataset.verify(basic, pre, SimpleNamespace(on_error="raise"))
    assert problems == [f"{tokens}: prepared file is corrupt (sha256 differs)"]


def test_dataset_pickles_without_its_mapped_index(root: Path) -> None:
    write_jsonl(root / "pickled.jsonl", mixed_records()[:3])
    ds = make(root, "pickled.jsonl")
    ds[0]  # maps the columns it reads
    assert ds.index._maps
    copy = pickle.loads(pickle.dumps(ds))  # as for a DataLoader worker that is spawned
    assert copy.index._maps == {}
    assert copy[1]["input_ids"].tolist() == ds[1]["input_ids"].tolist()
