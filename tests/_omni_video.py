"""Tiny Qwen3-Omni assets with videos: clips written with PyAV (H.264 frames of noise, an AAC sound track of a
tone over noise, or none), WAV clips, 56² images, ShareGPT records mixing ``<video>`` (with its sound),
``<audio>`` and ``<image>``, a processor folder, the tiny thinker's config.json (``_audio``'s towers and
decoder) and a YAML with ``use_audio_in_video: true``.

The records come in a fixed order (no shuffling) so that, at 4 samples per global micro-batch, one rank of a
2-rank run gets micro-batches with videos while the other gets none, and whole micro-batches have no video,
no audio or no image: the idle towers and every mix of media run in both layouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from _audio import RATE, clip, write_run

#: the thinker's and the data's position ids per second of video (transformers' processor default)
POSITION_ID_PER_SECONDS = 13
#: (frames, height, width, frames a second, seconds of sound or None, sound's rate, channels) by name
CLIPS = {
    "a": (8, 56, 56, 4.0, 2.0, 44100, 2),
    "b": (12, 56, 84, 6.0, 1.9, 16000, 1),
    "c": (6, 56, 56, 3.0, 2.0, 48000, 2),
    "silent": (8, 56, 56, 4.0, None, 0, 0),
}
#: (videos, clips, images) per record, in dataset order (see the module docstring)
MEDIA = [
    *[(1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1)],  # rank 0: videos, rank 1: audio and an image
    *[(0, 1, 1), (1, 0, 1), (0, 0, 0), (1, 1, 1)],
    *[(0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0)],  # rank 0: no video
    *[(0, 1, 0), (0, 1, 0), (0, 0, 0), (0, 1, 0)],  # no video, no image
    *[(1, 0, 0), (1, 0, 1), (0, 0, 1), (0, 0, 0)],  # no audio clip
    *[(0, 1, 1), (1, 1, 0), (0, 0, 1), (1, 0, 0)],
]
#: the preprocess parameters of the tiny runs (2 frames a second, 56×56 or 56×84 frames)
VIDEO_PARAMS = {
    "use_audio_in_video": True,
    "video_fps": 2.0,
    "video_min_pixels": 56 * 56,
    "video_max_pixels": 56 * 84,
}


def write_clips(folder: Path, seed: int = 0) -> dict[str, Path]:
    """The :data:`CLIPS` as ``folder/<name>.mp4``."""
    from mm_data_audio.video_audio import write_video_with_audio

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = {}
    for name, (t, h, w, fps, seconds, rate, channels) in CLIPS.items():
        frames = rng.integers(0, 255, (t, h, w, 3), dtype=np.uint8)
        wave = None
        if seconds is not None:
            n = int(seconds * rate)
            tone = np.sin(2 * np.pi * rng.uniform(200, 2000) * np.arange(n) / rate)
            wave = (0.3 * tone + 0.05 * rng.standard_normal(n)).astype(np.float32)
        out[name] = write_video_with_audio(folder / f"{name}.mp4", frames, fps, wave, rate, channels=channels)
    return out


def build_processor(root: Path, texts: list[str]) -> Path:
    from mm_data_audio.processor_omni import build_qwen3_omni_processor

    return build_qwen3_omni_processor(texts, root / "processor", vocab_size=300)


def _records(data: Path) -> list[dict[str, Any]]:
    import soundfile as sf
    from PIL import Image

    write_clips(data / "v")
    (data / "wav").mkdir(exist_ok=True)
    (data / "img").mkdir(exist_ok=True)
    names = [n for n in CLIPS if n != "silent"]
    records = []
    for i, (videos, clips, images) in enumerate(MEDIA):
        record: dict[str, Any] = {"videos": [], "audios": [], "images": []}
        for j in range(videos):
            record["videos"].append(f"v/{names[(i + j) % len(names)]}.mp4")
        for j in range(clips):
            name = f"wav/{i}_{j}.wav"
            sf.write(data / name, clip(0.4 + 0.1 * (i % 9), 100 * i + j), RATE)
            record["audios"].append(name)
        for j in range(images):
            name = f"img/{i}_{j}.png"
            pixels = np.random.default_rng(1000 + i).integers(0, 255, (56, 56, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(data / name)
            record["images"].append(name)
        question = "<video>" * videos + "<audio>" * clips + "<image>" * images + f"What happens in {i}?"
        answer = f"scene {i % 5} sound {i % 3}"
        record["messages"] = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        records.append(record)
    (data / "train.json").write_text(json.dumps(records))
    return records


def make_omni_video_assets(root: Path) -> Path:
    """Data, processor, the tiny thinker's config.json and the YAML (fp32, per-token loss, no shuffling, no
    checkpoints) under ``root``; returns the YAML's path."""
    records = _records(root / "data")
    texts = [m["content"] for r in records for m in r["messages"]] * 5
    proc = build_processor(root, texts)
    return write_run(
        root,
        "qwen3_omni_moe",
        proc,
        name="qwen3_omni_video.yaml",
        cutoff_len=320,
        train_iters=3,
        preprocess=VIDEO_PARAMS,
        config_attrs={"position_id_per_seconds": POSITION_ID_PER_SECONDS},
    )
