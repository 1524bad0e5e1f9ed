"""``video_latents`` dataset and collator over a hand-written latent store: samples, zero-padded text,
per-epoch noise seeds, token lengths and shape buckets, bad records (each a DataError naming
``index.jsonl:line (id)``, or skipped), and batching one shape only."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from mm_core.errors import ConfigError, DataError
from mm_data_video.collator import VideoLatentsCollator
from mm_data_video.dataset import VideoLatentsDataset, noise_seed

SHAPES = [(4, 3, 4, 6), (4, 5, 2, 2), (4, 3, 4, 6)]


def write_store(root: Path, shapes: list[tuple[int, ...]] = SHAPES, text_len: int = 3) -> Path:
    rng = np.random.default_rng(0)
    lines = []
    for i, shape in enumerate(shapes):
        sid = f"s{i}"
        (root / "latents").mkdir(parents=True, exist_ok=True)
        (root / "text").mkdir(parents=True, exist_ok=True)
        np.save(root / "latents" / f"{sid}.npy", rng.standard_normal(shape).astype(np.float32))
        np.save(root / "text" / f"{sid}.npy", rng.standard_normal((text_len + i, 8)).astype(np.float32))
        lines.append(
            json.dumps(
                {
                    "id": sid,
                    "caption": f"clip {i}",
                    "latents": f"latents/{sid}.npy",
                    "latent_shape": list(shape),
                    "text": f"text/{sid}.npy",
                    "text_shape": [text_len + i, 8],
                }
            )
        )
    (root / "index.jsonl").write_text("\n".join(lines) + "\n")
    return root


def dataset(store: Path | list[str], on_error: str = "raise", **basic: Any) -> VideoLatentsDataset:
    return VideoLatentsDataset(
        basic_param={"dataset": str(store) if isinstance(store, Path) else store, "text_length": 8, **basic},
        dataset_param=SimpleNamespace(on_error=on_error),
        seed=3,
    )


def test_samples_text_padding_and_noise_seeds(tmp_path: Path) -> None:
    ds = dataset(write_store(tmp_path))
    assert len(ds) == 3
    s = ds[1]
    assert s["latents"].shape == (4, 5, 2, 2) and s["latents"].dtype == torch.float32
    assert s["encoder_hidden_states"].shape == (8, 8)
    text = np.load(tmp_path / "text" / "s1.npy")
    assert torch.equal(s["encoder_hidden_states"][:4], torch.from_numpy(text))
    assert not s["encoder_hidden_states"][4:].any()  # zero-padded, as Wan's pipeline pads
    assert s["noise_seed"] == noise_seed(3, 0, 1) and s["sample_id"] == 1 and s["skipped_samples"] == 0
    assert ds[1]["noise_seed"] == s["noise_seed"]  # the same sample, epoch and seed: the same noise
    ds.set_epoch(1)
    assert ds[1]["noise_seed"] != s["noise_seed"]  # a new epoch: new noise
    assert len({noise_seed(3, 0, i) for i in range(100)}) == 100


def test_lengths_and_buckets(tmp_path: Path) -> None:
    ds = dataset(write_store(tmp_path))
    assert ds.sample_lengths().tolist() == [3 * 2 * 3, 5 * 1 * 1, 3 * 2 * 3]
    assert ds.sample_buckets().tolist() == [0, 1, 0]


def test_two_stores_are_one_dataset_with_mixing_weights(tmp_path: Path) -> None:
    a, b = write_store(tmp_path / "a"), write_store(tmp_path / "b", SHAPES[:2])
    ds = dataset([str(a), str(b)], weights=[1, 3])
    assert len(ds) == 5 and ds.source_sizes == [3, 2] and ds.source_weights == [1.0, 3.0]
    with pytest.raises(ConfigError, match="basic_parameters.weights: got 1 weights for 2 dataset entries"):
        dataset([str(a), str(b)], weights=[1])


def _edit_index(store: Path, line: int, **changes: Any) -> None:
    lines = (store / "index.jsonl").read_text().splitlines()
    record = json.loads(lines[line])
    record.update(changes)
    lines[line] = json.dumps(record)
    (store / "index.jsonl").write_text("\n".join(lines) + "\n")


def test_bad_records_name_the_index_line(tmp_path: Path) -> None:
    store = write_store(tmp_path)
    (store / "latents" / "s1.npy").unlink()
    where = re.escape(f"{store / 'index.jsonl'}:2 (s1)")
    with pytest.raises(DataError, match=rf"{where}: latents file .* does not exist"):
        dataset(store)[1]
    np.save(store / "latents" / "s1.npy", np.zeros((4, 5, 2, 3), dtype=np.float32))
    with pytest.raises(
        DataError, match=r"latents .* has shape \(4, 5, 2, 3\), the index says \(4, 5, 2, 2\)"
    ):
        dataset(store)[1]
    bad = np.zeros((4, 5, 2, 2), dtype=np.float32)
    bad[0, 0, 0, 0] = np.nan
    np.save(store / "latents" / "s1.npy", bad)
    with pytest.raises(DataError, match=rf"{where}: latents .* holds 1 NaN/inf values of 80"):
        dataset(store)[1]
    # skipped: the next good record, counted
    skipped = dataset(store, on_error="skip")[1]
    assert skipped["sample_id"] == 2 and skipped["skipped_samples"] == 1
    with pytest.raises(DataError, match=r"text embedding has 5 tokens, more than .*text_length 3"):
        dataset(store, text_length=3)[2]


def test_bad_index_and_parameters(tmp_path: Path) -> None:
    store = write_store(tmp_path)
    _edit_index(store, 2, id="s0")
    with pytest.raises(DataError, match=r"index.jsonl:3 \(s0\): id 's0' is also at .*index.jsonl:1"):
        dataset(store)
    _edit_index(store, 2, id="s2", latent_shape=[4, 3, 4])
    with pytest.raises(DataError, match=r":3 \(s2\): latent_shape must be a list of 4 positive integers"):
        dataset(store)
    _edit_index(store, 2, latent_shape=[4, 3, 4, 6], latents="../x.npy")
    with pytest.raises(DataError, match="latents must be a path inside the store"):
        dataset(store)
    _edit_index(store, 2, latents="latents/s2.npy", latent_shape=[4, 3, 3, 6])
    with pytest.raises(DataError, match=r"3×3×6 are not multiples of .*patch_size \[1, 2, 2\]"):
        dataset(store)
    _edit_index(store, 2, latent_shape=[8, 3, 4, 6])
    with pytest.raises(DataError, match="latent channels 8 / text dim 8 differ"):
        dataset(store)
    with pytest.raises(DataError, match="no index.jsonl; a latent store is written by"):
        dataset(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="basic_parameters.patch_size: got"):
        dataset(store, patch_size=[1, 2])


def test_collator_batches_one_shape(tmp_path: Path) -> None:
    ds = dataset(write_store(tmp_path))
    collate = VideoLatentsCollator({"collator_id": "video_latents"}, ds)
    batch = collate([ds[0], ds[2]])
    assert batch["latents"].shape == (2, 4, 3, 4, 6) and batch["encoder_hidden_states"].shape == (2, 8, 8)
    assert batch["noise_seed"] == [noise_seed(3, 0, 0), noise_seed(3, 0, 2)]
    assert batch["sample_id"].tolist() == [0, 2] and batch["skipped_samples"] == 0
    with pytest.raises(DataError, match=r"2 shapes \(sample: shape 0: \[4, 3, 4, 6\], 1: \[4, 5, 2, 2\]\)"):
        collate([ds[0], ds[1]])
    with pytest.raises(ConfigError, match="collate_param.pad_to: unknown key"):
        VideoLatentsCollator({"pad_to": 8}, ds)
