"""The HiFT generator (``cosyvoice3_hift``): shapes, causality, seeded noise, the official ``hift.pt`` names
and shapes, and loading either weight-norm layout from a local folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mm_core.errors import ConfigError, DataError
from mm_core.models import ModelArguments
from mm_models_cosyvoice.hift import HiFTConfig, HiFTGenerator

TINY = {"base_channels": 16, "f0_cond_channels": 8}

# The official hift.pt (CosyVoice3's CausalHiFTGenerator, parametrized weight norm): name -> shape.
# WN(name, out, in, k): a weight-normed convolution: bias [out], magnitude g [out, 1, 1], direction v.
OFFICIAL_PLAIN: dict[str, tuple[int, ...]] = {
    "m_source.l_linear.weight": (1, 9),
    "m_source.l_linear.bias": (1,),
    "source_downs.0.weight": (256, 18, 30),
    "source_downs.0.bias": (256,),
    "source_downs.1.weight": (128, 18, 6),
    "source_downs.1.bias": (128,),
    "source_downs.2.weight": (64, 18, 1),
    "source_downs.2.bias": (64,),
    "f0_predictor.classifier.weight": (1, 512),
    "f0_predictor.classifier.bias": (1,),
}
OFFICIAL_WN: dict[str, tuple[int, int, int]] = {  # name -> (out, in, kernel)
    "conv_pre": (512, 80, 5),
    "ups.0": (256, 512, 16),
    "ups.1": (128, 256, 11),
    "ups.2": (64, 128, 7),
    "conv_post": (18, 64, 7),
    "f0_predictor.condnet.0": (512, 80, 4),
    "f0_predictor.condnet.2": (512, 512, 3),
    "f0_predictor.condnet.4": (512, 512, 3),
    "f0_predictor.condnet.6": (512, 512, 3),
    "f0_predictor.condnet.8": (512, 512, 3),
}
# residual blocks: name -> (channels, kernel); each has convs1.{0,1,2} and convs2.{0,1,2} (WN, C -> C) and
# activations1.{0,1,2}.alpha, activations2.{0,1,2}.alpha [C]
OFFICIAL_RESBLOCKS: dict[str, tuple[int, int]] = {
    "source_resblocks.0": (256, 7),
    "source_resblocks.1": (128, 7),
    "source_resblocks.2": (64, 11),
    "resblocks.0": (256, 3),
    "resblocks.1": (256, 7),
    "resblocks.2": (256, 11),
    "resblocks.3": (128, 3),
    "resblocks.4": (128, 7),
    "resblocks.5": (128, 11),
    "resblocks.6": (64, 3),
    "resblocks.7": (64, 7),
    "resblocks.8": (64, 11),
}


def official_shapes() -> dict[str, tuple[int, ...]]:
    shapes = dict(OFFICIAL_PLAIN)
    wn = dict(OFFICIAL_WN)
    for block, (c, k) in OFFICIAL_RESBLOCKS.items():
        for j in range(3):
            wn[f"{block}.convs1.{j}"] = (c, c, k)
            wn[f"{block}.convs2.{j}"] = (c, c, k)
            shapes[f"{block}.activations1.{j}.alpha"] = (c,)
            shapes[f"{block}.activations2.{j}.alpha"] = (c,)
    for name, (out, inp, k) in wn.items():
        shapes[f"{name}.bias"] = (out,)
        shapes[f"{name}.parametrizations.weight.original0"] = (out, 1, 1)
        shapes[f"{name}.parametrizations.weight.original1"] = (out, inp, k)
    return shapes


def tiny(seed: int = 0) -> HiFTGenerator:
    torch.manual_seed(seed)
    return HiFTGenerator(HiFTConfig.from_overrides(TINY)).eval()


def test_official_names_and_shapes():
    expected = official_shapes()
    assert len(expected) == 328
    # the official structure at small channel counts has exactly the official names
    assert set(tiny().state_dict()) == set(expected)
    # and at the official sizes (built on the meta device: no memory) exactly the official shapes
    with torch.device("meta"):
        full = HiFTGenerator()
    assert {k: tuple(v.shape) for k, v in full.state_dict().items()} == expected
    assert sum(p.numel() for p in full.parameters()) == 20_779_887


def test_mel_frames_become_480_samples_each():
    model = tiny()
    mel = torch.randn(2, 7, 80)
    with torch.no_grad():
        out = model(speech_feat=mel, noise_seed=[1, 2])
    assert out.waveform.shape == (2, 480 * 7) and out.f0.shape == (2, 7)
    assert out.waveform.abs().max() <= 0.99 and bool((out.f0 >= 0).all())
    with pytest.raises(DataError, match=r"speech_feat: expected \[batch, frames, 80\]"):
        model(speech_feat=torch.randn(2, 80, 7))
    with pytest.raises(DataError, match="noise_seed: 1 seeds for a batch of 2"):
        model(speech_feat=mel, noise_seed=[1])


def test_causal_with_a_four_frame_look_ahead():
    model = tiny()
    mel = torch.randn(1, 16, 80)
    changed = mel.clone()
    changed[:, 10:] += 1.0
    with torch.no_grad():
        a = model(mel, noise_seed=[5]).waveform
        b = model(changed, noise_seed=[5]).waveform
    # conv_pre looks 4 frames ahead; the excitation's 16-point STFT a few samples more
    assert torch.equal(a[:, : 480 * 6 - 16], b[:, : 480 * 6 - 16])
    assert not torch.equal(a[:, 480 * 6 :], b[:, 480 * 6 :])


def test_noise_is_drawn_per_sample_from_its_seed():
    model = tiny()
    mel = torch.randn(2, 6, 80)
    with torch.no_grad():
        both = model(mel, noise_seed=[11, 12]).waveform
        alone = model(mel[1:], noise_seed=[12]).waveform
        other = model(mel, noise_seed=[13, 12]).waveform
    torch.testing.assert_close(both[1:], alone, atol=1e-6, rtol=0)  # the batch it is in does not matter
    assert torch.equal(both[1], other[1]) and not torch.allclose(both[0], other[0])


def test_gradients_reach_every_parameter():
    model = tiny().train()
    out = model(torch.randn(2, 4, 80), noise_seed=[1, 2])
    (out.waveform.square().mean() + out.f0.mean()).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert missing == []


def _legacy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights under old-style weight-norm names, with the training wrapper's prefix."""
    out = {}
    for key, value in state.items():
        key = key.replace("parametrizations.weight.original0", "weight_g")
        key = key.replace("parametrizations.weight.original1", "weight_v")
        out[f"generator.{key}"] = value
    return out


def _plain(model: HiFTGenerator) -> dict[str, torch.Tensor]:
    """The weights with the weight norm removed (``weight = g · v / ‖v‖``), as in an inference export."""
    state = {}
    for key, value in model.state_dict().items():
        if key.endswith(".parametrizations.weight.original1"):
            name = key.removesuffix(".parametrizations.weight.original1")
            state[f"{name}.weight"] = model.get_submodule(name).weight.detach().clone()
        elif not key.endswith(".parametrizations.weight.original0"):
            state[key] = value
    return state


def _args(folder: Path) -> ModelArguments:
    return ModelArguments(model_id="cosyvoice3_hift", model_name_or_path=str(folder), config_overrides=TINY)


@pytest.mark.parametrize("layout", ["parametrized", "legacy", "plain", "safetensors"])
def test_loads_hift_pt_in_either_weight_norm_layout(tmp_path, layout):
    source = tiny(seed=1)
    state = source.state_dict()
    if layout == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    else:
        saved = {"parametrized": state, "legacy": _legacy(state), "plain": _plain(source)}[layout]
        torch.save(saved, tmp_path / "hift.pt")
    loaded = HiFTGenerator.from_pretrained(_args(tmp_path)).eval()
    mel = torch.randn(1, 5, 80)
    with torch.no_grad():
        want, got = source(mel, noise_seed=[3]).waveform, loaded(mel, noise_seed=[3]).waveform
    if layout == "plain":  # g recomputed as ‖w‖: equal up to rounding
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    else:
        assert torch.equal(got, want)
        assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in state.items())


def test_convert_official_writes_safetensors_for_meta_builds(tmp_path):
    from mm_models_cosyvoice.convert import convert_official

    source = tiny(seed=2)
    (tmp_path / "official").mkdir()
    torch.save(_legacy(source.state_dict()), tmp_path / "official" / "hift.pt")
    out = convert_official("cosyvoice3_hift", tmp_path / "official", tmp_path / "converted", **TINY)
    assert (out / "model.safetensors").is_file()
    loaded = HiFTGenerator.from_pretrained(_args(out))
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in source.state_dict().items())


def test_a_checkpoint_of_another_structure_is_refused(tmp_path):
    state = tiny().state_dict()
    del state["conv_post.bias"]
    state["extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "hift.pt")
    with pytest.raises(
        ConfigError, match=r"hift.pt does not match HiFTGenerator: 1 missing \(conv_post.bias\); 1 unexpected"
    ):
        HiFTGenerator.from_pretrained(_args(tmp_path))
    with pytest.raises(ConfigError, match=r"holds neither model.safetensors nor hift.pt"):
        HiFTGenerator.from_pretrained(_args(tmp_path / "missing"))
    wider = (
        r"of another shape \(conv_post.parametrizations.weight.original1 \[18, 2, 7\] \(model: \[18, 4, 7\]\)"
    )
    with pytest.raises(ConfigError, match=wider):
        HiFTGenerator.from_pretrained(
            _args(tmp_path).model_copy(update={"config_overrides": {"base_channels": 32}})
        )
    # on the meta device mm reads safetensors only: hift.pt alone would be silently ignored
    with pytest.raises(ConfigError, match="holds hift.pt but no model.safetensors"):
        HiFTGenerator._from_config(_args(tmp_path))


def test_save_pretrained_writes_a_folder_that_loads_with_its_structure(tmp_path):
    config = {
        "base_channels": 8,
        "f0_cond_channels": 4,
        "upsample_rates": [4, 5, 6],
        "upsample_kernel_sizes": [8, 11, 12],
    }
    source = HiFTGenerator(HiFTConfig.from_overrides(config)).eval()
    source.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    args = ModelArguments(model_id="cosyvoice3_hift", model_name_or_path=str(tmp_path))
    loaded = HiFTGenerator.from_pretrained(args).eval()  # no config_overrides: config.json has the structure
    assert loaded.config == source.config
    mel = torch.randn(1, 3, 80)
    with torch.no_grad():
        assert torch.equal(loaded(mel, noise_seed=[1]).waveform, source(mel, noise_seed=[1]).waveform)
    assert HiFTGenerator._from_config(args).config == source.config  # the meta-device build reads it too


def test_meta_build_and_init_weights_start_with_weight_equal_to_v():
    with torch.device("meta"):
        model = HiFTGenerator(HiFTConfig.from_overrides(TINY))
    model.to_empty(device="cpu")
    for t in [*model.parameters(), *model.buffers()]:
        t.data.fill_(float("nan"))
    model.init_weights()
    assert not any(bool(torch.isnan(t).any()) for t in [*model.parameters(), *model.buffers()])
    conv = model.resblocks[0].convs1[0]
    torch.testing.assert_close(conv.weight, conv.parametrizations.weight.original1)
    assert bool((model.resblocks[0].activations1[0].alpha == 1).all())


def test_config_overrides_are_checked():
    with pytest.raises(
        ConfigError, match=r"model.config_overrides.channels: unknown key; accepted: in_channels"
    ):
        HiFTConfig.from_overrides({"channels": 8})
    with pytest.raises(ConfigError, match=r"model.config_overrides.upsample_rates: .* must be 480"):
        HiFTConfig.from_overrides({"upsample_rates": [8, 5, 2]})
    with pytest.raises(ConfigError, match=r"upsample_kernel_sizes: 2 entries, but upsample_rates has 3"):
        HiFTConfig.from_overrides({"upsample_kernel_sizes": [16, 11]})
    config = HiFTConfig.from_overrides(
        {"upsample_rates": [4, 5, 6], "upsample_kernel_sizes": [8, 11, 12], **TINY}
    )
    model = HiFTGenerator(config)
    assert model(torch.randn(1, 3, 80), noise_seed=[0]).waveform.shape == (1, 1440)


def test_an_unrelated_config_json_is_not_read(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896}')
    args = ModelArguments(model_id="cosyvoice3_hift", model_name_or_path=str(tmp_path), config_overrides=TINY)
    assert HiFTGenerator.config_of(args) == HiFTConfig.from_overrides(TINY)
