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


def add_audio(store: Path, records: list[int], frames: int = 5, with_text: bool = True) -> Path:
    """Give ``records`` of the store audio latents [2, frames, 4] and (``with_text``) an audio text
    embedding [text tokens, 6]."""
    rng = np.random.default_rng(1)
    (store / "audio").mkdir(exist_ok=True)
    lines = (store / "index.jsonl").read_text().splitlines()
    for i in records:
        record = json.loads(lines[i])
        sid = record["id"]
        np.save(store / "audio" / f"{sid}.npy", rng.standard_normal((2, frames, 4)).astype(np.float32))
        record.update(audio_latents=f"audio/{sid}.npy", audio_latent_shape=[2, frames, 4])
        if with_text:
            tokens = record["text_shape"][0]
            np.save(store / "audio" / f"{sid}_text.npy", rng.standard_normal((tokens, 6)).astype(np.float32))
            record.update(audio_text=f"audio/{sid}_text.npy", audio_text_shape=[tokens, 6])
        lines[i] = json.dumps(record)
    (store / "index.jsonl").write_text("\n".join(lines) + "\n")
    return store


def test_audio_latents_text_mask_buckets_and_batches(tmp_path: Path) -> None:
    store = add_audio(write_store(tmp_path), [0])
    ds = dataset(store)
    s = ds[0]
    assert torch.equal(s["audio_latents"], torch.from_numpy(np.load(store / "audio" / "s0.npy")))
    text = torch.from_numpy(np.load(store / "audio" / "s0_text.npy"))
    assert s["audio_encoder_hidden_states"].shape == (8, 6)
    assert (
        torch.equal(s["audio_encoder_hidden_states"][:3], text)
        and not s["audio_encoder_hidden_states"][3:].any()
    )
    assert s["encoder_attention_mask"].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert "audio_latents" not in ds[2] and ds[2]["encoder_attention_mask"].sum() == 5
    # s0 and s2 have one video shape, but only s0 has audio: two buckets; audio frames count as tokens
    assert ds.sample_buckets().tolist() == [0, 1, 2]
    assert ds.sample_lengths().tolist() == [3 * 2 * 3 + 5, 5 * 1 * 1, 3 * 2 * 3]
    collate = VideoLatentsCollator({"collator_id": "video_latents"}, ds)
    batch = collate([s, s])
    assert batch["audio_latents"].shape == (2, 2, 5, 4)
    assert batch["audio_encoder_hidden_states"].shape == (2, 8, 6)
    assert batch["encoder_attention_mask"].shape == (2, 8)
    with pytest.raises(
        DataError, match=r"2 shapes \(sample: shape 0: \[4, 3, 4, 6\] \+ audio \[2, 5, 4\], 2"
    ):
        collate([s, ds[2]])
    wan = collate([ds[2], ds[2]])  # a video-only batch is what it was, plus the mask
    fields = {"latents", "encoder_hidden_states", "encoder_attention_mask", "noise_seed", "sample_id"}
    assert set(wan) == fields | {"skipped_samples"}


def test_bad_audio_records(tmp_path: Path) -> None:
    store = add_audio(write_store(tmp_path), [0, 2])
    _edit_index(store, 0, audio_latent_shape=[2, 5])
    with pytest.raises(
        DataError, match=r":1 \(s0\): audio_latent_shape must be a list of 3 positive integers"
    ):
        dataset(store)
    _edit_index(store, 0, audio_latent_shape=[2, 5, 4], audio_text_shape=[4, 6])
    with pytest.raises(DataError, match="audio_text_shape has 4 tokens, text_shape 3; .* same length"):
        dataset(store)
    _edit_index(store, 0, audio_text_shape=[3, 6], audio_latent_shape=[3, 5, 4])
    with pytest.raises(DataError, match=r":3 \(s2\): audio latent channels × mel bins 2×4 .* differ"):
        dataset(store)
    _edit_index(store, 0, audio_latent_shape=[2, 5, 4])
    np.save(store / "audio" / "s0.npy", np.zeros((2, 6, 4), dtype=np.float32))
    with pytest.raises(
        DataError, match=r"audio latents .* has shape \(2, 6, 4\), the index says \(2, 5, 4\)"
    ):
        dataset(store)[0]
    lines = (store / "index.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    del record["audio_latent_shape"]
    lines[0] = json.dumps(record)
    (store / "index.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match="audio_latents and audio_latent_shape go together"):
        dataset(store)


def test_store_writer_with_audio_and_its_refusals(tmp_path: Path) -> None:
    from mm_data_video import StoreWriter

    writer = StoreWriter(tmp_path / "av")
    video, text, audio = torch.randn(4, 3, 4, 6), torch.randn(3, 8), torch.randn(2, 5, 4)
    writer.add("a0", "with audio", video, text, audio_latents=audio, audio_text=torch.randn(3, 6))
    writer.add("a1", "video only", video, torch.randn(2, 8))
    with pytest.raises(DataError, match="clip id 'a0' is used twice"):
        writer.add("a0", "again", video, text)
    with pytest.raises(DataError, match="audio_text needs audio_latents and as many tokens as text"):
        writer.add("a2", "x", video, text, audio_text=torch.randn(3, 6))
    with pytest.raises(DataError, match="clip 'a2': text dim 9, earlier samples had 8"):
        writer.add("a2", "x", video, torch.randn(3, 9))
    with pytest.raises(DataError, match=r"audio_latents of shape \[2, 5\]; expected 3 dims"):
        writer.add("a2", "x", video, text, audio_latents=torch.randn(2, 5))
    writer.finish({"vae": "test"})
    meta = json.loads((tmp_path / "av" / "meta.json").read_text())
    assert meta["latent_channels"] == 4 and meta["text_dim"] == 8 and meta["vae"] == "test"
    ds = dataset(tmp_path / "av")
    assert len(ds) == 2 and torch.equal(ds[0]["audio_latents"], audio) and "audio_latents" not in ds[1]
    with pytest.raises(DataError, match="already holds a latent store"):
        StoreWriter(tmp_path / "av")
    with pytest.raises(DataError, match="no sample was added"):
        StoreWriter(tmp_path / "empty").finish({})
