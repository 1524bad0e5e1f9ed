"""``cosyvoice3_flow``: CosyVoice3's flow-matching acoustic model (stage b), speech tokens -> log-mel.

**Structure** (official names, as in ``flow.pt``): ``input_embedding`` (an 80-wide embedding of the 25 Hz
speech tokens), ``pre_lookahead_layer`` (``conv1``: each token sees the 3 next ones; LeakyReLU; ``conv2``:
causal; added to its input), repetition of every token twice (50 Hz: ``mu``, one row per mel frame),
``spk_embed_affine_layer`` (the L2-normalised 192-d speaker embedding to 80), and ``decoder.estimator``, the
DiT of :mod:`mm_models_cosyvoice.dit`.

**Training** (conditional flow matching, per sample ``b`` of ``T_b`` mel frames): time ``t ~ U(0, 1)``, noise
``z ~ N(0, I)``, ``y = (1 − (1 − σ) t) z + t x₁`` with ``σ = sigma_min = 1e-6`` and ``x₁`` the mel; target
velocity ``u = x₁ − (1 − σ) z``. The prompt condition is, with probability ``prompt_prob`` (0.5), the first
``k`` frames of the mel itself, ``k`` uniform in ``[0, ⌊prompt_max_ratio · T_b⌋]`` (30 %), else zeros. With
probability ``training_cfg_rate`` (0.2) ``mu``, the speaker and the prompt are all zeroed (the unconditional
model classifier-free guidance needs). With probability ``streaming_prob`` (0.5) the sample trains with the
block-causal chunk attention (:func:`~mm_models_cosyvoice.dit.attention_mask`). The loss is the squared error
``(v − u)²`` over the sample's frames (prompt frames included) and the 80 bins.

**Seeds.** All of this is drawn from the sample's ``noise_seed`` (the batch carries one per sample, from the
dataset): a CPU generator seeded with it draws, in order, ``t``, the guidance coin, the prompt coin and
length, the streaming coin and then the noise ``[T_b, 80]`` — so a sample is trained the same in any
micro-batch, on any number of ranks and after a resume. (Upstream draws one streaming coin per batch; here
each sample has its own, which keeps that property.) The DiT's dropout (``dropout``, 0.1) uses torch's
generator as usual; parity checks set it to 0.

**Loss normalisation** (``config_overrides.loss_normalization``): ``sample`` (default) averages each sample's
mean squared error over the micro-batch's samples; with mm's ``loss_type: raw`` that is the same model on
every layout (equal samples per micro-batch). ``frame`` is upstream's: the squared error summed over the
micro-batch divided by its frames × 80, which weighs long utterances more and so depends on how samples are
grouped into micro-batches.

**Inference**: :meth:`CosyVoice3FlowForTraining.sample`: Euler steps on the cosine schedule
``t_k = 1 − cos(k / n · π / 2)`` with classifier-free guidance ``v = (1 + w) v(cond) − w v(∅)`` (``w = 0.7``,
10 steps).

``model.config_overrides``: any :class:`FlowConfig` field (tiny sizes in tests). ``model.model_name_or_path``:
a folder with ``model.safetensors`` or the official ``flow.pt``, and optionally ``config.json`` (a
:class:`FlowConfig`; without it the official sizes).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from mm_core.errors import ConfigError, DataError
from mm_core.models import BaseModel, ModelArguments, ModelPlan

from .dit import DiT
from .weights import (
    load_checked,
    read_state,
    refuse_official_only_on_meta,
    save_safetensors,
)

OVERRIDES = "model.config_overrides"
OFFICIAL_FILE = "flow.pt"
NORMALISATIONS = ("sample", "frame")


@dataclass(frozen=True)
class FlowConfig:
    """Sizes (official defaults) and training / sampling settings of the flow stage."""

    vocab_size: int = 6561
    input_size: int = 80
    spk_embed_dim: int = 192
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    pre_lookahead_channels: int = 1024
    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: int = 2
    dropout: float = 0.1
    conv_pos_kernel: int = 31
    conv_pos_groups: int = 16
    static_chunk_size: int = 50
    # training
    sigma_min: float = 1e-6
    training_cfg_rate: float = 0.2
    prompt_prob: float = 0.5
    prompt_max_ratio: float = 0.3
    streaming_prob: float = 0.5
    loss_normalization: str = "sample"
    # sampling
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10

    @classmethod
    def read(cls, values: Mapping[str, Any], where: str) -> FlowConfig:
        """From a mapping (unknown keys and bad values are ConfigErrors naming ``where.key``)."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        for key, value in values.items():
            if key not in names:
                raise ConfigError(f"{where}.{key}: unknown key; accepted: {', '.join(names)}")
            kind = names[key].type
            if kind == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ConfigError(f"{where}.{key}: got {value!r}; expected a non-negative integer")
            if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"{where}.{key}: got {value!r}; expected a number")
            out[key] = float(value) if kind == "float" else value
        config = cls(**out)
        config.check(where)
        return config

    def check(self, where: str) -> None:
        for name in ("training_cfg_rate", "prompt_prob", "prompt_max_ratio", "streaming_prob", "dropout"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{where}.{name}: got {getattr(self, name)!r}; expected a value in [0, 1]")
        if self.loss_normalization not in NORMALISATIONS:
            raise ConfigError(
                f"{where}.loss_normalization: got {self.loss_normalization!r}; accepted: "
                + ", ".join(NORMALISATIONS)
            )
        if self.dim % self.conv_pos_groups or self.dim_head % 2:
            raise ConfigError(f"{where}: dim must be a multiple of conv_pos_groups and dim_head even")
        for name in ("vocab_size", "input_size", "dim", "depth", "heads", "dim_head", "token_mel_ratio"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{where}.{name}: must be positive")


@dataclass
class FlowOutput(ModelOutput):
    """``loss`` (0-dim) and each sample's mean squared error ``sample_loss`` [B] (detached)."""

    loss: torch.Tensor | None = None
    sample_loss: torch.Tensor | None = None


@dataclass(frozen=True)
class SampleDraws:
    """What one sample's seed decides (module docstring)."""

    t: float
    keep_condition: bool
    prompt_frames: int
    streaming: bool
    noise: torch.Tensor  # [T, mel] float32


def draw(seed: int, frames: int, config: FlowConfig) -> SampleDraws:
    """The draws of a sample of ``frames`` mel frames from its ``seed``, in a fixed order."""
    g = torch.Generator()
    g.manual_seed(int(seed) & (2**63 - 1))

    def uniform() -> float:
        return float(torch.rand((), generator=g, dtype=torch.float64))

    t = uniform()
    keep = uniform() >= config.training_cfg_rate
    prompt = 0
    if uniform() < config.prompt_prob:
        prompt = int(uniform() * (math.floor(config.prompt_max_ratio * frames) + 1))
    streaming = uniform() < config.streaming_prob
    noise = torch.randn(frames, config.input_size, generator=g, dtype=torch.float32)
    return SampleDraws(t, keep, prompt, streaming, noise)


class PreLookaheadLayer(nn.Module):
    """``x + conv2(causal, LeakyReLU(conv1(x and pre_lookahead_len frames of look-ahead)))``, [B, S, C]."""

    def __init__(self, channels: int, hidden: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, hidden, lookahead + 1)
        self.conv2 = nn.Conv1d(hidden, channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(x.transpose(1, 2), (0, self.lookahead))
        h = F.leaky_relu(self.conv1(h), 0.01)
        h = self.conv2(F.pad(h, (2, 0)))
        return x + h.transpose(1, 2)


class ConditionalCFM(nn.Module):
    """The official ``decoder``: holds the estimator (the flow-matching logic is the model's)."""

    def __init__(self, config: FlowConfig) -> None:
        super().__init__()
        self.estimator = DiT(
            dim=config.dim,
            depth=config.depth,
            heads=config.heads,
            dim_head=config.dim_head,
            ff_mult=config.ff_mult,
            dropout=config.dropout,
            mel_dim=config.input_size,
            out_channels=config.input_size,
            conv_pos_kernel=config.conv_pos_kernel,
            conv_pos_groups=config.conv_pos_groups,
            static_chunk_size=config.static_chunk_size,
        )


def count_mel_frames(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """``ModelPlan.count_tokens``: the micro-batch's mel frames."""
    lengths: torch.Tensor = batch["mel_lengths"]
    return lengths.sum()


def read_flow_config(args: ModelArguments) -> FlowConfig:
    """The folder's ``config.json`` (if any; else the official sizes), then ``config_overrides``."""
    values: dict[str, Any] = {}
    if args.model_name_or_path:
        folder = Path(args.model_name_or_path)
        if not folder.is_dir():
            raise ConfigError(
                f"model.model_name_or_path: {str(folder)!r} is not a local folder; mm never downloads"
            )
        path = folder / "config.json"
        if path.is_file():
            try:
                values = json.loads(path.read_text(encoding="utf-8"))
            except ValueError as exc:
                raise ConfigError(f"model.model_name_or_path: {path} is not valid JSON ({exc})") from None
            FlowConfig.read(values, str(path))
    values.update(args.config_overrides)
    return FlowConfig.read(values, OVERRIDES)


class CosyVoice3FlowForTraining(nn.Module, BaseModel):
    """CosyVoice3's flow-matching acoustic model (module docstring)."""

    mm_plan: ClassVar[ModelPlan] = ModelPlan(
        fsdp_units=("decoder.estimator.transformer_blocks.{*}",),
        recompute_units=("decoder.estimator.transformer_blocks.{*}",),
        muon_exclude_modules=(
            "input_embedding",
            "spk_embed_affine_layer",
            "pre_lookahead_layer",
            "decoder.estimator.time_embed",
            "decoder.estimator.input_embed",
            "decoder.estimator.norm_out",
            "decoder.estimator.proj_out",
        ),
        count_tokens=count_mel_frames,
    )

    def __init__(self, config: FlowConfig | None = None) -> None:
        super().__init__()
        config = config or FlowConfig()
        self.config = config
        self.input_embedding = nn.Embedding(config.vocab_size, config.input_size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.input_size)
        self.pre_lookahead_layer = PreLookaheadLayer(
            config.input_size, config.pre_lookahead_channels, config.pre_lookahead_len
        )
        self.decoder = ConditionalCFM(config)

    # --------------------------------------------------------------------------------------- building
    @classmethod
    def _from_config(cls, args: ModelArguments) -> CosyVoice3FlowForTraining:
        refuse_official_only_on_meta(args, OFFICIAL_FILE, "cosyvoice3_flow")
        return cls(read_flow_config(args))

    @classmethod
    def from_pretrained(cls, args: ModelArguments) -> CosyVoice3FlowForTraining:
        """Build from the folder's config and load ``model.safetensors`` or the official ``flow.pt``."""
        if not args.model_name_or_path:
            raise ConfigError(
                "model.model_name_or_path: not set; point it at a folder with flow.pt or model.safetensors, "
                "or set model.from_scratch: true"
            )
        model = cls(read_flow_config(args))
        state, source = read_state(Path(args.model_name_or_path), OFFICIAL_FILE)
        load_checked(model, state, source)
        return model

    @torch.no_grad()
    def init_weights(self) -> None:
        """torch's default initialisation of every layer (as the official model is constructed) and the
        rotary frequencies."""
        for module in self.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset) and module is not self:
                reset()
        rotary = self.decoder.estimator.rotary_embed
        rotary.inv_freq.copy_(rotary.frequencies(rotary.inv_freq.device))

    def save_pretrained(self, save_directory: str | Path, **_: Any) -> None:
        """``config.json`` (:class:`FlowConfig`) and ``model.safetensors``."""
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        config = dataclasses.asdict(self.config)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_safetensors(self, folder)

    # ---------------------------------------------------------------------------------------- forward
    def token_features(self, speech_tokens: torch.Tensor, speech_lengths: torch.Tensor) -> torch.Tensor:
        """``mu`` [B, ratio · S, mel]: token embeddings (zero beyond each length) through the look-ahead
        layer, each repeated ``token_mel_ratio`` times."""
        valid = (
            torch.arange(speech_tokens.shape[1], device=speech_tokens.device)[None] < speech_lengths[:, None]
        )
        e = self.input_embedding(speech_tokens.clamp(min=0)) * valid.unsqueeze(-1).to(
            self.input_embedding.weight.dtype
        )
        return self.pre_lookahead_layer(e).repeat_interleave(self.config.token_mel_ratio, dim=1)

    def speaker_vector(self, speaker: torch.Tensor) -> torch.Tensor:
        weight = self.spk_embed_affine_layer.weight
        out: torch.Tensor = self.spk_embed_affine_layer(F.normalize(speaker.to(weight.dtype), dim=-1))
        return out

    def forward(
        self,
        speech_tokens: torch.Tensor,
        speech_lengths: torch.Tensor,
        mel: torch.Tensor,
        mel_lengths: torch.Tensor,
        speaker: torch.Tensor,
        noise_seed: Sequence[int] | torch.Tensor,
        **_: Any,
    ) -> FlowOutput:
        """The flow-matching loss of a batch (module docstring): ``speech_tokens`` [B, S], ``mel`` [B, T, 80]
        with ``T = ratio · S`` (lengths likewise), ``speaker`` [B, 192], one ``noise_seed`` per sample."""
        c = self.config
        seeds = [
            int(s) for s in (noise_seed.tolist() if isinstance(noise_seed, torch.Tensor) else noise_seed)
        ]
        batch, frames_max = mel.shape[0], mel.shape[1]
        if len(seeds) != batch:
            raise DataError(f"cosyvoice3_flow: {len(seeds)} noise seeds for a batch of {batch} samples")
        if frames_max != c.token_mel_ratio * speech_tokens.shape[1]:
            raise DataError(
                f"cosyvoice3_flow: {frames_max} mel frames for {speech_tokens.shape[1]} speech tokens; "
                f"expected {c.token_mel_ratio} frames per token"
            )
        lengths = [int(n) for n in mel_lengths.tolist()]
        draws = [draw(s, n, c) for s, n in zip(seeds, lengths)]
        device, dtype = mel.device, self.input_embedding.weight.dtype
        frames = torch.arange(frames_max, device=device)[None] < mel_lengths[:, None]
        x1 = mel.to(dtype)
        noise = torch.zeros(batch, frames_max, c.input_size, dtype=torch.float32)
        cond = torch.zeros_like(x1)
        for b, d in enumerate(draws):
            noise[b, : lengths[b]] = d.noise
            cond[b, : d.prompt_frames] = x1[b, : d.prompt_frames]
        z = noise.to(device=device, dtype=dtype)
        t = torch.tensor([d.t for d in draws], device=device, dtype=dtype)
        keep = torch.tensor([d.keep_condition for d in draws], device=device, dtype=dtype)
        streaming = torch.tensor([d.streaming for d in draws], device=device)
        tt = t.view(-1, 1, 1)
        y = (1 - (1 - c.sigma_min) * tt) * z + tt * x1
        u = x1 - (1 - c.sigma_min) * z
        mu = self.token_features(speech_tokens, speech_lengths) * keep.view(-1, 1, 1)
        spk = self.speaker_vector(speaker) * keep.view(-1, 1)
        cond = cond * keep.view(-1, 1, 1)
        v = self.decoder.estimator(y, frames, mu, t, spk, cond, streaming)
        weight = frames.unsqueeze(-1).float()
        err = (v.float() - u.float()).square() * weight
        per_sample = err.sum(dim=(1, 2)) / (weight.sum(dim=(1, 2)) * c.input_size).clamp(min=1)
        if c.loss_normalization == "frame":
            loss = err.sum() / (weight.sum() * c.input_size).clamp(min=1)
        else:
            loss = per_sample.mean()
        return FlowOutput(loss=loss, sample_loss=per_sample.detach())

    # -------------------------------------------------------------------------------------- inference
    @torch.no_grad()
    def sample(
        self,
        speech_tokens: torch.Tensor,
        speaker: torch.Tensor,
        prompt_mel: torch.Tensor | None = None,
        *,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        temperature: float = 1.0,
        seed: int = 0,
    ) -> torch.Tensor:
        """The mel ``[B, ratio · S, 80]`` of ``speech_tokens`` [B, S] (the prompt's tokens first, when
        ``prompt_mel`` [B, T_p, 80] is given: its frames condition the start) for ``speaker`` [B, 192]: Euler
        on the cosine time schedule with classifier-free guidance (defaults from the config: 10 steps, 0.7).
        The caller keeps the frames after the prompt."""
        c = self.config
        steps = n_timesteps or c.n_timesteps
        w = c.inference_cfg_rate if cfg_rate is None else cfg_rate
        device, dtype = speech_tokens.device, self.input_embedding.weight.dtype
        batch, tokens = speech_tokens.shape
        lengths = torch.full((batch,), tokens, device=device, dtype=torch.long)
        mu = self.token_features(speech_tokens, lengths)
        n = mu.shape[1]
        frames = torch.ones(batch, n, dtype=torch.bool, device=device)
        cond = torch.zeros_like(mu)
        if prompt_mel is not None:
            cond[:, : prompt_mel.shape[1]] = prompt_mel.to(dtype)
        spk = self.speaker_vector(speaker.to(device))
        g = torch.Generator()
        g.manual_seed(int(seed))
        x = (torch.randn(batch, n, c.input_size, generator=g) * temperature).to(device=device, dtype=dtype)
        offline = torch.zeros(batch, dtype=torch.bool, device=device)
        schedule = [1 - math.cos(k / steps * math.pi / 2) for k in range(steps + 1)]
        zeros_mu, zeros_spk = torch.zeros_like(mu), torch.zeros_like(spk)
        estimator = self.decoder.estimator
        for k in range(steps):
            t = torch.full((batch,), schedule[k], device=device, dtype=dtype)
            v_cond = estimator(x, frames, mu, t, spk, cond, offline)
            v_free = estimator(x, frames, zeros_mu, t, zeros_spk, torch.zeros_like(cond), offline)
            x = x + (schedule[k + 1] - schedule[k]) * ((1 + w) * v_cond - w * v_free)
        return x.float()
