"""vlm_sft with videos (Qwen3-VL): ``videos`` records, sizes from the container header (nothing decoded at
preparation), the token layout of transformers' Qwen3VLProcessor, bad videos named (file:line) or skipped."""

from __future__ import annotations

import functools
import json
import wave
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mm_core.errors import DataError
from mm_data_vlm import sft as sft_module
from mm_data_vlm.collators import VLMCollator
from mm_data_vlm.processor_build import build_qwen_vl_processor
from mm_data_vlm.records import RecordError, read_media
from mm_data_vlm.sft import VLMSFTDataset
from mm_data_vlm.videos import VideoHeader, probe_video, write_video

#: name -> (frames, height, width, frames a second)
CLIPS = {"a": (8, 56, 56, 4.0), "b": (12, 56, 84, 8.0), "c": (5, 28, 56, 2.0), "long": (40, 28, 28, 8.0)}


def turn(question: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("vlm_videos")
    (root / "v").mkdir()
    rng = np.random.default_rng(0)
    for name, (t, h, w, fps) in CLIPS.items():
        write_video(root / "v" / f"{name}.mp4", rng.integers(0, 255, (t, h, w, 3), dtype=np.uint8), fps)
    Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)).save(root / "v" / "img.png")
    (root / "v" / "garbage.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video" * 4)
    good = (root / "v" / "a.mp4").read_bytes()
    (root / "v" / "cut.mp4").write_bytes(good[: len(good) // 2])
    with wave.open(str(root / "v" / "sound.wav"), "wb") as f:  # a container with no video stream
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(8000)
        f.writeframes(b"\x00\x00" * 800)
    records = [
        {"messages": turn("<video>Which way?", "left"), "videos": ["v/a.mp4"]},
        {"messages": turn("<image>and<video>?", "up"), "images": ["v/img.png"], "video": "v/b.mp4"},
        {"messages": turn("<video><video>Two?", "down"), "videos": ["v/c.mp4", "v/a.mp4"]},
        {"messages": turn("<video>Garbage?", "no"), "videos": ["v/garbage.mp4"]},
        {"messages": turn("<video>Sound?", "no"), "videos": ["v/sound.wav"]},
        {"messages": turn("<video>Long?", "no"), "videos": ["v/long.mp4"]},
        {"messages": turn("<video>Cut?", "no"), "videos": ["v/cut.mp4"]},
        {"messages": turn("<image>Image only", "yes"), "images": ["v/img.png"]},
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "good.jsonl").write_text("".join(json.dumps(records[i]) + "\n" for i in (0, 1, 2, 7)))
    texts = ["Which way? left up down Two? no yes Image only"] * 5
    build_qwen_vl_processor(texts, root / "proc", vocab_size=300, videos={})
    return root


def make(root: Path, on_error: str = "raise", dataset: str = "train.jsonl", **pre) -> VLMSFTDataset:
    basic = {
        "dataset_dir": str(root),
        "dataset": dataset,
        "cutoff_len": 512,
        "cache_dir": str(root / "cache"),
    }
    pre = {"model_name_or_path": str(root / "proc"), "video_max_source_frames": 30, **pre}
    return VLMSFTDataset(basic, pre, SimpleNamespace(on_error=on_error))


def test_video_records_are_read(tmp_path):
    record = {"messages": turn("<video>x", "y"), "videos": "a.mp4", "images": []}
    assert read_media(record, str(tmp_path)) == (turn("<video>x", "y"), [], [tmp_path / "a.mp4"])
    assert read_media({"messages": turn("x", "y"), "video": ["b.mp4"]}, None)[2] == [Path("b.mp4")]
    with pytest.raises(RecordError, match="frame images"):
        read_media({"messages": turn("<video>x", "y"), "videos": [["f0.png", "f1.png"]]}, None)
    with pytest.raises(RecordError, match='"videos" must be a list of video paths'):
        read_media({"messages": turn("<video>x", "y"), "videos": [3]}, None)


def test_header_gives_frames_rate_and_size(root):
    for name, (t, h, w, fps) in CLIPS.items():
        assert probe_video(root / "v" / f"{name}.mp4", max_source_frames=None) == VideoHeader(t, fps, w, h)


def test_prepared_lengths_come_from_headers_and_match_the_samples(root, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a video was decoded at preparation")

    monkeypatch.setattr(sft_module, "load_frames", never)
    ds = make(root, dataset="good.jsonl")  # prepares: sizes from the headers only
    lengths = ds.sample_lengths()
    monkeypatch.undo()
    samples = [ds[i] for i in range(len(ds))]
    assert [len(s["input_ids"]) for s in samples] == lengths.tolist()
    merge = 4
    for s in samples:
        video = (s["input_ids"] == ds.processor.video_token_id).sum()
        grid = s.get("video_grid_thw", torch.zeros(0, 3, dtype=torch.long))
        assert int(video) == int(grid.prod(-1).sum()) // merge
        assert len(s.get("pixel_values_videos", [])) == int(grid.prod(-1).sum())
        assert torch.equal(s["mm_token_type_ids"] == 2, s["input_ids"] == ds.processor.video_token_id)
        assert (s["labels"][s["mm_token_type_ids"] > 0] == -100).all()
    # a: 8 frames at 4 per second = 2 s -> 4 frames at the folder's 2 per second -> 2 groups of 2
    assert samples[0]["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert samples[2]["video_grid_thw"].shape == (2, 3)
    batch = VLMCollator({}, ds)(samples)
    assert batch["video_grid_thw"].shape == (4, 3) and batch["image_grid_thw"].shape == (2, 3)
    # video_fps and video_max_frames replace the folder's own
    fewer = make(root, dataset="good.jsonl", video_fps=1.0, video_max_frames=4)
    assert fewer[0]["video_grid_thw"].tolist() == [[2, 4, 4]]  # 2 s at 1 a second -> the minimum, 4
    assert fewer[1]["video_grid_thw"][0, 0] == 2 and samples[1]["video_grid_thw"][0, 0] == 2


def test_placeholder_is_transformers_token_layout(root):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    ds = make(root, dataset="good.jsonl")
    videos = ds.processor.videos
    assert videos is not None
    for name, (t, h, w, fps) in CLIPS.items():
        plan = videos.plan(VideoHeader(t, fps, w, h))
        # transformers' own frame sampling and patch count for this clip
        meta = VideoMetadata(total_num_frames=t, fps=fps, width=w, height=h)
        assert list(plan.indices) == videos.processor.sample_frames(meta).tolist()
        patches = videos.processor.get_num_of_video_patches(len(plan.indices), h, w)
        assert int(np.prod(plan.grid)) == patches
        meta.frames_indices = list(plan.indices)
        # Qwen3VLProcessor.replace_video_token needs no tokenizer or image processor: called on what it reads
        fields = {
            "video_processor": videos.processor,
            "video_token": "<|video_pad|>",
            "vision_start_token": "<|vision_start|>",
            "vision_end_token": "<|vision_end|>",
        }
        stand_in = SimpleNamespace(**fields)
        stand_in._calculate_timestamps = functools.partial(Qwen3VLProcessor._calculate_timestamps, stand_in)
        expected = Qwen3VLProcessor.replace_video_token(
            stand_in, {"video_grid_thw": torch.tensor([plan.grid]), "video_metadata": [meta]}, 0
        )
        assert plan.text == expected, name


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (4, r"cannot read video .*garbage\.mp4"),
        (5, r"sound\.wav has no video stream"),
        (6, r"long\.mp4 has 40 frames .*\.video_max_source_frames = 30; refused before decoding"),
        (7, r"cut\.mp4"),
    ],
)
def test_bad_video_is_named_with_its_line(root, line, message):
    ds = make(root)
    with pytest.raises(DataError, match=rf"train\.jsonl:{line}: .*{message}"):
        ds[line - 1]


def test_bad_videos_are_skipped_and_counted(root):
    ds = make(root, "skip")
    sample = ds[3]  # lines 4-7 are bad: the next good record is line 8 (image only)
    assert sample["sample_id"] == 7 and sample["skipped_samples"] == 4
    assert len(ds.skipped) == 4 and "garbage.mp4" in ds.skipped[0]
    assert "pixel_values_videos" not in sample
