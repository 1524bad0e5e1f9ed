"""encode_clips with a tiny random ``AutoencoderKLWan`` and a tiny UMT5 text encoder (tokenizer trained here):
the store it writes, the normalised latent mean it stores, Wan's prompt encoding cut to the real tokens,
and the clips it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mm_core.data.bpe import write_bytelevel_bpe
from mm_core.errors import DataError
from mm_data_video import Clip, encode_clips, read_index, t5_text_encoder
from mm_data_video.dataset import VideoLatentsDataset

diffusers = pytest.importorskip("diffusers")

TINY_VAE = {
    "base_dim": 3,
    "z_dim": 16,
    "dim_mult": [1, 1, 1, 1],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
}
CAPTIONS = ["a 3 moving left", "a 7 moving right", "a 1 moving up"]


@pytest.fixture(scope="module")
def vae() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.AutoencoderKLWan(**TINY_VAE).eval()


@pytest.fixture(scope="module")
def text_encoder(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    folder = write_bytelevel_bpe(
        CAPTIONS * 20, 300, tmp_path_factory.mktemp("tok"), special_tokens=["<pad>"], chat_template=""
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    config = UMT5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    model = UMT5EncoderModel(config).eval()
    return tokenizer, model


def _clips(shapes: list[tuple[int, int, int]]) -> list[Clip]:
    rng = np.random.default_rng(0)
    return [
        Clip(f"c{i}", rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8), CAPTIONS[i % len(CAPTIONS)])
        for i, (t, h, w) in enumerate(shapes)
    ]


def test_store_holds_normalised_latent_means_and_trimmed_text(vae, text_encoder, tmp_path: Path) -> None:
    tokenizer, model = text_encoder
    encode_text = t5_text_encoder(tokenizer, model, max_length=16)
    clips = _clips([(9, 32, 32), (5, 16, 48), (9, 32, 32)])
    index = encode_clips(clips, tmp_path, vae=vae, encode_text=encode_text, text_batch_size=2)
    records = read_index(tmp_path)
    assert index == tmp_path / "index.jsonl" and [r.id for r in records] == ["c0", "c1", "c2"]
    assert [r.latent_shape for r in records] == [(16, 3, 4, 4), (16, 2, 2, 6), (16, 3, 4, 4)]
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["latent_channels"] == 16 and meta["text_dim"] == 32 and meta["normalised"] is True
    # the latents: the VAE's mean, normalised with its latents_mean / latents_std
    video = torch.from_numpy(clips[1].frames).permute(3, 0, 1, 2).float() / 127.5 - 1
    with torch.no_grad():
        mean = vae.encode(video[None]).latent_dist.mean[0]
    m = torch.tensor(vae.config.latents_mean).view(16, 1, 1, 1)
    s = torch.tensor(vae.config.latents_std).view(16, 1, 1, 1)
    assert torch.allclose(
        torch.from_numpy(np.load(tmp_path / "latents" / "c1.npy")), (mean - m) / s, atol=1e-5
    )
    # the text: the encoder's output over the caption's real tokens only
    tokens = tokenizer(CAPTIONS[1], return_tensors="pt")
    with torch.no_grad():
        expected = model(tokens.input_ids, attention_mask=tokens.attention_mask).last_hidden_state[0]
    stored = np.load(tmp_path / "text" / "c1.npy")
    assert records[1].text_shape == tuple(expected.shape)
    assert torch.allclose(torch.from_numpy(stored), expected, atol=1e-5)
    # the dataset reads it
    ds = VideoLatentsDataset({"dataset": str(tmp_path), "text_length": 16}, seed=0)
    assert ds[1]["latents"].shape == (16, 2, 2, 6) and ds.sample_buckets().tolist() == [0, 1, 0]


def test_refused_clips(vae, tmp_path: Path) -> None:
    def encode_text(captions: list[str]) -> list[torch.Tensor]:
        return [torch.ones(2, 4) for _ in captions]

    with pytest.raises(DataError, match=r"clip 'c0': 8 frames of 32×32; the VAE needs 1 \+ a multiple of 4"):
        encode_clips(_clips([(8, 32, 32)]), tmp_path / "a", vae=vae, encode_text=encode_text)
    with pytest.raises(DataError, match="sides that are multiples of 8"):
        encode_clips(_clips([(5, 32, 36)]), tmp_path / "b", vae=vae, encode_text=encode_text)
    with pytest.raises(DataError, match=r"clip id 'a/b' may only hold"):
        encode_clips([Clip("a/b", np.zeros((5, 16, 16, 3), np.uint8), "x")], tmp_path / "c", vae=vae,
                     encode_text=encode_text)  # fmt: skip
    with pytest.raises(DataError, match=r"uint8 frames must be \[T, H, W, 3\]"):
        encode_clips([Clip("x", np.zeros((5, 16, 16), np.uint8), "x")], tmp_path / "d", vae=vae,
                     encode_text=encode_text)  # fmt: skip
    encode_clips(_clips([(5, 16, 16)]), tmp_path / "e", vae=vae, encode_text=encode_text)
    with pytest.raises(DataError, match="already holds a latent store"):
        encode_clips(_clips([(5, 16, 16)]), tmp_path / "e", vae=vae, encode_text=encode_text)
    with pytest.raises(DataError, match="the text embeddings hold NaN/inf"):
        encode_clips(_clips([(5, 16, 16)]), tmp_path / "f", vae=vae,
                     encode_text=lambda c: [torch.full((2, 4), float("nan"))])  # fmt: skip
