"""The vocoder's discriminator (``model.model_id: cosyvoice3_hift_disc``): multi-period + multi-resolution.

CosyVoice3 trains HiFT against eight sub-discriminators, each giving a score map (one score per patch) and
the feature maps after each of its layers (for the feature-matching loss):

- **multi-period** (``mpd``, HiFi-GAN's): for each period p in 2, 3, 5, 7, 11 the wave is reflect-padded to a
  multiple of p and folded into a ``[L / p, p]`` image, so a stack of ``(5, 1)`` convolutions (stride 3 in
  time) compares samples p apart: periodic structure such as pitch;
- **multi-resolution spectrogram** (``mrd``): for each (n_fft, hop, window) in (1024, 120, 600),
  (2048, 240, 1200), (512, 50, 240) the STFT magnitude ``[frames, bins]`` goes through a stack of
  ``(3, 9)`` convolutions (stride 2 along frequency): the spectral envelope at three time-frequency
  trade-offs.

The score maps are listed MPD first, then MRD, as the official training wrapper does. Every convolution is
weight-normed (torch's parametrized layout, see :mod:`mm_models_cosyvoice.hift_layers`; the official MPD
used the legacy ``weight_g`` / ``weight_v`` names, which :meth:`HiFTDiscriminator.from_pretrained` maps);
the tensor names are those under ``discriminator.`` in the official training checkpoints, whose prefix is
stripped. ``model.config_overrides`` (:class:`DiscriminatorConfig`) shrinks it for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from mm_core.errors import ConfigError, DataError
from mm_core.models import BaseModel, ModelArguments, ModelPlan

from .hift_layers import remap_weight_norm, reset_parameters, weight_normed
from .weights import load_checked, read_state

SAFETENSORS_FILE = "model.safetensors"
WRAPPER_PREFIX = "discriminator."


@dataclass(frozen=True)
class DiscriminatorConfig:
    """The discriminator's structure (``config_overrides``); the defaults are CosyVoice3's."""

    mpd_periods: tuple[int, ...] = (2, 3, 5, 7, 11)
    #: output channels of the five convolutions of each period discriminator
    mpd_channels: tuple[int, ...] = (32, 128, 512, 1024, 1024)
    #: (n_fft, hop, window length) of each spectrogram discriminator
    mrd_resolutions: tuple[tuple[int, ...], ...] = ((1024, 120, 600), (2048, 240, 1200), (512, 50, 240))
    mrd_channels: int = 32
    lrelu_slope: float = 0.1

    @classmethod
    def from_overrides(
        cls, overrides: dict[str, Any], where: str = "model.config_overrides"
    ) -> DiscriminatorConfig:
        """The default config with ``overrides``; a bad key or value is a ConfigError naming
        ``<where>.<key>``."""
        known = [f.name for f in fields(cls)]
        values: dict[str, Any] = {}
        default = cls()
        for key, value in overrides.items():
            if key not in known:
                raise ConfigError(f"{where}.{key}: unknown key; accepted: {', '.join(known)}")
            try:
                if key == "mrd_resolutions":
                    values[key] = tuple(tuple(int(v) for v in row) for row in value)
                elif isinstance(getattr(default, key), tuple):
                    values[key] = tuple(int(v) for v in value)
                else:
                    values[key] = type(getattr(default, key))(value)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"{where}.{key}: got {value!r}; expected a value like {getattr(default, key)!r}"
                ) from None
        config = replace(default, **values)
        if len(config.mpd_channels) != 5:
            raise ConfigError(
                f"{where}.mpd_channels: 5 channel counts (one per convolution), "
                f"got {list(config.mpd_channels)}"
            )
        if any(len(r) != 3 or r[2] > r[0] for r in config.mrd_resolutions):
            raise ConfigError(
                f"{where}.mrd_resolutions: each entry is [n_fft, hop, window] with window <= n_fft"
            )
        if not config.mpd_periods and not config.mrd_resolutions:
            raise ConfigError(f"{where}: no sub-discriminator (mpd_periods and mrd_resolutions are empty)")
        return config


@dataclass
class DiscriminatorOutput(ModelOutput):
    """Per sub-discriminator (MPD first, then MRD): the score map [B, 1, ...] (one score per patch; the
    official code flattens it to [B, N_k], the losses here take means over it), and the feature maps of its
    layers (the last one is the score map)."""

    scores: list[torch.Tensor] | None = None
    features: list[list[torch.Tensor]] | None = None


class DiscriminatorP(nn.Module):
    """One period discriminator (module docstring)."""

    def __init__(self, period: int, channels: tuple[int, ...], slope: float) -> None:
        super().__init__()
        self.period, self.slope = period, slope
        ins = (1, *channels[:-1])
        self.convs = nn.ModuleList(
            weight_normed(nn.Conv2d(i, o, (5, 1), (3 if n < 4 else 1, 1), padding=(2, 0)))
            for n, (i, o) in enumerate(zip(ins, channels))
        )
        self.conv_post = weight_normed(nn.Conv2d(channels[-1], 1, (3, 1), 1, padding=(1, 0)))

    def forward(self, wave: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``wave`` [B, 1, L] -> the score map [B, 1, L / (3⁴·p), p] and the feature maps."""
        batch, _, length = wave.shape
        if length % self.period:
            wave = F.pad(wave, (0, self.period - length % self.period), mode="reflect")
        x = wave.view(batch, 1, -1, self.period)
        features = []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), self.slope)
            features.append(x)
        x = self.conv_post(x)
        features.append(x)
        return x, features


class MultiPeriodDiscriminator(nn.Module):
    def __init__(self, config: DiscriminatorConfig) -> None:
        super().__init__()
        self.discriminators = nn.ModuleList(
            DiscriminatorP(p, config.mpd_channels, config.lrelu_slope) for p in config.mpd_periods
        )


class SpecDiscriminator(nn.Module):
    """One spectrogram discriminator (module docstring): STFT magnitude ``sqrt(max(re² + im², 1e-7))``
    (centred, Hann window of ``win_length``) as a ``[B, 1, frames, bins]`` image."""

    window: torch.Tensor

    def __init__(self, n_fft: int, hop: int, win_length: int, channels: int, slope: float) -> None:
        super().__init__()
        self.n_fft, self.hop, self.win_length, self.slope = n_fft, hop, win_length, slope
        c = channels
        self.discriminators = nn.ModuleList(
            [
                weight_normed(nn.Conv2d(1, c, (3, 9), padding=(1, 4))),
                weight_normed(nn.Conv2d(c, c, (3, 9), stride=(1, 2), padding=(1, 4))),
                weight_normed(nn.Conv2d(c, c, (3, 9), stride=(1, 2), padding=(1, 4))),
                weight_normed(nn.Conv2d(c, c, (3, 9), stride=(1, 2), padding=(1, 4))),
                weight_normed(nn.Conv2d(c, c, (3, 3), stride=(1, 1), padding=(1, 1))),
            ]
        )
        self.out = weight_normed(nn.Conv2d(c, 1, 3, 1, 1))
        self.register_buffer("window", torch.hann_window(win_length), persistent=False)

    def reset_window(self) -> None:
        self.window.copy_(torch.hann_window(self.win_length).to(self.window.device))

    def forward(self, wave: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``wave`` [B, 1, L] -> the score map [B, 1, frames, bins / 8] and the feature maps."""
        spec = torch.stft(
            wave.squeeze(1).float(),
            self.n_fft,
            self.hop,
            self.win_length,
            window=self.window.float(),
            return_complex=True,
        )
        power = spec.real.square() + spec.imag.square()
        x = torch.sqrt(power.clamp(min=1e-7)).transpose(1, 2).unsqueeze(1).to(wave.dtype)
        features = []
        for conv in self.discriminators:
            x = F.leaky_relu(conv(x), self.slope)
            features.append(x)
        x = self.out(x)
        features.append(x)
        return x, features


class MultiResSpecDiscriminator(nn.Module):
    def __init__(self, config: DiscriminatorConfig) -> None:
        super().__init__()
        self.discriminators = nn.ModuleList(
            SpecDiscriminator(n_fft, hop, win, config.mrd_channels, config.lrelu_slope)
            for n_fft, hop, win in config.mrd_resolutions
        )


#: each sub-discriminator is an FSDP unit
DISCRIMINATOR_PLAN = ModelPlan(fsdp_units=("mpd.discriminators.{*}", "mrd.discriminators.{*}"))


class HiFTDiscriminator(nn.Module, BaseModel):
    """Multi-period + multi-resolution spectrogram discriminators (module docstring). ``forward(waveform
    [B, L])`` returns :class:`DiscriminatorOutput`."""

    mm_plan: ClassVar[ModelPlan] = DISCRIMINATOR_PLAN

    def __init__(self, config: DiscriminatorConfig | None = None) -> None:
        super().__init__()
        self.config = config or DiscriminatorConfig()
        self.mpd = MultiPeriodDiscriminator(self.config)
        self.mrd = MultiResSpecDiscriminator(self.config)

    @classmethod
    def _from_config(cls, args: ModelArguments) -> HiFTDiscriminator:
        return cls(DiscriminatorConfig.from_overrides(dict(args.config_overrides)))

    @classmethod
    def from_pretrained(cls, args: ModelArguments) -> HiFTDiscriminator:
        """The discriminator with the weights of the local folder ``model.model_name_or_path``
        (``model.safetensors``; a ``discriminator.`` prefix is stripped, legacy weight-norm names mapped)."""
        if not args.model_name_or_path:
            raise ConfigError(
                "model.model_name_or_path: not set; point it at a folder with model.safetensors, or set "
                "model.from_scratch: true"
            )
        folder = Path(args.model_name_or_path)
        if not (folder / SAFETENSORS_FILE).is_file():
            raise ConfigError(
                f"model.model_name_or_path: {str(folder)!r} holds no {SAFETENSORS_FILE}; point it at a "
                "folder with the discriminator's weights, or set model.from_scratch: true"
            )
        model = cls._from_config(args)
        state, source = read_state(folder, SAFETENSORS_FILE)
        state = {k.removeprefix(WRAPPER_PREFIX): v for k, v in state.items()}
        load_checked(model, remap_weight_norm(state, list(model.state_dict())), source)
        return model

    @torch.no_grad()
    def init_weights(self) -> None:
        """Torch's default initialisation (``weight = v`` for the weight-normed convolutions) and the STFT
        windows (buffers)."""
        reset_parameters(self)
        for module in self.mrd.discriminators:
            module.reset_window()  # type: ignore[operator]

    def forward(self, waveform: torch.Tensor, **kwargs: Any) -> DiscriminatorOutput:
        if waveform.dim() != 2:
            raise DataError(f"waveform: expected [batch, samples], got {tuple(waveform.shape)}")
        wave = waveform.unsqueeze(1)
        scores, features = [], []
        for disc in [*self.mpd.discriminators, *self.mrd.discriminators]:
            score, fmap = disc(wave)
            scores.append(score)
            features.append(fmap)
        return DiscriminatorOutput(scores=scores, features=features)
