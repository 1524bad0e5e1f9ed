"""mm_models_video.flow_matching: the σ distributions (shift, logit-normal, the cut to one expert's range),
per-sample draws from a seed, and the loss."""

from __future__ import annotations

import math

import pytest
import torch

from mm_core.errors import ConfigError
from mm_models_video.flow_matching import FlowMatching

V = torch.linspace(0.0005, 0.9995, 2000, dtype=torch.float64)


def test_uniform_without_shift_is_the_uniform_draw() -> None:
    flow = FlowMatching(timestep_sampling="uniform")
    assert torch.allclose(flow.sigma_of(V), V)


@pytest.mark.parametrize("sampling", ["uniform", "logit_normal"])
@pytest.mark.parametrize("shift", [1.0, 5.0])
def test_quantile_inverts_the_distribution_function(sampling: str, shift: float) -> None:
    flow = FlowMatching(timestep_sampling=sampling, shift=shift, logit_mean=0.3, logit_std=0.8)
    sigma = flow.quantile(V)
    assert torch.allclose(flow.cdf(sigma), V, atol=1e-9)
    assert bool((sigma[1:] > sigma[:-1]).all())  # monotone


def test_shift_moves_the_mass_to_high_noise() -> None:
    plain, shifted = FlowMatching(shift=1.0), FlowMatching(shift=5.0)
    assert float(shifted.sigma_of(V).median()) > 0.8 > float(plain.sigma_of(V).median())
    # Wan's shift: u -> s u / (1 + (s - 1) u)
    u = FlowMatching(timestep_sampling="uniform").sigma_of(V)
    assert torch.allclose(
        FlowMatching(timestep_sampling="uniform", shift=5.0).sigma_of(V), 5 * u / (1 + 4 * u)
    )


@pytest.mark.parametrize("low, high", [(0.875, 1.0), (0.0, 0.875)])
def test_an_expert_draws_only_its_range_with_the_distribution_cut_there(low: float, high: float) -> None:
    full = FlowMatching(shift=3.0)
    cut = FlowMatching(shift=3.0, low=low, high=high)
    sigma = cut.sigma_of(V)
    assert float(sigma.min()) >= low and float(sigma.max()) <= high
    # the cut distribution is the full one conditioned on the range: equal quantiles of that conditional
    lo, hi = full.cdf(torch.tensor(low)), full.cdf(torch.tensor(high))
    assert torch.allclose(full.cdf(sigma), lo + V * (hi - lo), atol=1e-9)


def test_draws_depend_on_the_seed_only() -> None:
    flow = FlowMatching(shift=3.0)
    s1, n1 = flow.draw(123, (2, 3, 4))
    s2, n2 = flow.draw(123, (2, 3, 4))
    s3, n3 = flow.draw(124, (2, 3, 4))
    assert s1 == s2 and torch.equal(n1, n2) and s1 != s3 and not torch.equal(n1, n3)
    assert flow.draw(123, (5,))[0] == s1  # σ is drawn first: independent of the latent shape


def test_noised_batch_and_loss() -> None:
    flow = FlowMatching(timestep_sampling="uniform", weighting="cosmap")
    x0 = torch.randn(2, 3, 4)
    x_t, sigmas, target = flow.noised(x0, [5, 6])
    for b, seed in enumerate([5, 6]):
        sigma, noise = flow.draw(seed, (3, 4))
        assert sigmas[b].item() == pytest.approx(sigma)
        assert torch.allclose(x_t[b], sigma * noise + (1 - sigma) * x0[b], atol=1e-6)
        assert torch.allclose(target[b], noise - x0[b])
    pred = torch.zeros_like(x0)
    weights = 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    expected = (target.square().flatten(1).mean(1) * weights).mean()
    assert torch.allclose(flow.loss(pred, target, sigmas), expected)
    with pytest.raises(ValueError, match="3 noise seeds for a batch of 2"):
        flow.noised(x0, [1, 2, 3])


def test_options_are_checked_naming_the_key() -> None:
    key = "model.config_overrides.flow_matching"
    assert FlowMatching.from_options({"shift": 5, "timestep_sampling": "uniform"}, key).shift == 5
    with pytest.raises(ConfigError, match=f"{key}.shfit: unknown key"):
        FlowMatching.from_options({"shfit": 5}, key)
    with pytest.raises(ConfigError, match="timestep_sampling: got 'normal'"):
        FlowMatching.from_options({"timestep_sampling": "normal"}, key)
    with pytest.raises(ConfigError, match=f"{key}.shift: got True; expected a number"):
        FlowMatching.from_options({"shift": True}, key)
    with pytest.raises(ConfigError, match="shift: got -1"):
        FlowMatching.from_options({"shift": -1}, key)


def test_several_latents_share_each_samples_noise_level() -> None:
    flow = FlowMatching(shift=3.0)
    video, audio = torch.randn(2, 3, 4), torch.randn(2, 5)
    (v_t, a_t), sigmas, (v_target, a_target) = flow.noised_all([video, audio], [7, 8])
    for b, seed in enumerate([7, 8]):
        sigma, (v_noise, a_noise) = flow.draw_all(seed, [(3, 4), (5,)])
        assert sigmas[b].item() == pytest.approx(sigma)
        assert torch.allclose(v_t[b], sigma * v_noise + (1 - sigma) * video[b], atol=1e-6)
        assert torch.allclose(a_t[b], sigma * a_noise + (1 - sigma) * audio[b], atol=1e-6)
        assert torch.allclose(v_target[b], v_noise - video[b]) and torch.allclose(
            a_target[b], a_noise - audio[b]
        )
        assert torch.equal(flow.draw(seed, (3, 4))[1], v_noise)  # the first noise is draw()'s
    assert not torch.equal(v_t[0], v_t[1])
    with pytest.raises(ValueError, match="2 noise seeds for a batch of 2/3 samples"):
        flow.noised_all([video, torch.randn(3, 5)], [1, 2])


def test_text_dropout_is_seeded_per_sample_and_leaves_the_noise_alone() -> None:
    seeds = list(range(1000, 3000))
    kept = FlowMatching(text_dropout=0.1).text_kept(seeds)
    assert kept.dtype == torch.bool and 0.08 < 1 - kept.double().mean().item() < 0.12
    assert torch.equal(kept, FlowMatching(text_dropout=0.1).text_kept(seeds))  # the seed decides
    assert torch.equal(kept[5:9], FlowMatching(text_dropout=0.1).text_kept(seeds[5:9]))  # per sample
    assert bool(FlowMatching().text_kept(seeds).all())  # 0: never dropped
    assert FlowMatching(text_dropout=0.5).draw(7, (3,))[0] == FlowMatching().draw(7, (3,))[0]
    text = torch.randn(len(seeds), 2, 3) + 5.0
    dropped = FlowMatching(text_dropout=0.1).drop_text(text, seeds)
    assert torch.equal(dropped[kept], text[kept]) and bool((dropped[~kept] == 0).all())
    key = "model.config_overrides.flow_matching"
    assert FlowMatching.from_options({"text_dropout": 0.1}, key).text_dropout == 0.1
    with pytest.raises(ConfigError, match="text_dropout: got 1.0; expected a probability"):
        FlowMatching.from_options({"text_dropout": 1.0}, key)
    with pytest.raises(ConfigError, match=f"{key}.text_dropout: got 'x'; expected a number"):
        FlowMatching.from_options({"text_dropout": "x"}, key)
