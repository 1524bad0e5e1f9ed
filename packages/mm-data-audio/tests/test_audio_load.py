"""load_audio / audio_info: mono mixdown, resampling that keeps a tone's pitch, and every refusal named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf  # type: ignore[import-untyped]

from mm_data_audio.audio import audio_info, load_audio, resampled_length
from mm_data_audio.errors import AudioError


def peak_hz(wave: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave * np.hanning(len(wave))))
    return float(np.fft.rfftfreq(len(wave), 1 / rate)[spectrum.argmax()])


def test_mixdown_to_mono(tmp_path: Path, make_tone) -> None:
    stereo = make_tone(0.5, 16000, channels=2)  # right = left / 2
    sf.write(tmp_path / "s.wav", stereo, 16000, subtype="FLOAT")
    wave = load_audio(tmp_path / "s.wav", 16000)
    assert wave.dtype == np.float32 and wave.ndim == 1 and len(wave) == len(stereo)
    np.testing.assert_allclose(wave, stereo.mean(axis=1), atol=1e-6)


def test_resample_keeps_length_rule_and_pitch(media: Path) -> None:
    info = audio_info(media / "a" / "two.wav")
    assert (info.frames, info.sampling_rate, info.channels) == (55125, 22050, 2)
    wave = load_audio(media / "a" / "two.wav", 16000)
    assert len(wave) == resampled_length(55125, 22050, 16000) == 40000  # ceil(55125 * 320 / 441)
    assert abs(peak_hz(wave, 16000) - 660.0) < 2.0
    assert abs(peak_hz(load_audio(media / "a" / "one.wav", 16000), 16000) - 440.0) < 2.0


def test_flac_and_ogg(tmp_path: Path, make_tone) -> None:
    sf.write(tmp_path / "t.ogg", make_tone(0.5, 16000), 16000, format="OGG", subtype="VORBIS")
    sf.write(tmp_path / "t.flac", make_tone(0.5, 16000), 16000)
    for name in ("t.ogg", "t.flac"):
        wave = load_audio(tmp_path / name, 16000)
        assert len(wave) == 8000 and abs(peak_hz(wave, 16000) - 440.0) < 2.0


@pytest.mark.parametrize(
    ("name", "kwargs", "reason"),
    [
        ("missing.wav", {}, "no such audio file"),
        ("empty.wav", {}, r"empty audio \(0 frames\)"),
        ("text.wav", {}, "not an audio file soundfile can read"),
        (
            "two.wav",
            {"resample": False},
            r"22050 Hz .* 16000 Hz; set .*preprocess_parameters\.resample: true",
        ),
        ("long.wav", {"max_seconds": 2.5}, r"3\.00 s long, over .*max_audio_seconds = 2\.5"),
        ("long.wav", {"max_samples": 16000}, "more than the 16,000"),
    ],
)
def test_refusals_name_the_file(media: Path, name: str, kwargs: dict, reason: str) -> None:
    path = media / "a" / name
    with pytest.raises(AudioError, match=reason) as e:
        load_audio(path, 16000, **kwargs)
    assert str(e.value).startswith(str(path))
