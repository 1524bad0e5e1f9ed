"""Shared fixtures: audio written from numpy (tones, noise) and tiny processor folders built locally (no
network, no TTS)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf  # type: ignore[import-untyped]

from mm_data_audio.processor_build import build_qwen3_asr_processor, qwen_vl_image_config

_COUNTER = itertools.count()
CORPUS = ["What is said? hello there, two tones. language English<asr_text> Which image?"] * 20


def tone(seconds: float, rate: int, freq: float = 440.0, channels: int = 1) -> np.ndarray:
    """A sine of ``freq`` Hz (every channel the same, scaled by 1/channel index)."""
    t = np.arange(int(round(seconds * rate))) / rate
    wave = 0.3 * np.sin(2 * np.pi * freq * t)
    if channels == 1:
        return wave
    return np.stack([wave / (c + 1) for c in range(channels)], axis=1)


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="session")
def make_tone() -> Callable[..., np.ndarray]:
    return tone


@pytest.fixture(scope="session")
def asr_processor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen3_asr_processor(CORPUS, tmp_path_factory.mktemp("proc") / "qwen3_asr")


@pytest.fixture(scope="session")
def omni_layout_processor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-ASR's feature extractor with a Qwen-VL image processor merged into preprocessor_config.json (the
    layout of Qwen-Omni's folders)."""
    out = tmp_path_factory.mktemp("proc") / "omni_layout"
    return build_qwen3_asr_processor(CORPUS, out, image_config=qwen_vl_image_config(max_pixels=56 * 112))


@pytest.fixture(scope="session")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of clips: good ones at 16 kHz / 22.05 kHz (stereo), and every kind of bad one."""
    from PIL import Image

    root = tmp_path_factory.mktemp("media")
    (root / "a").mkdir()
    sf.write(root / "a" / "one.wav", tone(1.37, 16000), 16000)
    sf.write(root / "a" / "two.wav", tone(2.5, 22050, 660.0, channels=2), 22050)
    sf.write(root / "a" / "short.flac", tone(0.2, 16000), 16000)
    sf.write(root / "a" / "long.wav", tone(3.0, 16000), 16000)
    sf.write(root / "a" / "empty.wav", np.zeros(0), 16000)
    (root / "a" / "text.wav").write_text("this is not audio\n")
    (root / "i").mkdir()
    Image.fromarray(np.full((56, 112, 3), 128, np.uint8)).save(root / "i" / "wide.png")
    return root


@pytest.fixture
def dataset_factory(media: Path, asr_processor: Path) -> Callable[..., Any]:
    """``make(records, on_error=..., cls=..., processor=..., **preprocess)``: a dataset over ``records``
    written as JSONL into the media folder."""
    from types import SimpleNamespace

    from mm_data_audio.sft import AudioSFTDataset

    def make(
        records: list[dict[str, Any]],
        on_error: str = "raise",
        cls: Any = AudioSFTDataset,
        processor: Path | None = None,
        basic: dict[str, Any] | None = None,
        **preprocess: Any,
    ) -> Any:
        name = f"d{next(_COUNTER)}.jsonl"
        write_jsonl(media / name, records)
        return cls(
            {"dataset_dir": str(media), "dataset": name, **(basic or {})},
            {"model_name_or_path": str(processor or asr_processor), **preprocess},
            SimpleNamespace(on_error=on_error),
        )

    return make
