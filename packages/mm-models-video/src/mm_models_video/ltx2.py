"""``ltx2``: diffusers' ``LTX2VideoTransformer3DModel`` (LTX-2, audio + video) trained with flow matching on
precomputed video latents, audio latents and text embeddings.

The training class *is* the diffusers
transformer (a subclass): parameters carry diffusers' names, ``model.model_name_or_path`` is a diffusers model
folder (a pipeline's ``transformer/``), loaded also into a meta-device model, and ``mm convert dcp-to-hf``
writes a folder that ``LTX2VideoTransformer3DModel.from_pretrained`` loads. What the LTX-2 pipeline runs
around the transformer is frozen and never part of the model: the video VAE, the audio VAE and its vocoder,
the Gemma-3 text encoder and the **text connectors** (``connectors/``, ``LTX2TextConnectors``). The connectors
are a separate pipeline component that turns Gemma's stacked hidden states into the transformer's video and
audio text inputs; mm keeps them frozen and precomputed, so the stored text embeddings are the connectors'
outputs (the video one and the audio one) and the export is the transformer alone, which drops into the
pipeline beside the original connectors.

**Batch** (the ``video_latents`` dataset and collator of mm-data-video):

- ``latents`` [B, C, F, H, W]: normalised video VAE latents (the transformer packs them into tokens
  [B, F·H·W / patch, C·patch] as the pipeline's ``_pack_latents`` does);
- ``encoder_hidden_states`` [B, L, caption_channels] and ``encoder_attention_mask`` [B, L]: the video text
  connector's output and its mask (1 for real tokens, 0 for the dataset's padding);
- ``audio_latents`` [B, C_a, L_a, M] (optional): normalised audio VAE latents (packed to [B, L_a, C_a·M] as
  the pipeline packs them) and ``audio_encoder_hidden_states`` [B, L, caption_channels], the audio text
  connector's output (same mask). Without audio latents the run is text-to-video: the audio-video
  cross-attention is off (diffusers' ``isolate_modalities``), so the audio stream (one zero placeholder
  token: diffusers' transformer always runs it) cannot reach the video, and the loss is video only;
- ``noise_seed``: one int per sample.

**Joint loss.** Each sample draws one σ and then the video noise and the audio noise from a CPU generator
seeded with its ``noise_seed`` (:meth:`FlowMatching.draw_all`): video and audio are noised at the same
level, as LTX-2's pipeline denoises them with one schedule. The transformer sees both at timestep
``σ · timestep_scale_multiplier`` (per sample, for both streams: ``audio_timestep`` is passed explicitly)
and predicts both velocities. ``loss = video_loss + audio_loss_weight · audio_loss``, each the flow-matching
mean squared error of its modality (per sample over that modality's latent elements, optionally weighted
per sample, then averaged over the batch); ``audio_loss_weight`` defaults to 1 (the two errors simply
added). The forward returns ``.loss``, ``.video_loss``, ``.audio_loss`` (None without audio) and
``.sigmas``.

``model.config_overrides``: any ``LTX2VideoTransformer3DModel`` config key, plus ``flow_matching`` (as for
``wan2_2``; ``text_dropout`` zeroes the video text and the audio text of the same samples),
``audio_loss_weight`` and ``frame_rate`` (the clips' frames per second, for the video rotary
positions: the pipeline's ``frame_rate``, 24 by default).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformer3DModel
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mm_core.errors import ConfigError, DataError
from mm_core.models import BaseModel, ModelArguments, ModelPlan

from .diffusers_model import (
    OVERRIDES,
    config_from,
    config_overrides,
    context_parallel,
    count_tokens,
    load_folder,
    name_diffusers_class,
)
from .flow_matching import FlowMatching
from .ltx2_activations import count_activations
from .ulysses_ltx2 import UlyssesLTX2Split, attach_ulysses_ltx2

#: config_overrides keys that are training settings, not transformer config keys
TRAINING_KEYS = ("flow_matching", "audio_loss_weight", "frame_rate")


@dataclass
class LTX2TrainingOutput:
    """The training forward's result: the joint loss, its two parts and each sample's noise level."""

    loss: torch.Tensor
    video_loss: torch.Tensor
    audio_loss: torch.Tensor | None
    sigmas: torch.Tensor


@dataclass(frozen=True)
class LTX2Training:
    """The training settings read from ``model.config_overrides`` (module docstring)."""

    flow: FlowMatching
    audio_loss_weight: float = 1.0
    frame_rate: float = 24.0


def _positive(options: Mapping[str, Any], key: str, default: float, zero_ok: bool) -> float:
    value = options.get(key, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{OVERRIDES}.{key}: got {value!r}; expected a number {bound}")
    return float(value)


def read_training(args: ModelArguments) -> LTX2Training:
    """The flow-matching settings, the audio loss weight and the frame rate (errors name the YAML key)."""
    options = args.config_overrides
    flow = FlowMatching.from_options(options.get("flow_matching"), f"{OVERRIDES}.flow_matching")
    weight = _positive(options, "audio_loss_weight", 1.0, zero_ok=True)
    return LTX2Training(flow, weight, _positive(options, "frame_rate", 24.0, zero_ok=False))


def pack_video(latents: torch.Tensor, patch: int, patch_t: int) -> torch.Tensor:
    """[B, C, F, H, W] -> tokens [B, F/pt · H/p · W/p, C·pt·p·p] in the order of the LTX-2 pipeline's
    ``_pack_latents`` (frames, then rows, then columns; channels, then the patch offsets)."""
    b, c, f, h, w = latents.shape
    x = latents.reshape(b, c, f // patch_t, patch_t, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack_video(tokens: torch.Tensor, shape: Sequence[int], patch: int, patch_t: int) -> torch.Tensor:
    """The inverse of :func:`pack_video` for latents of ``shape`` [B, C, F, H, W]."""
    b, c, f, h, w = shape
    x = tokens.reshape(b, f // patch_t, h // patch, w // patch, c, patch_t, patch, patch)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, c, f, h, w)


def pack_audio(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, L, M] -> [B, L, C·M], the LTX-2 pipeline's audio packing (one token per latent frame)."""
    return latents.transpose(1, 2).flatten(2, 3)


def unpack_audio(tokens: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The inverse of :func:`pack_audio` for latents of ``shape`` [B, C, L, M]."""
    return tokens.unflatten(2, (shape[1], shape[3])).transpose(1, 2)


def _overrides(args: ModelArguments) -> dict[str, Any]:
    return config_overrides(args, LTX2VideoTransformer3DModel, TRAINING_KEYS, ("vae_scale_factors",))


class LTX2ForTraining(LTX2VideoTransformer3DModel, BaseModel):  # type: ignore[misc]  # diffusers: untyped base
    """An ``LTX2VideoTransformer3DModel`` whose forward takes the batch and returns the joint flow-matching
    loss of the video and the audio latents."""

    mm_plan: ClassVar[ModelPlan] = ModelPlan(
        fsdp_units=("transformer_blocks.{*}",),
        recompute_units=("transformer_blocks.{*}",),
        muon_exclude_modules=(
            "*proj_in",  # the video and audio patch embeddings
            "*caption_projection",
            "*time_embed",
            "av_cross_attn_*",
            "*prompt_adaln",
            "*proj_out",
            "*scale_shift_table",
            "keyframes_abs_pos_embedding",
            "transformer_blocks.{*}.*scale_shift_table",  # the per-block modulation tables (6-9 × dim)
        ),
        count_tokens=count_tokens,
        context_parallel=context_parallel,
        loss_parts=("video_loss", "audio_loss"),  # logged beside the joint loss
        activations=count_activations,  # mm check's memory estimate
    )

    mm_training: LTX2Training = LTX2Training(FlowMatching())
    _mm_ulysses: UlyssesLTX2Split | None = None

    # --------------------------------------------------------------------------------------- building
    @classmethod
    def _from_config(cls, args: ModelArguments) -> nn.Module:
        training = read_training(args)
        model: Any = config_from(cls, args, _overrides(args))
        model.mm_training = training
        built: nn.Module = model
        return built

    @classmethod
    def from_pretrained(cls, args: ModelArguments) -> nn.Module:  # type: ignore[override]
        """Load ``model.model_name_or_path`` (a local diffusers model folder: a pipeline's ``transformer/``);
        missing weights are an error."""
        training = read_training(args)
        model: Any = load_folder(super().from_pretrained, args, LTX2VideoTransformer3DModel, _overrides(args))
        model.mm_training = training
        built: nn.Module = model
        return built

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter as diffusers' constructor does (the model has no buffers: its rotary
        tables are computed in the forward)."""
        for module in self.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset) and module is not self:
                reset()
            elif isinstance(module, RMSNorm) and module.weight is not None:  # diffusers' norm: no reset
                module.weight.fill_(1.0)
                bias = getattr(module, "bias", None)
                if bias is not None:
                    bias.zero_()
        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf.endswith(("prompt_scale_shift_table", "a2v_cross_attn_scale_shift_table")):
                param.normal_(0.0, 1.0)  # diffusers: randn
            elif leaf.endswith("scale_shift_table"):
                param.normal_(0.0, param.shape[-1] ** -0.5)  # diffusers: randn / sqrt(dim)
            elif leaf == "keyframes_abs_pos_embedding":
                param.zero_()

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> None:  # type: ignore[override]
        """diffusers' ``save_pretrained``; ``config.json`` names ``LTX2VideoTransformer3DModel``, so an LTX-2
        pipeline (as its ``transformer/``) or ``AutoModel`` loads the export."""
        super().save_pretrained(save_directory, **kwargs)
        name_diffusers_class(save_directory, LTX2VideoTransformer3DModel)

    # -------------------------------------------------------------------------------------- parallel
    def use_context_parallel(self, mesh: DeviceMesh) -> None:
        """``ModelPlan.context_parallel``: split the video tokens over ``mesh["ulysses"]``, the audio stays
        whole (:mod:`mm_models_video.ulysses_ltx2`)."""
        self._mm_ulysses = attach_ulysses_ltx2(self, mesh)

    def tokens_of(self, latents: torch.Tensor) -> int:
        """Video tokens of one sample of ``latents`` [..., C, F, H, W] after patchify."""
        config: Any = self.config
        f, h, w = latents.shape[-3:]
        p, pt = int(config.patch_size), int(config.patch_size_t)
        return (f // pt) * (h // p) * (w // p)

    def local_tokens(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """``ModelPlan.count_tokens``: video plus audio tokens of the micro-batch, this rank's share under
        context parallelism (the audio, computed whole on every rank, is counted ``1/U`` per rank)."""
        latents = batch["latents"]
        tokens = float(latents.shape[0] * self.tokens_of(latents))
        audio = batch.get("audio_latents")
        if audio is not None:
            tokens += float(audio.shape[0] * audio.shape[2])
        split = self._mm_ulysses
        return torch.tensor(tokens / (split.size if split else 1), dtype=torch.float64)

    # --------------------------------------------------------------------------------------- forward
    def _check(self, latents: torch.Tensor, audio_latents: torch.Tensor | None) -> None:
        config: Any = self.config
        if latents.dim() != 5:
            raise DataError(
                f"latents: expected [batch, channels, frames, height, width], got {tuple(latents.shape)}"
            )
        p, pt = int(config.patch_size), int(config.patch_size_t)
        f, h, w = latents.shape[-3:]
        if f % pt or h % p or w % p:
            raise DataError(
                f"latents of shape {tuple(latents.shape)}: frames must be a multiple of patch_size_t {pt}, "
                f"height and width of patch_size {p}"
            )
        if latents.shape[1] * pt * p * p != int(config.in_channels):
            raise DataError(
                f"latents of shape {tuple(latents.shape)}: {latents.shape[1]} channels × patch "
                f"{pt}×{p}×{p} do not give the transformer's in_channels {config.in_channels}"
            )
        if audio_latents is None:
            return
        if audio_latents.dim() != 4 or audio_latents.shape[0] != latents.shape[0]:
            raise DataError(
                f"audio_latents: expected [batch, channels, length, mel bins] for the batch of "
                f"{latents.shape[0]}, got {tuple(audio_latents.shape)}"
            )
        c, _, m = audio_latents.shape[1:]
        if c * m != int(config.audio_in_channels):
            raise DataError(
                f"audio_latents of shape {tuple(audio_latents.shape)}: {c} channels × {m} mel bins do not "
                f"give the transformer's audio_in_channels {config.audio_in_channels}"
            )

    def velocity(
        self,
        x_t: torch.Tensor,
        audio_x_t: torch.Tensor | None,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        audio_encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The transformer's predictions (diffusers' forward) for noised video latents [B, C, F, H, W] and
        audio latents [B, C_a, L_a, M] (or None: text-to-video) at ``timestep`` [B] (already scaled by
        ``timestep_scale_multiplier``), in the latents' shapes. Called directly it bypasses FSDP's root
        hooks: sample with an unsharded model (e.g. the exported folder)."""
        self._check(x_t, audio_x_t)
        config: Any = self.config
        p, pt = int(config.patch_size), int(config.patch_size_t)
        b, _, f, h, w = x_t.shape
        device = x_t.device
        video = pack_video(x_t, p, pt)
        if audio_x_t is None:  # diffusers always runs the audio stream: one zero token it cannot pass on
            audio = video.new_zeros(b, 1, int(config.audio_in_channels))
            audio_text = encoder_hidden_states
        else:
            if audio_encoder_hidden_states is None:
                raise DataError(
                    "audio_encoder_hidden_states: the batch has audio_latents but no audio text embeddings "
                    "(the audio text connector's output: the store's audio_text arrays)"
                )
            audio = pack_audio(audio_x_t)
            audio_text = audio_encoder_hidden_states
        video_coords = self.rope.prepare_video_coords(b, f, h, w, device, fps=self.mm_training.frame_rate)
        audio_coords = self.audio_rope.prepare_audio_coords(b, audio.shape[1], device)
        mask = encoder_attention_mask
        out = super().forward(
            hidden_states=video,
            audio_hidden_states=audio,
            encoder_hidden_states=encoder_hidden_states.to(video.dtype),
            audio_encoder_hidden_states=audio_text.to(video.dtype),
            timestep=timestep,
            audio_timestep=timestep,  # per sample for both streams (never inferred from a per-token one)
            sigma=timestep,  # the pipeline passes the timestep (used by LTX-2.3's prompt modulation)
            audio_sigma=timestep,
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            video_coords=video_coords,
            audio_coords=audio_coords,
            isolate_modalities=audio_x_t is None,
            use_cross_timestep=True,  # the pipeline's default (equal timesteps: no difference)
            return_dict=False,
        )
        video_out = unpack_video(out[0], x_t.shape, p, pt)
        audio_out = None if audio_x_t is None else unpack_audio(out[1], audio_x_t.shape)
        return video_out, audio_out

    def forward(
        self,
        latents: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        noise_seed: Sequence[int] | torch.Tensor,
        audio_latents: torch.Tensor | None = None,
        audio_encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> LTX2TrainingOutput:
        """The joint flow-matching loss of a batch (module docstring); other ``kwargs`` (``use_cache``,
        ``sample_id``) are ignored."""
        self._check(latents, audio_latents)
        seeds = [
            int(s) for s in (noise_seed.tolist() if isinstance(noise_seed, torch.Tensor) else noise_seed)
        ]
        flow = self.mm_training.flow
        clean = [latents] if audio_latents is None else [latents, audio_latents]
        noised, sigmas, targets = flow.noised_all(clean, seeds)
        config: Any = self.config
        timestep = sigmas * float(config.timestep_scale_multiplier)
        audio_text = audio_encoder_hidden_states
        video, audio = self.velocity(
            noised[0],
            noised[1] if audio_latents is not None else None,
            timestep,
            flow.drop_text(encoder_hidden_states, seeds),
            None if audio_text is None else flow.drop_text(audio_text, seeds),
            encoder_attention_mask,
        )
        video_loss = flow.loss(video, targets[0], sigmas)
        if audio is None:
            return LTX2TrainingOutput(loss=video_loss, video_loss=video_loss, audio_loss=None, sigmas=sigmas)
        audio_loss = flow.loss(audio, targets[1], sigmas)
        loss = video_loss + self.mm_training.audio_loss_weight * audio_loss
        return LTX2TrainingOutput(loss=loss, video_loss=video_loss, audio_loss=audio_loss, sigmas=sigmas)
