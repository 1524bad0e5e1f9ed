"""Qwen3-Omni's audio format against transformers: the features are ``WhisperFeatureExtractor``'s for each
clip alone, the token count is ``Qwen3OmniMoeProcessor``'s rule and one row per token of a tiny thinker's
audio tower; a processor folder built by ``build_qwen3_omni_processor`` serves audio and images through
``audio_sft`` and the ``audio`` collator."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
    Qwen3OmniMoeAudioEncoderConfig,
)
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths
from transformers.models.whisper import WhisperFeatureExtractor

from mm_data_audio.collators import AudioCollator
from mm_data_audio.errors import EncodeError
from mm_data_audio.formats import format_for
from mm_data_audio.formats.qwen3_omni import Qwen3OmniFormat
from mm_data_audio.processor_omni import build_qwen3_omni_processor, qwen3_omni_feature_config

#: clip lengths in samples: shortest, sub-chunk, one chunk exactly, just over, several chunks, odd
LENGTHS = [201, 4000, 16000, 16160, 27200, 40123]


@pytest.fixture(scope="module")
def fmt() -> Qwen3OmniFormat:
    cls = format_for(qwen3_omni_feature_config())
    assert cls is Qwen3OmniFormat
    return cls(qwen3_omni_feature_config())


def test_features_are_whisper_features_of_each_clip_alone(fmt, make_tone) -> None:
    waves = [make_tone(n / 16000, 16000, 300.0 + 100 * i).astype(np.float32) for i, n in enumerate(LENGTHS)]
    out = fmt.features(waves)
    assert out["input_features"].shape == (len(LENGTHS), 128, 40123 // 160)
    assert out["feature_attention_mask"].sum(-1).tolist() == [n // 160 for n in LENGTHS]
    whisper = WhisperFeatureExtractor(feature_size=128)
    for i, wave in enumerate(waves):
        ref = whisper(wave, sampling_rate=16000, padding="longest", return_tensors="pt")["input_features"][0]
        torch.testing.assert_close(out["input_features"][i, :, : ref.shape[-1]], ref)
        assert (out["input_features"][i, :, ref.shape[-1] :] == 0).all()


def test_tokens_follow_the_processor_and_match_the_audio_tower(fmt) -> None:
    frames = torch.tensor([n // 160 for n in LENGTHS])
    assert [fmt.tokens(n) for n in LENGTHS] == _get_feat_extract_output_lengths(frames, 50).tolist()
    mask = (torch.arange(int(frames.max())) < frames[:, None]).long()
    assert fmt.feature_rows({"feature_attention_mask": mask}) == sum(fmt.tokens(n) for n in LENGTHS)
    for n in LENGTHS:
        text = fmt.placeholder(n)
        assert text == "<|audio_start|>" + "<|audio_pad|>" * fmt.tokens(n) + "<|audio_end|>"
    torch.manual_seed(0)
    tower = Qwen3OmniMoeAudioEncoder(
        Qwen3OmniMoeAudioEncoderConfig(
            d_model=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=32,
            downsample_hidden_size=4,
            output_dim=8,
        )
    ).eval()
    features = torch.randn(len(LENGTHS), 128, int(frames.max())) * mask[:, None]
    with torch.no_grad():  # as the thinker calls it: the valid frames of every clip, concatenated
        rows = tower(features.permute(0, 2, 1)[mask.bool()].T, feature_lens=frames).last_hidden_state
    assert rows.shape[0] == fmt.feature_rows({"feature_attention_mask": mask})


def test_short_clip_and_unusable_n_window_are_refused(fmt) -> None:
    with pytest.raises(EncodeError, match="the audio has 200 samples; qwen3-omni needs at least 201"):
        fmt.placeholder(200)
    with pytest.raises(EncodeError, match="needs at least 201"):
        fmt.features([np.zeros(100, np.float32)])
    with pytest.raises(ValueError, match="n_window: got 8; .* only for n_window 49 to 52"):
        Qwen3OmniFormat(qwen3_omni_feature_config(n_window=8))
    with pytest.raises(TypeError, match="has no parameter bins"):
        qwen3_omni_feature_config(bins=80)


def test_processor_folder_serves_audio_and_images(tmp_path, make_tone) -> None:
    from types import SimpleNamespace

    from PIL import Image

    from mm_data_audio.sft import AudioSFTDataset

    corpus = ["What is heard and seen? a tone and a grey square"] * 20
    proc = build_qwen3_omni_processor(corpus, tmp_path / "proc", vocab_size=300)
    sf.write(tmp_path / "a.wav", make_tone(1.25, 16000), 16000)
    Image.fromarray(np.full((56, 56, 3), 128, np.uint8)).save(tmp_path / "i.png")
    records = [
        {
            "messages": [
                {"role": "user", "content": "<audio><image>What is heard and seen?"},
                {"role": "assistant", "content": "a tone and a grey square"},
            ],
            "audios": ["a.wav"],
            "images": ["i.png"],
        },
        {
            "messages": [
                {"role": "user", "content": "What is seen?"},
                {"role": "assistant", "content": "nothing"},
            ],
        },
    ]
    (tmp_path / "d.json").write_text(json.dumps(records))
    ds = AudioSFTDataset(
        {"dataset_dir": str(tmp_path), "dataset": "d.json"},
        {"model_name_or_path": str(proc)},
        SimpleNamespace(on_error="raise"),
    )
    assert isinstance(ds.format, Qwen3OmniFormat)
    batch = AudioCollator({"collator_id": "audio"}, ds)([ds[0], ds[1]])
    assert batch["input_features"].shape == (1, 128, 125)
    assert batch["feature_attention_mask"].sum().item() == 125
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]]
    ids = batch["input_ids"]
    assert int((ids == ds.audio_token_id).sum()) == ds.format.feature_rows(batch) == fmt_tokens(125)
    assert "13 tokens per 1 s chunk" in ds.format.describe()


def fmt_tokens(frames: int) -> int:
    """13 rows per full 100-frame chunk, then three halvings (rounded up) of the rest."""
    full, rest = divmod(frames, 100)
    for _ in range(3):
        rest = -(-rest // 2)
    return 13 * full + rest
