"""The vocoder's discriminator (``cosyvoice3_hift_disc``): eight sub-discriminators with their score and
feature maps, the official structure and names, loading the legacy weight-norm names, checked overrides."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from mm_core.errors import ConfigError, DataError
from mm_core.models import ModelArguments
from mm_models_cosyvoice.discriminator import DiscriminatorConfig, HiFTDiscriminator

TINY = {"mpd_channels": [4, 8, 8, 8, 8], "mrd_channels": 4}


def tiny(seed: int = 0) -> HiFTDiscriminator:
    torch.manual_seed(seed)
    return HiFTDiscriminator(DiscriminatorConfig.from_overrides(TINY))


def test_scores_and_feature_maps_of_every_sub_discriminator():
    model = tiny()
    wave = torch.randn(3, 1920) * 0.3
    out = model(waveform=wave)
    assert len(out.scores) == len(out.features) == 8  # 5 periods, then 3 resolutions
    for score, fmap in zip(out.scores, out.features):
        assert len(fmap) == 6 and fmap[-1] is score and score.shape[:2] == (3, 1)
    # a period discriminator folds the (reflect-padded) wave into [L / p, p] and strides 3 in time 4 times
    for p, score, fmap in zip((2, 3, 5, 7, 11), out.scores, out.features):
        rows = -(-1920 // p)
        assert score.shape[-1] == p and fmap[0].shape == (3, 4, -(-rows // 3), p)
    # a spectrogram discriminator sees [frames, bins] and strides 2 in frequency 3 times
    for (n_fft, hop), score in zip(((1024, 120), (2048, 240), (512, 50)), out.scores[5:]):
        bins = n_fft // 2 + 1
        for _ in range(3):
            bins = (bins - 1) // 2 + 1
        assert score.shape[-2:] == (1920 // hop + 1, bins)
    sum(s.mean() for s in out.scores).backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(DataError, match=r"waveform: expected \[batch, samples\]"):
        model(waveform=wave[:, None])


def test_official_structure_and_names():
    with torch.device("meta"):
        full = HiFTDiscriminator()
    shapes = {k: tuple(v.shape) for k, v in full.state_dict().items()}
    channels = (1, 32, 128, 512, 1024, 1024)
    for d in range(5):
        for i in range(5):
            v = shapes[f"mpd.discriminators.{d}.convs.{i}.parametrizations.weight.original1"]
            assert v == (channels[i + 1], channels[i], 5, 1)
        assert shapes[f"mpd.discriminators.{d}.conv_post.parametrizations.weight.original1"] == (
            1,
            1024,
            3,
            1,
        )
    for d in range(3):
        assert shapes[f"mrd.discriminators.{d}.discriminators.0.parametrizations.weight.original1"] == (
            32,
            1,
            3,
            9,
        )
        for i in (1, 2, 3):
            assert shapes[f"mrd.discriminators.{d}.discriminators.{i}.parametrizations.weight.original1"] == (
                32,
                32,
                3,
                9,
            )
        assert shapes[f"mrd.discriminators.{d}.discriminators.4.parametrizations.weight.original1"] == (
            32,
            32,
            3,
            3,
        )
        assert shapes[f"mrd.discriminators.{d}.out.parametrizations.weight.original0"] == (1, 1, 1, 1)
    assert len(shapes) == (5 * 6 + 3 * 6) * 3  # every convolution: bias, g, v
    assert set(tiny().state_dict()) == set(shapes)


def test_loads_legacy_weight_norm_names_from_a_training_checkpoint(tmp_path):
    source = tiny(seed=3)
    legacy = {}
    for key, value in source.state_dict().items():
        key = key.replace("parametrizations.weight.original0", "weight_g")
        key = key.replace("parametrizations.weight.original1", "weight_v")
        legacy[f"discriminator.{key}"] = value.contiguous()
    save_file(legacy, str(tmp_path / "model.safetensors"))
    args = ModelArguments(
        model_id="cosyvoice3_hift_disc", model_name_or_path=str(tmp_path), config_overrides=TINY
    )
    loaded = HiFTDiscriminator.from_pretrained(args)
    wave = torch.randn(1, 1920) * 0.3
    with torch.no_grad():
        for a, b in zip(source(wave).scores, loaded(wave).scores):
            assert torch.equal(a, b)


def test_meta_build_and_init_weights():
    with torch.device("meta"):
        model = HiFTDiscriminator(DiscriminatorConfig.from_overrides(TINY))
    model.to_empty(device="cpu")
    for t in [*model.parameters(), *model.buffers()]:
        t.data.fill_(float("nan"))
    model.init_weights()
    assert not any(bool(torch.isnan(t).any()) for t in [*model.parameters(), *model.buffers()])
    assert torch.equal(model.mrd.discriminators[2].window, torch.hann_window(240))


def test_overrides_are_checked():
    with pytest.raises(ConfigError, match=r"training.task_param.discriminator.periods: unknown key"):
        DiscriminatorConfig.from_overrides({"periods": [2]}, "training.task_param.discriminator")
    with pytest.raises(ConfigError, match=r"mpd_channels: 5 channel counts"):
        DiscriminatorConfig.from_overrides({"mpd_channels": [4, 8]})
    with pytest.raises(ConfigError, match=r"mrd_resolutions: each entry is \[n_fft, hop, window\]"):
        DiscriminatorConfig.from_overrides({"mrd_resolutions": [[512, 50, 600]]})
    config = DiscriminatorConfig.from_overrides(
        {"mpd_periods": [2], "mrd_resolutions": [[256, 64, 256]], **TINY}
    )
    assert len(HiFTDiscriminator(config)(torch.randn(2, 960)).scores) == 2
