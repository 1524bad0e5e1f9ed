"""The ``fun-asr-nano`` format: Kaldi filter banks as Kaldi computes them (values taken once from
kaldi-native-fbank, a C++ port of Kaldi's ``compute-fbank-feats``, for a fixed chirp), the frame and token
counts, where a tone's energy lands, LFR stacking, batching, refusals, and a processor folder that encodes an
ASR sample with one audio token per LFR row."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mm_data_audio.encode import AudioProcessor
from mm_data_audio.errors import EncodeError
from mm_data_audio.formats import format_for
from mm_data_audio.formats.fun_asr import AUDIO_TOKEN, FunAsrNanoFormat, kaldi_mel_banks
from mm_data_audio.processor_funasr import (
    build_fun_asr_nano_processor,
    build_paraformer_processor,
    fun_asr_nano_feature_config,
)

RATE = 16000


def fmt(**overrides: object) -> FunAsrNanoFormat:
    return FunAsrNanoFormat(fun_asr_nano_feature_config(**overrides))


def chirp() -> np.ndarray:
    t = np.arange(1200) / RATE
    return (0.3 * np.sin(2 * np.pi * (200 * t + 20000 * t * t)) + 0.05 * np.sin(2 * np.pi * 5000 * t)).astype(
        np.float32
    )


#: kaldi-native-fbank 1.22.4 (80 bins, hamming, dither 0, snip_edges) on :func:`chirp`: frame -> bins
KALDI = {
    0: {0: -6.5437, 7: -5.5165, 20: 2.5002, 40: -6.3529, 60: -7.2218, 79: -7.0995},
    5: {0: -8.0124, 7: -8.1445, 20: -8.1693, 40: -4.3442, 60: -4.5387, 79: -5.8803},
}


def test_filter_banks_match_kaldi() -> None:
    bank = fmt().fbank(chirp())
    assert bank.shape == (6, 80) and bank.dtype == torch.float32
    for frame, values in KALDI.items():
        for b, want in values.items():
            assert abs(float(bank[frame, b]) - want) < 2e-3, (frame, b, float(bank[frame, b]), want)


@pytest.mark.parametrize("samples", [400, 559, 560, 16000, 16001, 12345])
def test_frame_and_token_counts(samples: int) -> None:
    f = fmt()
    frames = 1 + (samples - 400) // 160
    assert f.fbank(np.zeros(samples, np.float32)).shape[0] == frames == f.fbank_frames(samples)
    out = f.features([np.random.default_rng(samples).standard_normal(samples).astype(np.float32)])
    rows = math.ceil(frames / 6)
    assert out["input_features"].shape == (1, rows, 560)
    assert f.placeholder(samples) == AUDIO_TOKEN * rows
    assert f.feature_rows(out) == rows == f.tokens(samples)


@pytest.mark.parametrize("freq", [300.0, 1000.0, 4000.0])
def test_a_tone_peaks_in_the_mel_bin_around_its_frequency(freq: float) -> None:
    t = np.arange(RATE // 4) / RATE
    bank = fmt().fbank((0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32))
    mel = 1127.0 * np.log(1.0 + np.array([20.0, 8000.0, freq]) / 700.0)
    centers = mel[0] + (np.arange(80) + 1) * (mel[1] - mel[0]) / 81
    nearest = int(np.argmin(np.abs(centers - mel[2])))
    assert abs(int(bank.mean(0).argmax()) - nearest) <= 1
    banks = kaldi_mel_banks(80, 512, RATE)
    assert banks.shape == (80, 257) and float(banks[:, -1].abs().sum()) == 0.0
    assert float(banks.min()) >= 0.0 and float(banks.max()) <= 1.0


def test_silence_is_the_log_floor() -> None:
    bank = fmt().fbank(np.zeros(800, np.float32))
    assert torch.allclose(bank, torch.full_like(bank, math.log(torch.finfo(torch.float32).eps)))


def test_lfr_stacks_centred_windows_repeating_the_edges() -> None:
    f = fmt()
    bank = torch.arange(13, dtype=torch.float32).unsqueeze(1).repeat(1, 80)  # frame i holds i
    rows = f.lfr(bank)
    assert rows.shape == (3, 560)
    frames = rows.reshape(3, 7, 80)[:, :, 0]
    assert frames.tolist() == [[0, 0, 0, 0, 1, 2, 3], [3, 4, 5, 6, 7, 8, 9], [9, 10, 11, 12, 12, 12, 12]]


def test_collate_pads_rows_and_keeps_clip_order() -> None:
    f = fmt()
    a = f.features([np.ones(4000, np.float32), np.ones(1000, np.float32)])
    b = f.features([np.ones(8000, np.float32)])
    out = f.collate([a, b])
    assert out["input_features"].shape == (3, 8, 560)  # 23, 4 and 48 frames: 4, 1 and 8 rows
    assert out["input_features_mask"].sum(1).tolist() == [4, 1, 8]
    assert torch.equal(out["input_features"][1, 1:], torch.zeros(7, 560))
    assert torch.equal(out["input_features"][2], b["input_features"][0])


def test_refusals() -> None:
    with pytest.raises(EncodeError, match="shorter than one 400-sample analysis window"):
        fmt().placeholder(399)
    with pytest.raises(ValueError, match="window must be one of"):
        fmt(window="kaiser")
    with pytest.raises(ValueError, match="stride_lfr must be a positive integer"):
        fmt(stride_lfr=0)
    with pytest.raises(TypeError, match="no parameter dither"):
        fun_asr_nano_feature_config(dither=1.0)
    assert format_for(fun_asr_nano_feature_config()) is FunAsrNanoFormat
    assert "560 values" in fmt().describe()


def test_processor_folders_encode_one_audio_token_per_row(tmp_path: Path) -> None:
    texts = ["one two three", "four five six"] * 20
    nano = AudioProcessor.load(str(build_fun_asr_nano_processor(texts, tmp_path / "nano")), "pp")
    messages = [
        {"role": "user", "content": "<audio>Transcribe."},
        {"role": "assistant", "content": "one two"},
    ]
    ids, labels = nano.encode(messages, [9600])
    assert nano.audio_token_count(ids) == fmt().tokens(9600) == 10
    assert nano.tokenizer.convert_ids_to_tokens(nano.audio_token_id) == AUDIO_TOKEN
    para = AudioProcessor.load(str(build_paraformer_processor(texts, tmp_path / "para")), "pp")
    ids, labels = para.encode(messages[:1] + messages[1:], [9600])
    labelled = [t for t in labels if t != -100]
    assert para.tokenizer.decode(labelled) == "one two"  # the bare transcript, no end-of-turn token
    assert para.tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
