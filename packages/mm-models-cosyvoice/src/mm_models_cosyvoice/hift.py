"""CosyVoice3's vocoder (``model.model_id: cosyvoice3_hift``): the causal HiFT generator, mel -> 24 kHz wave.

HiFT (HiFi-GAN with a neural source filter and an inverse-STFT head) turns 80-bin log-mel frames at 50 Hz
into a waveform 480 times longer:

1. an **F0 predictor** (five causal convolutions with ELU, a linear layer, ``|·|``) estimates the pitch of
   every frame in Hz;
2. a **harmonic source** (neural source filter) upsamples the pitch to the sample rate and builds the
   fundamental and 8 overtones as sines, with noise where the frame is unvoiced (pitch below 10 Hz); a
   linear layer mixes them into one excitation signal. The sines carry no gradient (only the mixing does),
   so the pitch predictor learns from its own F0 loss only;
3. the **decoder** upsamples the mel by 8, 5 and 3 with causal convolutions, adds at each rate the
   excitation's STFT (n_fft 16, hop 4) brought to that rate by a strided convolution and a residual block,
   and refines with Snake residual blocks; the last convolution predicts the magnitude (log) and phase of a
   16-point STFT whose inverse (hop 4) is the waveform: 8 · 5 · 3 · 4 = 480 samples per mel frame.

Every convolution is causal (``conv_pre`` and the pitch predictor's first layer look 4 and 3 frames ahead),
as in the official streaming model. Parameter names, shapes and the weight-norm layout are those of the
official ``hift.pt`` (see :mod:`mm_models_cosyvoice.hift_layers`), so :meth:`HiFTGenerator.from_pretrained`
loads it from a local folder, and :meth:`HiFTGenerator.save_pretrained` (what ``mm convert dcp-to-hf``
calls) writes ``model.safetensors`` under the same names with a ``config.json`` of the structure;
``model.config_overrides`` makes tiny versions for tests (:class:`HiFTConfig`).

**Noise.** The source draws a random initial phase per overtone and Gaussian noise. In training every sample
carries a ``noise_seed`` (one integer): a CPU generator seeded with it draws that sample's noise, so the
same sample gets the same noise on any number of ranks, in any micro-batch, and after a resume. Without
seeds (inference) the default random generator is used.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from mm_core.errors import ConfigError, DataError
from mm_core.models import BaseModel, ModelArguments, ModelPlan

from .hift_layers import (
    LEFT,
    RIGHT,
    CausalConv1d,
    CausalConv1dDownSample,
    CausalConv1dUpsample,
    Snake,
    remap_weight_norm,
    reset_parameters,
    weight_normed,
)
from .weights import load_checked, read_state, refuse_official_only_on_meta, save_safetensors

#: samples per mel frame of the speech store (24 kHz, 50 Hz frames)
MEL_HOP = 480
#: the official weights' file, and the ones :meth:`HiFTGenerator.save_pretrained` writes
TORCH_FILE, SAFETENSORS_FILE, CONFIG_FILE = "hift.pt", "model.safetensors", "config.json"
#: ``model_type`` of the ``config.json`` :meth:`HiFTGenerator.save_pretrained` writes
MODEL_TYPE = "cosyvoice3_hift"
#: the training wrapper's prefix of the generator's tensors (stripped when present)
WRAPPER_PREFIX = "generator."


@dataclass(frozen=True)
class HiFTConfig:
    """The generator's structure (``model.config_overrides``); the defaults are CosyVoice3's."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    #: amplitude of the sines, and the noise standard deviation of voiced samples
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    #: a sample is voiced when its pitch exceeds this (Hz)
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    #: frames ``conv_pre`` looks ahead (its kernel is this + 1)
    conv_pre_look_right: int = 4
    #: channels of the pitch predictor's convolutions
    f0_cond_channels: int = 512

    @classmethod
    def from_overrides(cls, overrides: dict[str, Any], where: str = "model.config_overrides") -> HiFTConfig:
        """The default config with ``overrides`` applied; an unknown key or an inconsistent structure is a
        ConfigError naming ``<where>.<key>``."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in overrides.items():
            if key not in known:
                raise ConfigError(f"{where}.{key}: unknown key; accepted: {', '.join(known)}")
            default = getattr(cls(), key)
            try:
                if isinstance(default, tuple) and default and isinstance(default[0], tuple):
                    values[key] = tuple(tuple(int(d) for d in row) for row in value)
                elif isinstance(default, tuple):
                    values[key] = tuple(int(v) for v in value)
                else:
                    values[key] = type(default)(value)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"{where}.{key}: got {value!r}; expected a value like {default!r}"
                ) from None
        config = replace(cls(), **values)
        config.check(where)
        return config

    def check(self, where: str) -> None:
        stages = len(self.upsample_rates)
        for key in (
            "upsample_kernel_sizes",
            "source_resblock_kernel_sizes",
            "source_resblock_dilation_sizes",
        ):
            if len(getattr(self, key)) != stages:
                raise ConfigError(
                    f"{where}.{key}: {len(getattr(self, key))} entries, but upsample_rates has {stages}"
                )
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ConfigError(f"{where}.resblock_dilation_sizes: one list per resblock_kernel_sizes entry")
        if math.prod(self.upsample_rates) * self.istft_hop != MEL_HOP:
            raise ConfigError(
                f"{where}.upsample_rates: the product of {list(self.upsample_rates)} times istft_hop "
                f"{self.istft_hop} must be {MEL_HOP} (samples per mel frame of the 24 kHz store)"
            )
        if self.base_channels % 2**stages or self.base_channels < 2**stages:
            raise ConfigError(f"{where}.base_channels: must be a multiple of 2**{stages} (halved per stage)")

    @property
    def hop_length(self) -> int:
        """Output samples per mel frame."""
        return math.prod(self.upsample_rates) * self.istft_hop


@dataclass
class HiFTOutput(ModelOutput):
    """The generated waveform [B, hop·T] (in [-audio_limit, audio_limit]) and the predicted pitch [B, T]
    (Hz)."""

    waveform: torch.Tensor | None = None
    f0: torch.Tensor | None = None


def _seeds(noise_seed: Sequence[int] | torch.Tensor | None, batch: int) -> list[int] | None:
    if noise_seed is None:
        return None
    seeds = [int(s) for s in (noise_seed.tolist() if isinstance(noise_seed, torch.Tensor) else noise_seed)]
    if len(seeds) != batch:
        raise DataError(f"noise_seed: {len(seeds)} seeds for a batch of {batch} samples")
    return seeds


class ResBlock(nn.Module):
    """Three causal dilated Snake-conv pairs with residual connections:
    ``x = x + conv2_k(snake2_k(conv1_k(snake1_k(x))))`` for k = 0, 1, 2 (dilations of ``conv1``)."""

    def __init__(self, channels: int, kernel_size: int, dilations: Sequence[int]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_normed(CausalConv1d(channels, channels, kernel_size, dilation=d, causal_type=LEFT))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_normed(CausalConv1d(channels, channels, kernel_size, causal_type=LEFT)) for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class CausalConvRNNF0Predictor(nn.Module):
    """Pitch per mel frame: ``|Linear(condnet(mel))|`` in Hz, ``condnet`` = a causal conv looking 3 frames
    ahead, then four causal convs, each followed by ELU (the official name; there is no recurrent layer)."""

    def __init__(self, in_channels: int, cond_channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            weight_normed(CausalConv1d(in_channels, cond_channels, 4, causal_type=RIGHT)),
            nn.ELU(),
        ]
        for _ in range(4):
            layers += [
                weight_normed(CausalConv1d(cond_channels, cond_channels, 3, causal_type=LEFT)),
                nn.ELU(),
            ]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """``mel`` [B, C, T] -> pitch [B, T]."""
        h = self.condnet(mel).transpose(1, 2)
        return torch.abs(self.classifier(h).squeeze(-1))


class SourceModuleHnNSF(nn.Module):
    """The harmonic-plus-noise excitation (module docstring, step 2): sines of the pitch and its overtones,
    noise where unvoiced, mixed by ``l_linear`` and squashed by ``tanh``."""

    def __init__(self, config: HiFTConfig) -> None:
        super().__init__()
        self.config = config
        self.dim = config.nb_harmonics + 1
        self.l_linear = nn.Linear(self.dim, 1)

    def draws(
        self, seeds: list[int] | None, batch: int, length: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The initial phases [B, dim] (0 for the fundamental) and standard-normal noise [B, length, dim]:
        per sample from its seed (a CPU generator: the same numbers on every device), else from the default
        generator."""
        if seeds is None:
            phases = torch.rand(batch, self.dim, device=device)
            noise = torch.randn(batch, length, self.dim, device=device)
        else:
            rows, noises = [], []
            for seed in seeds:
                gen = torch.Generator().manual_seed(seed)
                rows.append(torch.rand(self.dim, generator=gen))
                noises.append(torch.randn(length, self.dim, generator=gen))
            phases, noise = torch.stack(rows).to(device), torch.stack(noises).to(device)
        phases[:, 0] = 0.0
        return phases, noise

    @torch.no_grad()
    def sines(self, f0_up: torch.Tensor, hop: int, seeds: list[int] | None) -> torch.Tensor:
        """``f0_up`` [B, L, 1] (pitch per sample, constant over each frame's ``hop`` samples) -> the voiced
        sines plus noise [B, L, dim]. The phase is integrated at the frame rate and held over each frame
        (the causal variant), so it never depends on later frames."""
        c = self.config
        batch, length, _ = f0_up.shape
        phases, noise = self.draws(seeds, batch, length, f0_up.device)
        harmonics = torch.arange(1, self.dim + 1, device=f0_up.device, dtype=f0_up.dtype)
        rad = torch.remainder(f0_up * harmonics / c.sampling_rate, 1.0)
        rad[:, 0, :] = rad[:, 0, :] + phases
        frames = length // hop
        rad = F.interpolate(rad.transpose(1, 2), size=frames, mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad, dim=1) * (2 * math.pi)
        phase = F.interpolate(phase.transpose(1, 2) * hop, scale_factor=float(hop), mode="nearest")
        sines = torch.sin(phase.transpose(1, 2)) * c.nsf_alpha
        voiced = (f0_up > c.nsf_voiced_threshold).to(sines.dtype)
        noise_amp = voiced * c.nsf_sigma + (1 - voiced) * c.nsf_alpha / 3
        return sines * voiced + noise_amp * noise

    def forward(self, f0_up: torch.Tensor, hop: int, seeds: list[int] | None) -> torch.Tensor:
        """``f0_up`` [B, L, 1] -> the excitation [B, 1, L]."""
        merged = torch.tanh(
            self.l_linear(self.sines(f0_up.float(), hop, seeds).to(self.l_linear.weight.dtype))
        )
        return merged.transpose(1, 2)


#: each residual block of the decoder and of the source branch, and the pitch predictor, is an FSDP unit
HIFT_PLAN = ModelPlan(fsdp_units=("f0_predictor", "source_resblocks.{*}", "resblocks.{*}"))


class HiFTGenerator(nn.Module, BaseModel):
    """The causal HiFT generator (module docstring). ``forward(speech_feat [B, T, 80], noise_seed)``
    returns :class:`HiFTOutput` (``waveform`` [B, 480·T], ``f0`` [B, T])."""

    mm_plan: ClassVar[ModelPlan] = HIFT_PLAN
    stft_window: torch.Tensor

    def __init__(self, config: HiFTConfig | None = None) -> None:
        super().__init__()
        c = self.config = config or HiFTConfig()
        c.check("HiFTConfig")
        stages = len(c.upsample_rates)
        self.m_source = SourceModuleHnNSF(c)
        self.conv_pre = weight_normed(
            CausalConv1d(c.in_channels, c.base_channels, c.conv_pre_look_right + 1, causal_type=RIGHT)
        )
        self.ups = nn.ModuleList(
            weight_normed(
                CausalConv1dUpsample(c.base_channels // 2**i, c.base_channels // 2 ** (i + 1), k, u)
            )
            for i, (u, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes))
        )
        # the source's STFT frames are brought to each stage's rate: strides 15, 3, 1 for rates 8, 5, 3
        spec_channels = c.istft_n_fft + 2
        down_rates = [1, *reversed(c.upsample_rates[1:])]
        strides = list(reversed([math.prod(down_rates[: i + 1]) for i in range(stages)]))
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (stride, k, d) in enumerate(
            zip(strides, c.source_resblock_kernel_sizes, c.source_resblock_dilation_sizes)
        ):
            channels = c.base_channels // 2 ** (i + 1)
            if stride == 1:
                self.source_downs.append(CausalConv1d(spec_channels, channels, 1, causal_type=LEFT))
            else:
                self.source_downs.append(CausalConv1dDownSample(spec_channels, channels, stride * 2, stride))
            self.source_resblocks.append(ResBlock(channels, k, d))
        self.resblocks = nn.ModuleList(
            ResBlock(c.base_channels // 2 ** (i + 1), k, d)
            for i in range(stages)
            for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes)
        )
        self.conv_post = weight_normed(
            CausalConv1d(c.base_channels // 2**stages, spec_channels, 7, causal_type=LEFT)
        )
        self.f0_predictor = CausalConvRNNF0Predictor(c.in_channels, c.f0_cond_channels)
        self.register_buffer("stft_window", torch.hann_window(c.istft_n_fft, periodic=True), persistent=False)

    # --------------------------------------------------------------------------------------- building
    @classmethod
    def config_of(cls, args: ModelArguments) -> HiFTConfig:
        """The structure: the ``config.json`` :meth:`save_pretrained` wrote in ``model.model_name_or_path``
        (one whose ``model_type`` is ``cosyvoice3_hift``; otherwise the official sizes: the official folder
        has none), then ``model.config_overrides`` on top."""
        base: dict[str, Any] = {}
        path = Path(args.model_name_or_path) / CONFIG_FILE if args.model_name_or_path else None
        if path is not None and path.is_file():
            try:
                found = json.loads(path.read_text(encoding="utf-8"))
            except ValueError as exc:
                raise ConfigError(f"model.model_name_or_path: {path}: not valid JSON ({exc})") from None
            if isinstance(found, dict) and found.get("model_type") == MODEL_TYPE:
                base = {k: v for k, v in found.items() if k != "model_type"}
                HiFTConfig.from_overrides(base, str(path))
        return HiFTConfig.from_overrides({**base, **args.config_overrides})

    @classmethod
    def _from_config(cls, args: ModelArguments) -> HiFTGenerator:
        refuse_official_only_on_meta(args, TORCH_FILE, MODEL_TYPE)
        return cls(cls.config_of(args))

    @classmethod
    def from_pretrained(cls, args: ModelArguments) -> HiFTGenerator:
        """The generator with the weights of the local folder ``model.model_name_or_path``:
        ``model.safetensors`` (this package's export) or the official ``hift.pt`` (a state dict, read with
        ``weights_only``). A ``generator.`` prefix (the training wrapper's) is stripped and the legacy or
        removed weight-norm layouts are mapped; a missing, unexpected or mis-shaped tensor is a
        ConfigError."""
        if not args.model_name_or_path:
            raise ConfigError(
                f"model.model_name_or_path: not set; point it at a folder with {TORCH_FILE} or "
                f"{SAFETENSORS_FILE}, or set model.from_scratch: true"
            )
        model = cls(cls.config_of(args))
        state, source = read_state(Path(args.model_name_or_path), TORCH_FILE)
        state = {k.removeprefix(WRAPPER_PREFIX): v for k, v in state.items()}
        load_checked(model, remap_weight_norm(state, list(model.state_dict())), source)
        return model

    def save_pretrained(self, out_dir: str | Path, **_: Any) -> None:
        """Write a folder :meth:`from_pretrained` reads (also on the meta device): ``config.json`` (the
        structure) and ``model.safetensors`` under the official names (``mm convert dcp-to-hf`` calls this).
        ``torch.save(model.state_dict(), "hift.pt")`` gives the file upstream's code loads."""
        out = Path(out_dir)
        save_safetensors(self, out)
        config = {"model_type": MODEL_TYPE, **asdict(self.config)}  # tuples are written as lists
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    @torch.no_grad()
    def init_weights(self) -> None:
        """Torch's default initialisation of every layer (with ``weight = v`` for weight-normed ones, as
        the official model starts), Snake ``alpha`` = 1, and the STFT window (a buffer)."""
        reset_parameters(self)
        window = torch.hann_window(self.config.istft_n_fft, periodic=True)
        self.stft_window.copy_(window.to(self.stft_window.device))

    # ---------------------------------------------------------------------------------------- forward
    def forward(
        self,
        speech_feat: torch.Tensor,
        noise_seed: Sequence[int] | torch.Tensor | None = None,
        **kwargs: Any,
    ) -> HiFTOutput:
        """``speech_feat`` [B, T, in_channels] log-mel -> waveform [B, hop·T] and pitch [B, T]; ``noise_seed``
        one integer per sample (module docstring). Other batch fields (``kwargs``) are ignored."""
        if speech_feat.dim() != 3 or speech_feat.shape[-1] != self.config.in_channels:
            raise DataError(
                f"speech_feat: expected [batch, frames, {self.config.in_channels}], got "
                f"{tuple(speech_feat.shape)}"
            )
        seeds = _seeds(noise_seed, speech_feat.shape[0])
        mel = speech_feat.transpose(1, 2)
        f0 = self.f0_predictor(mel)
        hop = self.config.hop_length
        f0_up = F.interpolate(f0.unsqueeze(1), scale_factor=float(hop), mode="nearest").transpose(1, 2)
        source = self.m_source(f0_up, hop, seeds)
        return HiFTOutput(waveform=self.decode(mel, source), f0=f0)

    def _stft(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, L] -> real and imaginary parts [B, n_fft + 2, L / hop + 1] (centred, reflect-padded)."""
        c = self.config
        window = self.stft_window.float()
        spec = torch.stft(
            x.float(), c.istft_n_fft, c.istft_hop, c.istft_n_fft, window=window, return_complex=True
        )
        return torch.cat([spec.real, spec.imag], dim=1)

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """``mel`` [B, C, T] and the excitation [B, 1, L] -> the waveform [B, L] (module docstring,
        step 3)."""
        c = self.config
        s_stft = self._stft(source.squeeze(1)).to(mel.dtype)
        x = self.conv_pre(mel)
        kernels = len(c.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, c.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # one more frame: the STFT's L / hop + 1
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            mixed = self.resblocks[i * kernels](x)
            for j in range(1, kernels):
                mixed = mixed + self.resblocks[i * kernels + j](x)
            x = mixed / kernels
        x = self.conv_post(F.leaky_relu(x))  # torch's default slope (0.01) here, as the official model
        bins = c.istft_n_fft // 2 + 1
        magnitude = torch.exp(x[:, :bins].float()).clamp(max=1e2)
        phase = torch.sin(x[:, bins:].float())
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        window = self.stft_window.float()
        wave = torch.istft(spec, c.istft_n_fft, c.istft_hop, c.istft_n_fft, window=window)
        return wave.clamp(-c.audio_limit, c.audio_limit)
