"""Qwen3-Omni's clips are encoded as if alone, whatever else the micro-batch holds (``_audio.encode_audio``).

transformers pads every audio chunk of a batch to the longest one; a stride-2 convolution's output just past
a chunk's end then reads the chunk's last real frame, where the chunk alone would end, and the next
convolution carries it into the real frames. With clips of 38 and 63 frames (one chunk each) the shorter
clip's features differ between the batch and the clip alone in transformers' tower (checked, so this test
can fail), not in mm's; a clip of several chunks (250 frames) beside a short one as well; and the whole
model's logits on a micro-batch of two samples equal each sample's logits alone (fp32)."""

from __future__ import annotations

import pytest
import torch
from _audio import AUDIO_CONFIG, MOE_TEXT, TEXT_CONFIG, VISION_CONFIG
from transformers.models.qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

from mm_models_qwen._audio import encode_audio
from mm_models_qwen.qwen3_omni_moe import Qwen3OmniMoeThinkerForTraining

VOCAB, AUDIO, AUDIO_START = 64, 60, 59


@pytest.fixture(scope="module")
def model() -> Qwen3OmniMoeThinkerForTraining:
    config = Qwen3OmniMoeThinkerConfig(
        audio_config=AUDIO_CONFIG,
        vision_config=VISION_CONFIG,
        text_config={"vocab_size": VOCAB, **TEXT_CONFIG, **MOE_TEXT},
        audio_token_id=AUDIO,
        audio_start_token_id=AUDIO_START,
        image_token_id=61,
        video_token_id=62,
        vision_start_token_id=63,
    )
    torch.manual_seed(0)
    built: Qwen3OmniMoeThinkerForTraining = Qwen3OmniMoeThinkerForTraining._from_config(config).eval()
    tower = built.model.audio_tower
    with torch.no_grad():
        for conv in (tower.conv2d1, tower.conv2d2, tower.conv2d3):  # weights of a trained stem's scale
            conv.weight.normal_(0.0, 0.3)
            conv.bias.normal_(0.0, 0.1)
    return built


def _clips(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    features = torch.zeros(len(lengths), 128, max(lengths))
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        features[i, :, :n] = torch.randn(128, n)
        mask[i, :n] = 1
    return features, mask


def _alone(model, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rows = []
    for i in range(len(features)):
        n = int(mask[i].sum())
        rows.append(
            model.model.get_audio_features(features[i : i + 1, :, :n], mask[i : i + 1, :n]).last_hidden_state
        )
    return torch.cat(rows)


@pytest.mark.parametrize("lengths", [[63, 38], [250, 40]])
@torch.no_grad()
def test_each_clip_is_encoded_as_alone(model, lengths):
    features, mask = _clips(lengths)
    alone = _alone(model, features, mask)
    torch.testing.assert_close(
        encode_audio(model.model.audio_tower, features, mask), alone, rtol=1e-5, atol=1e-5
    )
    if lengths == [63, 38]:  # transformers' own batched tower does not give the clip alone's features
        batched = model.model.get_audio_features(features, mask).last_hidden_state
        assert (batched - alone).abs().max() > 1e-2 * alone.abs().max()


def _sample(n_frames: int, text: list[int]) -> list[int]:
    return [
        *text[:3],
        AUDIO_START,
        *[AUDIO] * int(_get_feat_extract_output_lengths(torch.tensor(n_frames))),
        *text[3:],
    ]


@torch.no_grad()
def test_a_micro_batch_gives_each_sample_its_logits_alone(model):
    lengths = [63, 38]
    features, mask = _clips(lengths)
    ids = [_sample(n, [5 + i, 7, 9, 11 + i, 13, 17, 19]) for i, n in enumerate(lengths)]
    width = max(len(x) for x in ids)
    input_ids = torch.tensor([x + [0] * (width - len(x)) for x in ids])
    attention = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    both = model(
        input_ids=input_ids, attention_mask=attention, input_features=features, feature_attention_mask=mask
    )
    for i, n in enumerate(lengths):
        one = model(
            input_ids=torch.tensor([ids[i]]),
            attention_mask=torch.ones(1, len(ids[i]), dtype=torch.long),
            input_features=features[i : i + 1, :, :n],
            feature_attention_mask=mask[i : i + 1, :n],
        )
        torch.testing.assert_close(both.logits[i, : len(ids[i])], one.logits[0], rtol=1e-5, atol=1e-5)
