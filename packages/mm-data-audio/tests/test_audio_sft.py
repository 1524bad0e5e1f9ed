"""audio_sft / asr_manifest: audio tokens match the features, labels only on replies, bad audio named by
record and path (or skipped and counted), placeholder mismatches named, images with the Omni-style processor
layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mm_core.errors import ConfigError, DataError
from mm_data_audio.manifest import ASRManifestDataset


def rec(content: str, reply: str, audios: list[str], **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": reply}],
        "audios": audios,
        **extra,
    }


def reply(ds, sample) -> str:
    return ds.processor.tokenizer.decode([t for t in sample["labels"].tolist() if t != -100])


def test_tokens_labels_and_lengths(dataset_factory) -> None:
    ds = dataset_factory(
        [
            rec("<audio>What is said?", "hello there", ["a/one.wav"]),
            {
                "conversations": [
                    {"from": "human", "value": "<audio> and <audio>?"},
                    {"from": "gpt", "value": "two tones"},
                ],
                "audios": ["a/one.wav", "a/two.wav"],
            },
            rec("<audio>?", "short", ["a/short.flac"]),
        ]
    )
    fmt = ds.format
    s0, s1, s2 = ds[0], ds[1], ds[2]
    # 1.37 s: 137 frames -> 13 + ceil(37/8) = 18 tokens; the 22.05 kHz clip: 40000 samples -> 250 frames
    assert fmt.tokens(21920) == 18 and fmt.tokens(40000) == 13 * 2 + 7
    assert int((s0["input_ids"] == ds.audio_token_id).sum()) == fmt.feature_rows(s0) == 18
    assert s1["input_features"].shape == (2, 128, 300) and s1["input_features_mask"].sum(-1).tolist() == [
        137,
        250,
    ]
    assert int((s1["input_ids"] == ds.audio_token_id).sum()) == 18 + 33
    # a 0.2 s clip is padded to half a second (min_length), which counts as valid frames
    assert s2["input_features_mask"].sum().item() == 50 and fmt.feature_rows(s2) == 7
    assert reply(ds, s0) == "hello there<|im_end|>" and reply(ds, s1) == "two tones<|im_end|>"
    text = ds.processor.tokenizer.decode(s0["input_ids"].tolist())
    assert (
        text.startswith("<|im_start|>user\n<|audio_start|><|audio_pad|>")
        and "<|audio_end|>What is said?" in text
    )
    assert ds.sample_lengths().tolist() == [len(s["input_ids"]) for s in (s0, s1, s2)]
    assert (s0["sample_id"], s0["skipped_samples"]) == (0, 0)


BAD = {
    "missing": ("a/missing.wav", "no such audio file"),
    "empty": ("a/empty.wav", "empty audio"),
    "not audio": ("a/text.wav", "not an audio file"),
    "too long": ("a/long.wav", "over .*max_audio_seconds"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_audio_named_or_skipped(dataset_factory, case: str) -> None:
    path, reason = BAD[case]
    records = [rec("<audio>?", "good", ["a/one.wav"]), rec("<audio>?", "bad", [path])]
    with pytest.raises(
        DataError, match=rf"d\d+\.jsonl:2: .*{path}.*{reason}|d\d+\.jsonl:2: {reason}.*{path}"
    ):
        dataset_factory(records, max_audio_seconds=2.0)[1]
    ds = dataset_factory(records, on_error="skip", max_audio_seconds=2.0)
    sample = ds[1]
    assert sample["skipped_samples"] == 1 and sample["sample_id"] == 0 and ds.skipped == 1
    assert ds.sample_lengths().tolist() == [len(sample["input_ids"])] * 2


def test_wrong_rate_without_resampling(dataset_factory) -> None:
    records = [rec("<audio>?", "x", ["a/two.wav"])]
    with pytest.raises(DataError, match=r"d\d+\.jsonl:1: .*two\.wav: sampled at 22050 Hz .* 16000 Hz; set"):
        dataset_factory(records, resample=False)[0]


def test_placeholder_mismatch_and_images_without_processor(dataset_factory) -> None:
    with pytest.raises(
        DataError, match=r"d\d+\.jsonl:2: the conversation has 2 <audio> placeholder\(s\) but"
    ):
        dataset_factory([rec("<audio>?", "a", ["a/one.wav"]), rec("<audio><audio>?", "b", ["a/one.wav"])])
    image_rec = rec("<audio><image>?", "x", ["a/one.wav"], images=["i/wide.png"])
    with pytest.raises(DataError, match=r"d\d+\.jsonl:1: the record has images but .* no image processor"):
        dataset_factory([image_rec])
    ds = dataset_factory([image_rec, rec("<audio>?", "ok", ["a/one.wav"])], on_error="skip")
    assert ds[0]["skipped_samples"] == 1 and "pixel_values" not in ds[0]


def test_cutoff_len(dataset_factory) -> None:
    records = [rec("<audio>?", "x", ["a/long.wav"]), rec("<audio>?", "y", ["a/one.wav"])]
    with pytest.raises(DataError, match=r"d\d+\.jsonl:1: \d+ tokens .* exceed .*cutoff_len = 50"):
        dataset_factory(records, basic={"cutoff_len": 50})[0]
    ds = dataset_factory(records, on_error="skip", basic={"cutoff_len": 50})
    assert ds[0]["sample_id"] == 1 and ds.sample_lengths()[0] == ds.sample_lengths()[1]


def test_parameters_checked(dataset_factory) -> None:
    with pytest.raises(
        ConfigError, match=r"preprocess_parameters\.max_audio_second: unknown key; did you mean"
    ):
        dataset_factory([rec("<audio>?", "x", ["a/one.wav"])], max_audio_second=3)
    with pytest.raises(ConfigError, match=r"preprocess_parameters\.max_audio_seconds: got 0"):
        dataset_factory([rec("<audio>?", "x", ["a/one.wav"])], max_audio_seconds=0)


def test_images_with_omni_processor_layout(dataset_factory, omni_layout_processor: Path) -> None:
    config = json.loads((omni_layout_processor / "preprocessor_config.json").read_text())
    assert config["feature_extractor_type"] == "Qwen3ASRFeatureExtractor"
    assert config["image_processor_type"] == "Qwen2VLImageProcessor"
    ds = dataset_factory(
        [
            rec("<image>Which image? <audio>", "wide", ["a/one.wav"], images=["i/wide.png"]),
            rec("<audio>?", "no image", ["a/one.wav"]),
        ],
        processor=omni_layout_processor,
    )
    s0, s1 = ds[0], ds[1]
    assert s0["image_grid_thw"].tolist() == [[1, 4, 8]] and s0["pixel_values"].shape[0] == 32
    assert int((s0["input_ids"] == ds.image_token_id).sum()) == 8
    assert int((s0["input_ids"] == ds.audio_token_id).sum()) == 18
    assert reply(ds, s0) == "wide<|im_end|>"
    assert "pixel_values" not in s1 and "image_grid_thw" not in s1


def test_asr_manifest(dataset_factory, media: Path) -> None:
    lines = [
        {"audio": "a/one.wav", "text": "hello there", "language": "English"},
        {"audio": "a/two.wav", "text": "two tones"},
    ]
    prefix = "language {language}<asr_text>"
    with pytest.raises(DataError, match=r"d\d+\.jsonl:2: asr_prompt/asr_prefix use \{language\}"):
        dataset_factory(lines, cls=ASRManifestDataset, asr_prefix=prefix)
    ds = dataset_factory(lines, on_error="skip", cls=ASRManifestDataset, asr_prefix=prefix)
    assert reply(ds, ds[0]) == "language English<asr_text>hello there<|im_end|>"
    assert ds[1]["skipped_samples"] == 1
    plain = dataset_factory(lines, cls=ASRManifestDataset, asr_prompt="Transcribe.")
    text = plain.processor.tokenizer.decode(plain[1]["input_ids"].tolist())
    assert text.endswith("<|audio_end|>Transcribe.<|im_end|>\n<|im_start|>assistant\ntwo tones<|im_end|>\n")
    with pytest.raises(DataError, match=r'd\d+\.jsonl:1: "text" must be the transcript'):
        dataset_factory([{"audio": "a/one.wav"}], cls=ASRManifestDataset)


def test_preflight(dataset_factory, media: Path, asr_processor: Path) -> None:
    from mm_data_audio.sft import AudioSFTDataset

    dataset_factory([rec("<audio>?", "x", ["a/one.wav"])])  # writes the next dNN.jsonl
    name = sorted(media.glob("d*.jsonl"), key=lambda p: p.stat().st_mtime)[-1].name
    lines = AudioSFTDataset.preflight(
        {"dataset_dir": str(media), "dataset": name}, {"model_name_or_path": str(asr_processor)}, None
    )
    assert "qwen3-asr audio at 16000 Hz" in lines[0] and "18 audio tokens for 1 clip(s)" in lines[1]
    assert np.all(np.asarray([len(line) for line in lines]) > 0)
