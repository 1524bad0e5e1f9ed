"""The vocoder GAN's losses (per-sample TPR, least squares, feature matching, mel) and the YIN pitch target,
and the ``cosyvoice_vocoder`` task's settings checks."""

from __future__ import annotations

import math
import re

import pytest
import torch

from mm_core.config.loader import validate_config
from mm_core.errors import ConfigError
from mm_core.tasks import TaskContext
from mm_models_cosyvoice import vocoder_losses as losses
from mm_models_cosyvoice.pitch import estimate_f0
from mm_models_cosyvoice.vocoder_task import CosyVoiceVocoderTask


def official_tpr(a: torch.Tensor, b: torch.Tensor, tau: float) -> torch.Tensor:
    """HiFTNet's TPR of one score map over the whole batch: min(τ, mean of ((a − b) − m)² where a < b + m), in
    float64, as float32. (In float32 the rounding of ``b + m`` puts the median position itself into the mean
    or not: the first sample here has 6 positions in its second map's mean instead of 5.)"""
    a, b = a.double(), b.double()
    m = torch.median(a - b)
    rel = (((a - b) - m) ** 2)[a < b + m].mean()
    return (tau - torch.relu(tau - rel)).float()


def test_tpr_is_the_official_loss_per_sample_averaged():
    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(2, 1, 7, 3, generator=gen) * 0.1, torch.randn(2, 1, 11, generator=gen) * 0.1]
    b = [torch.randn(2, 1, 7, 3, generator=gen) * 0.1, torch.randn(2, 1, 11, generator=gen) * 0.1]
    tau = 0.04
    for i in range(2):  # one sample: exactly the official loss, summed over the sub-discriminators
        want = sum(official_tpr(x[i : i + 1], y[i : i + 1], tau) for x, y in zip(a, b))
        torch.testing.assert_close(
            losses.tpr([x[i : i + 1] for x in a], [y[i : i + 1] for y in b], tau), want
        )
    per_sample = [losses.tpr([x[i : i + 1] for x in a], [y[i : i + 1] for y in b], tau) for i in range(2)]
    torch.testing.assert_close(losses.tpr(a, b, tau), (per_sample[0] + per_sample[1]) / 2)
    far = [x * 100 for x in a]
    assert losses.tpr(far, b, tau).item() == pytest.approx(2 * tau)  # truncated at τ per sub-discriminator


def test_tpr_is_continuous_where_differences_tie_the_median():
    """Two differences tie the (lower) median: the official mean drops the tied one from its count and jumps
    from 0.5 to 1 where the tie forms; here it stays the mean over the two lowest-ranked positions."""
    b = [torch.zeros(1, 1, 5)]
    tie = [torch.tensor([[[0.0, 1.0, 1.0, 2.0, 3.0]]])]
    near = [torch.tensor([[[0.0, 1.0 - 1e-6, 1.0, 2.0, 3.0]]])]
    assert official_tpr(tie[0], b[0], 10.0).item() == pytest.approx(1.0)
    assert official_tpr(near[0], b[0], 10.0).item() == pytest.approx(0.5)
    assert losses.tpr(tie, b, 10.0).item() == pytest.approx(0.5)
    assert losses.tpr(near, b, 10.0).item() == pytest.approx(0.5)


def test_least_squares_feature_matching_and_mel():
    ones, zeros = [torch.ones(2, 1, 5)], [torch.zeros(2, 1, 5)]
    assert losses.discriminator_adversarial(ones, zeros).item() == 0.0
    assert losses.discriminator_adversarial(zeros, ones).item() == 2.0
    assert losses.generator_adversarial(ones).item() == 0.0
    assert losses.generator_adversarial(zeros * 2).item() == 2.0
    assert (
        losses.feature_matching(
            [[torch.ones(2, 3), torch.ones(2, 4)]], [[torch.zeros(2, 3), torch.ones(2, 4)]]
        ).item()
        == 2.0
    )
    wave = torch.sin(torch.arange(1920) / 10.0).repeat(2, 1) * 0.3
    assert losses.mel_l1(wave, wave).item() == 0.0
    assert losses.mel_l1(wave, wave * 0.5).item() == pytest.approx(math.log(2), rel=1e-3)


def test_yin_pitch_per_frame():
    t = torch.arange(24000) / 24000
    tones = [
        0.4 * torch.sin(2 * math.pi * f * t) + 0.1 * torch.sin(2 * math.pi * 2 * f * t)
        for f in (80.0, 220.0, 550.0)
    ]
    chirp = 0.4 * torch.sin(2 * math.pi * (100 * t + 100 * t**2))  # 100 Hz rising to 300 Hz
    noise = 0.1 * torch.randn(24000, generator=torch.Generator().manual_seed(0))
    waves = torch.stack([*tones, chirp, torch.zeros(24000), noise])
    f0 = estimate_f0(waves)
    assert f0.shape == (6, 50) and f0.dtype == torch.float32
    for row, f in zip(f0[:3], (80.0, 220.0, 550.0)):
        torch.testing.assert_close(row[1:-1], torch.full((48,), f), rtol=0.01, atol=0)
    centres = (torch.arange(50) * 480 + 240) / 24000
    torch.testing.assert_close(f0[3, 2:-2], 100 + 200 * centres[2:-2], rtol=0.02, atol=0)
    assert bool((f0[4] == 0).all()) and bool((f0[5] == 0).all())  # silence and noise are unvoiced
    assert torch.equal(estimate_f0(waves[3:4]), f0[3:4])  # per sample: the batch does not matter


def _task(param: dict) -> CosyVoiceVocoderTask:
    data = {
        "dataset_param": {"dataset_type": "cosyvoice_speech", "basic_parameters": {"dataset": "store"}},
        "dataloader_param": {"collate_param": {"collator_id": "cosyvoice_vocoder"}},
    }
    model = {"model_id": "cosyvoice3_hift", "from_scratch": True}
    training = {"task": "cosyvoice_vocoder", "task_param": param, "train_iters": 1}
    cfg = validate_config({"data": data, "model": model, "training": training})
    return CosyVoiceVocoderTask(TaskContext(cfg=cfg, state=None, load_path=None))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("param", "message"),
    [
        (
            {"disc_lr": 1e-4},
            "training.task_param.disc_lr: unknown key; accepted: discriminator, discriminator_lr",
        ),
        ({"mel_weight": -1}, "training.task_param.mel_weight: got -1; expected a number >= 0"),
        ({"f0_target": "pyworld"}, "training.task_param.f0_target: got 'pyworld'; accepted: estimate, none"),
        ({"discriminator": [1]}, "training.task_param.discriminator: got [1]; expected a mapping"),
        ({"discriminator": {"mpd_period": [2]}}, "training.task_param.discriminator.mpd_period: unknown key"),
    ],
)
def test_task_settings_are_checked_before_anything_is_built(param, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _task(param).build()


def test_without_a_pitch_loss_the_pitch_predictor_must_be_frozen():
    from mm_models_cosyvoice.hift import HiFTConfig, HiFTGenerator
    from mm_models_cosyvoice.vocoder_task import WEIGHTS

    task = _task({"f0_target": "none"})
    task.weights, task.f0_target = dict(WEIGHTS), "none"
    task.generator = HiFTGenerator(HiFTConfig.from_overrides({"base_channels": 16, "f0_cond_channels": 8}))
    with pytest.raises(ConfigError, match=re.escape("freeze it with model.freeze: [f0_predictor]")):
        task._check_f0_predictor()
    for p in task.generator.f0_predictor.parameters():
        p.requires_grad_(False)
    task._check_f0_predictor()
    assert not task.f0_on
    task.f0_target = "estimate"
    task._check_f0_predictor()
    assert task.f0_on
