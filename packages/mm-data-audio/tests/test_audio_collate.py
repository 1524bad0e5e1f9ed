"""The audio collator's padding, and Qwen3-ASR's token count against transformers: the processor's rule and a
tiny Qwen3ASRForConditionalGeneration whose audio tower must give one row per audio token."""

from __future__ import annotations

import pytest
import torch

from mm_core.errors import ConfigError
from mm_data_audio.collators import AudioCollator


def rec(content: str, reply: str, audios: list[str]) -> dict:
    return {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": reply}],
        "audios": audios,
    }


@pytest.fixture
def ds(dataset_factory):
    return dataset_factory(
        [
            rec("<audio>What is said?", "hello there", ["a/one.wav"]),
            rec("<audio> and <audio>?", "two tones", ["a/two.wav", "a/short.flac"]),
            rec("No audio?", "none", []),
        ]
    )


def test_padding_and_audio_rows(ds) -> None:
    collate = AudioCollator({"collator_id": "audio", "pad_to_multiple_of": 8}, ds)
    s0, s1, s2 = ds[0], ds[1], ds[2]
    batch = collate([s0, s1, s2])
    n = [len(s["input_ids"]) for s in (s0, s1, s2)]
    width = -(-max(n) // 8) * 8
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (3, width)
    assert batch["attention_mask"].sum(-1).tolist() == n
    assert (batch["input_ids"][2, n[2] :] == ds.pad_token_id).all() and (
        batch["labels"][2, n[2] :] == -100
    ).all()
    # one row per clip, in token order; time zero-padded to the longest, a multiple of the 100-frame chunk
    assert batch["input_features"].shape == (3, 128, 300) and batch["input_features_mask"].shape == (3, 300)
    assert batch["input_features_mask"].sum(-1).tolist() == [137, 250, 50]
    assert (batch["input_features"][0, :, 200:] == 0).all() and (
        batch["input_features_mask"][0, 137:] == 0
    ).all()
    torch.testing.assert_close(batch["input_features"][1], s1["input_features"][0])
    assert batch["sample_id"].tolist() == [0, 1, 2] and batch["skipped_samples"] == 0
    assert "pixel_values" not in batch
    assert ds.format.feature_rows(batch) == int((batch["input_ids"] == ds.audio_token_id).sum())
    text_only = collate([s2])
    assert not {"input_features", "input_features_mask"} & set(text_only)


def test_collator_needs_an_audio_dataset() -> None:
    with pytest.raises(ConfigError, match="needs a dataset of mm-data-audio"):
        AudioCollator({"collator_id": "audio"}, object())


def test_token_count_matches_the_processor_rule(ds) -> None:
    from transformers.models.qwen3_asr.processing_qwen3_asr import Qwen3ASRProcessor

    samples = [1, 159, 8000, 8160, 15999, 16000, 16160, 21920, 40000, 160_000, 480_000 + 77]
    frames = torch.tensor([max(n, 8000) // 160 for n in samples])
    expected = Qwen3ASRProcessor._get_audio_token_length(None, frames).tolist()
    assert [ds.format.tokens(n) for n in samples] == expected


def test_tiny_qwen3_asr_forward(ds) -> None:
    from transformers.models.qwen3_asr import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration

    batch = AudioCollator({"collator_id": "audio"}, ds)([ds[0], ds[1]])
    config = Qwen3ASRConfig(
        audio_config={
            "model_type": "qwen3_asr_encoder",
            "d_model": 32,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "downsample_hidden_size": 16,
            "output_dim": 64,
            "num_mel_bins": 128,
        },
        text_config={
            "model_type": "qwen3",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": len(ds.processor.tokenizer),
        },
        audio_token_id=ds.audio_token_id,
        pad_token_id=ds.pad_token_id,
        eos_token_id=ds.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ASRForConditionalGeneration(config).eval()
    inputs = {k: v for k, v in batch.items() if k not in ("sample_id", "skipped_samples")}
    rows = model.get_audio_features(inputs["input_features"], inputs["input_features_mask"]).pooler_output
    assert (
        rows.shape[0]
        == int((inputs["input_ids"] == ds.audio_token_id).sum())
        == ds.format.feature_rows(batch)
    )
    out = model(**inputs)
    assert out.loss is not None and torch.isfinite(out.loss)
