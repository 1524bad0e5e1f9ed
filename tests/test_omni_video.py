"""Qwen3-Omni with videos and their sound (``audio_sft`` with ``use_audio_in_video: true``): the token
sequence, video grid, seconds per grid, pixel layout and audio features equal what transformers' own
``Qwen3OmniMoeProcessor`` makes of the same frames and sound; token counts come from the container headers
(nothing decoded at preparation); a silent or broken video is a DataError naming ``file:line``, which
``on_error: skip`` counts; mm's thinker gives transformers' logits on such a batch; and 2 FSDP ranks train the
same model as 1 process on videos with sound, clips and images mixed (gloo, fp32, 3 steps of 2 micro-batches:
losses, router losses and gradient norms within 1e-5 relative, token counts exactly)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from _mm import assert_close_series, train_layouts
from _omni_video import VIDEO_PARAMS, build_processor, make_omni_video_assets, write_clips

from mm_core.errors import DataError
from mm_data_audio import media as media_module
from mm_data_audio.collators import AudioCollator
from mm_data_audio.sft import AudioSFTDataset

STEPS = 3
LAYOUTS = [
    ("single", 1, ["training.micro_batch_size=4"]),
    ("fsdp2", 2, ["training.micro_batch_size=2"]),
]
#: the tokens transformers' processor names (a published Qwen3-Omni tokenizer's extra special tokens)
HF_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}


def turn(question: str, answer: str = "yes") -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    import soundfile as sf
    from PIL import Image

    root = tmp_path_factory.mktemp("omni_video")
    write_clips(root / "v")
    rng = np.random.default_rng(3)
    sf.write(root / "v" / "speech.wav", (0.1 * rng.standard_normal(13000)).astype(np.float32), 16000)
    Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8)).save(root / "v" / "img.png")
    (root / "v" / "garbage.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video" * 4)
    records = [
        {"messages": turn("<video>What is seen and heard?"), "videos": ["v/a.mp4"]},
        {"messages": turn("<audio><image>and<video>?"), "audios": ["v/speech.wav"], "images": ["v/img.png"],
         "videos": ["v/b.mp4"]},
        {"messages": turn("<video><video>Two?"), "videos": ["v/c.mp4", "v/a.mp4"]},
        {"messages": turn("<video>Silent?"), "videos": ["v/silent.mp4"]},
        {"messages": turn("<video>Garbage?"), "videos": ["v/garbage.mp4"]},
        {"messages": turn("<audio>Only sound"), "audios": ["v/speech.wav"]},
    ]  # fmt: skip
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "good.jsonl").write_text("".join(json.dumps(records[i]) + "\n" for i in (0, 1, 2, 5)))
    build_processor(root, ["What is seen and heard? and Two? Silent? Garbage? Only sound yes"] * 5)
    return root


def make(root: Path, on_error: str = "raise", dataset: str = "train.jsonl", **pre) -> AudioSFTDataset:
    basic = {"dataset_dir": str(root), "dataset": dataset, "cutoff_len": 512}
    pre = {"model_name_or_path": str(root / "processor"), **VIDEO_PARAMS, **pre}
    return AudioSFTDataset(basic, pre, SimpleNamespace(on_error=on_error))


def hf_processor(folder: Path):
    """transformers' Qwen3OmniMoeProcessor from the folder's tokenizer, feature extractor and image processor.
    Its video processor (Qwen2VLVideoProcessor) needs torchvision, which is not installed: Qwen3-VL's, with
    the same patch layout, patchifies the frames mm sampled and resized, rescaled but not normalised
    (normalising needs torchvision too); the processor's own code makes everything else."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.models.whisper import WhisperFeatureExtractor

    class Processor(Qwen3OmniMoeProcessor):
        def check_argument_for_proper_class(self, name, argument):
            # transformers resolves BaseVideoProcessor only with torchvision installed
            return (
                type(argument)
                if name == "video_processor"
                else super().check_argument_for_proper_class(name, argument)
            )

    config = json.loads((folder / "preprocessor_config.json").read_text())
    video = Qwen3VLVideoProcessor(
        patch_size=config["patch_size"],
        temporal_patch_size=config["temporal_patch_size"],
        merge_size=config["merge_size"],
        do_resize=False,
        do_normalize=False,
        do_convert_rgb=False,
        do_sample_frames=False,
        cap_pixels_per_frame=False,
    )
    return Processor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
        video_processor=video,
        feature_extractor=WhisperFeatureExtractor.from_pretrained(folder),
        tokenizer=AutoTokenizer.from_pretrained(folder, extra_special_tokens=HF_TOKENS),
    )


@pytest.mark.parametrize("index", [0, 1, 2])
def test_token_sequence_equals_transformers_processor(root, index):
    from PIL import Image

    from mm_data_audio.images import load_image
    from mm_data_audio.video_audio import load_track
    from mm_data_vlm.videos import load_frames

    ds = make(root, dataset="good.jsonl")
    sample, record = ds[index], ds.records[index]
    media = ds.media.headers(record)
    videos = ds.processor.videos
    assert record is not None and videos is not None
    frames, sounds = [], []
    for path, header, plan, track in zip(record.videos, media.videos, media.plans, media.tracks):
        raw = load_frames(path, header, plan.indices)
        size = (plan.width, plan.height)
        frames.append(np.stack([np.asarray(Image.fromarray(f).resize(size, Image.BICUBIC)) for f in raw]))
        sounds.append(load_track(path, track, 16000))
    clips = [np.asarray(ds.media.load(record, media)[0][0])] if record.audios else []
    messages = [
        {"role": m["role"], "content": m["content"]
         .replace("<audio>", "<|audio_start|><|audio_pad|><|audio_end|>")
         .replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
         .replace("<video>", "<|vision_start|><|video_pad|><|vision_end|>")}
        for m in record.messages
    ]  # fmt: skip
    hf = hf_processor(root / "processor")
    text = hf.tokenizer.apply_chat_template(messages, tokenize=False)
    # the standalone clip first when the text has it first (record 1: <audio> before <video>)
    audio, slots = clips + sounds, [None] * len(clips) + list(range(len(sounds)))
    out = hf(
        text=[text],
        images=[load_image(p) for p in record.images] or None,
        videos=frames,
        audio=audio,
        audio_from_video_indices=slots,
        load_audio_from_video=True,
        fps=VIDEO_PARAMS["video_fps"],
        return_tensors="pt",
    )
    assert sample["input_ids"].tolist() == out["input_ids"][0].tolist()
    assert torch.equal(sample["video_grid_thw"], out["video_grid_thw"])
    assert sample["video_second_per_grid"].tolist() == out["video_second_per_grid"].tolist()
    if len(audio) == 1:  # one clip: the processor pads no waveform (mm featurises every clip alone)
        assert torch.equal(sample["feature_attention_mask"], out["feature_attention_mask"])
        torch.testing.assert_close(sample["input_features"], out["input_features"])
    # the pixels: the same patches, normalised by the processor's mean and std
    mean = torch.tensor(videos.processor.image_mean).view(1, 3, 1)
    std = torch.tensor(videos.processor.image_std).view(1, 3, 1)
    expected = (out["pixel_values_videos"].view(-1, 3, 2 * 14 * 14) - mean) / std
    torch.testing.assert_close(sample["pixel_values_videos"].view(-1, 3, 2 * 14 * 14), expected)
    assert sample["use_audio_in_video"] is True


def test_plan_follows_the_video_processor_rules(root):
    from mm_data_audio.errors import EncodeError
    from mm_data_audio.omni_videos import interleave
    from mm_data_vlm.videos import VideoHeader

    videos = make(root, dataset="good.jsonl").processor.videos
    assert videos is not None
    # a: 8 frames at 4 a second = 2 s -> 4 frames at 2 a second, every other one; 56x56 -> 4x4 patches
    plan = videos.plan(VideoHeader(8, 4.0, 56, 56))
    assert plan.indices == (0, 2, 4, 6) and plan.grid == (2, 4, 4) and (plan.height, plan.width) == (56, 56)
    # 40 frames at 8 a second: 10 frames, at most video_max_frames (6: a multiple of the 2-frame groups)
    few = make(root, dataset="good.jsonl", video_max_frames=7).processor.videos
    assert few is not None and few.plan(VideoHeader(40, 8.0, 56, 56)).indices == (0, 6, 13, 20, 26, 33)
    # one frame is fewer than a temporal group
    with pytest.raises(EncodeError, match="at least 2"):
        videos.plan(VideoHeader(1, 4.0, 56, 56))
    # 2 groups one second apart (13 position ids) and 30 audio tokens: V*4, A*13, V*4, A*13 then the rest
    expected = "<|video_pad|>" * 4 + "<|audio_pad|>" * 13 + "<|video_pad|>" * 4 + "<|audio_pad|>" * 17
    assert interleave((2, 4, 4), 2, 1.0, 13.0, 30) == expected
    # a tie goes to the video token; audio shorter than the video ends early
    tie = "<|video_pad|>" + "<|audio_pad|>" * 2 + "<|video_pad|>" * 2
    assert interleave((3, 2, 2), 2, 0.5, 4.0, 2) == tie


def test_token_counts_come_from_headers(root, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a video or its sound was decoded to count tokens")

    ds = make(root, dataset="good.jsonl")
    monkeypatch.setattr(media_module, "load_frames", never)
    monkeypatch.setattr(media_module, "load_track", never)
    lengths = ds.sample_lengths()
    monkeypatch.undo()
    samples = [ds[i] for i in range(len(ds))]
    assert [len(s["input_ids"]) for s in samples] == lengths.tolist()
    batch = AudioCollator({}, ds)(samples)
    # 4 videos (a, b, c, a), each with its sound among the clips: 1 + 1 speech clips, in text order
    assert batch["video_grid_thw"].shape == (4, 3) and batch["input_features"].shape[0] == 6
    assert batch["video_second_per_grid"] == [1.0] * 4 and batch["use_audio_in_video"] is True
    audio_id = ds.processor.audio_token_id
    assert int((batch["input_ids"] == audio_id).sum()) == ds.format.feature_rows(batch)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (4, r"silent\.mp4 has no audio track, but .*use_audio_in_video is true"),
        (5, r"cannot read video .*garbage\.mp4"),
    ],
)
def test_bad_video_is_named_with_its_line(root, line, message):
    ds = make(root)
    with pytest.raises(DataError, match=rf"train\.jsonl:{line}: .*{message}"):
        ds[line - 1]


def test_bad_videos_are_skipped_and_counted(root):
    ds = make(root, "skip")
    sample = ds[3]  # lines 4 and 5 are bad: the next good record is line 6 (a clip only)
    assert sample["sample_id"] == 5 and sample["skipped_samples"] == 2
    assert ds.skipped == 2 and "silent.mp4" in (ds.first_skip or "")
    assert "pixel_values_videos" not in sample
    assert ds.sample_lengths()[3] == len(sample["input_ids"])


def test_without_sound_a_video_is_vision_tokens_only(root):
    ds = make(root, use_audio_in_video=False)
    sample = ds[3]  # the silent video is fine without its sound
    ids = sample["input_ids"]
    assert int((ids == ds.processor.audio_token_id).sum()) == 0 and "use_audio_in_video" not in sample
    assert int((ids == ds.processor.video_token_id).sum()) == int(sample["video_grid_thw"].prod()) // 4


def test_thinker_with_video_and_sound_equals_transformers(tmp_path):
    from transformers import AutoConfig
    from transformers.models.qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

    from mm_models_qwen.qwen3_omni_moe import Qwen3OmniMoeThinkerForTraining

    cfg = yaml.safe_load(make_omni_video_assets(tmp_path).read_text())
    param = cfg["data"]["dataset_param"]
    ds = AudioSFTDataset(param["basic_parameters"], param["preprocess_parameters"], SimpleNamespace())
    # one clip (the video's sound) per forward: transformers pads several clips together, mm does not
    batch = AudioCollator({}, ds)([ds[0], ds[3], ds[6]])
    assert batch["input_features"].shape[0] == 1 and "pixel_values" in batch
    batch = {k: v for k, v in batch.items() if k not in ("sample_id", "skipped_samples")}
    config = AutoConfig.from_pretrained(tmp_path / "model")
    torch.manual_seed(0)
    reference = Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()
    ours = Qwen3OmniMoeThinkerForTraining(config).eval()
    ours.load_state_dict(reference.state_dict())
    with torch.no_grad():
        expected = reference(**{**batch, "video_second_per_grid": torch.tensor([1.0])}).logits
        got = ours(**batch).logits
        no_mask = ours(**{k: v for k, v in batch.items() if k != "attention_mask"}).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(no_mask[real], expected[real], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cfg = make_omni_video_assets(tmp_path_factory.mktemp("omni_video_assets"))
    common = [f"training.train_iters={STEPS}", "training.gradient_accumulation_steps=2"]
    return train_layouts(tmp_path_factory, cfg, LAYOUTS, common=common, timeout=180)


@pytest.mark.slow
def test_fsdp2_with_videos_sound_clips_and_images_matches_single_process(runs):
    ref, got = runs["single"], runs["fsdp2"]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "aux_loss"):
        assert_close_series([r[key] for r in ref], [r[key] for r in got], 1e-5, f"fsdp2 {key}")
    assert [r["tokens"] for r in ref] == [r["tokens"] for r in got]
    assert ref[-1]["loss"] < ref[0]["loss"]
