"""``wan2_2``: diffusers' ``WanTransformer3DModel`` (Wan2.1 / Wan2.2) trained with flow matching on
precomputed latents.

The training class *is* the diffusers transformer (a subclass), so its parameters carry diffusers' names:
``model.model_name_or_path`` is a diffusers model folder (``config.json`` + ``diffusion_pytorch_model*
.safetensors``, e.g. the ``transformer/`` folder of a pipeline), which mm loads like a Hugging Face folder,
also into a meta-device model (``training.init_model_with_meta_device``); ``mm convert dcp-to-hf`` calls the
inherited ``save_pretrained`` (overridden only to record the diffusers class name), so the export is a folder
``WanTransformer3DModel.from_pretrained`` loads. The VAE and the text encoder are not part of the model: the
batch carries latents and text embeddings computed once by ``mm_data_video.encode_clips``.

**Batch.** ``latents`` [B, C, F, H, W] (normalised VAE latents), ``encoder_hidden_states`` [B, L, text_dim]
(text embeddings, zero-padded as Wan's pipeline pads them), ``noise_seed`` (one int per sample). The forward
draws σ and the noise of every sample from its seed (:mod:`mm_models_video.flow_matching`) and returns
``.loss`` (train with ``model.loss_cfg.loss_type: raw``) and ``.sigmas``; :meth:`~Wan22ForTraining.velocity`
is the plain prediction, for sampling.

**Wan2.2 A14B** has two experts over the noise levels: ``transformer/`` denoises ``σ >= boundary_ratio``
(high noise) and ``transformer_2/`` the rest (low noise); ``boundary_ratio`` is in the pipeline's
``model_index.json``. A run trains one expert: point ``model_name_or_path`` at its folder; the expert and
the boundary are read from the folder name and the parent's ``model_index.json`` (or given as
``config_overrides.expert`` / ``boundary_ratio``), and σ is drawn from that expert's range only. Two runs
train the two experts.

``model.config_overrides``: any ``WanTransformer3DModel`` config key (e.g. ``num_layers``), plus
``flow_matching`` (``timestep_sampling``, ``logit_mean``, ``logit_std``, ``shift``, ``weighting``,
``text_dropout``),
``expert`` (``high_noise`` / ``low_noise``) and ``boundary_ratio``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformer3DModel
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
    model_folder,
    name_diffusers_class,
)
from .flow_matching import TIMESTEP_SCALE, FlowMatching
from .ulysses import UlyssesSplit, attach_ulysses

#: config_overrides keys that are training settings, not transformer config keys
TRAINING_KEYS = ("flow_matching", "expert", "boundary_ratio")
EXPERTS = ("high_noise", "low_noise")
#: the pipeline subfolder of each expert
EXPERT_FOLDERS = {"transformer": "high_noise", "transformer_2": "low_noise"}


@dataclass
class WanTrainingOutput:
    """What the training forward returns: the flow-matching loss and each sample's noise level (the
    prediction itself comes from :meth:`Wan22ForTraining.velocity`)."""

    loss: torch.Tensor
    sigmas: torch.Tensor


@dataclass(frozen=True)
class WanTraining:
    """The training settings read from ``model.config_overrides`` (module docstring)."""

    flow: FlowMatching
    expert: str | None = None
    boundary_ratio: float | None = None


def _pipeline_boundary(folder: Path) -> float | None:
    """``boundary_ratio`` of the pipeline whose component ``folder`` is (its parent's model_index.json)."""
    index = folder.parent / "model_index.json"
    if not index.is_file():
        return None
    try:
        value = json.loads(index.read_text(encoding="utf-8")).get("boundary_ratio")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.model_name_or_path: cannot read {index}: {exc}") from None
    return float(value) if value is not None else None


def read_training(args: ModelArguments) -> WanTraining:
    """The flow-matching settings and the expert of this run, checked (errors name the YAML key)."""
    options = args.config_overrides
    expert = options.get("expert")
    boundary = options.get("boundary_ratio")
    folder = model_folder(args)
    if boundary is None and folder is not None:
        boundary = _pipeline_boundary(folder)
    if expert is None and folder is not None and boundary is not None:
        expert = EXPERT_FOLDERS.get(folder.name)
    if expert is not None and expert not in EXPERTS:
        raise ConfigError(f"{OVERRIDES}.expert: got {expert!r}; accepted: {', '.join(EXPERTS)}")
    if boundary is not None and (
        isinstance(boundary, bool) or not isinstance(boundary, (int, float)) or not 0 < boundary < 1
    ):
        raise ConfigError(f"{OVERRIDES}.boundary_ratio: got {boundary!r}; expected a number in (0, 1)")
    if expert is not None and boundary is None:
        raise ConfigError(
            f"{OVERRIDES}.expert: {expert!r} needs the boundary between the experts; set "
            f"{OVERRIDES}.boundary_ratio (Wan2.2 A14B text-to-video: 0.875) or point "
            "model.model_name_or_path at the transformer folder of a pipeline whose model_index.json has it"
        )
    low, high = 0.0, 1.0
    if expert == "high_noise":
        low = float(boundary)  # type: ignore[arg-type]  # checked above
    elif expert == "low_noise":
        high = float(boundary)  # type: ignore[arg-type]  # checked above
    flow = FlowMatching.from_options(options.get("flow_matching"), f"{OVERRIDES}.flow_matching")
    flow = dataclasses.replace(flow, low=low, high=high)
    return WanTraining(flow, expert, float(boundary) if boundary is not None else None)


def _overrides(args: ModelArguments) -> dict[str, Any]:
    return config_overrides(args, WanTransformer3DModel, TRAINING_KEYS, ("patch_size",))


class Wan22ForTraining(WanTransformer3DModel, BaseModel):  # type: ignore[misc]  # diffusers: untyped base
    """A ``WanTransformer3DModel`` whose forward takes the batch and returns the flow-matching loss."""

    mm_plan: ClassVar[ModelPlan] = ModelPlan(
        fsdp_units=("blocks.{*}",),
        recompute_units=("blocks.{*}",),
        muon_exclude_modules=(
            "patch_embedding",
            "condition_embedder",
            "proj_out",
            "scale_shift_table",
            "blocks.{*}.scale_shift_table",
        ),
        count_tokens=count_tokens,
        context_parallel=context_parallel,
    )

    mm_training: WanTraining = WanTraining(FlowMatching())
    _mm_ulysses: UlyssesSplit | None = None

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
        """Load ``model.model_name_or_path`` (a local diffusers model folder); missing weights are an
        error."""
        training = read_training(args)
        model: Any = load_folder(super().from_pretrained, args, WanTransformer3DModel, _overrides(args))
        model.mm_training = training
        built: nn.Module = model
        return built

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter as diffusers' constructor does and recompute the rotary tables
        (non-persistent buffers: after a meta-device build they hold garbage)."""
        for module in self.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset) and module is not self:
                reset()
        for name, param in self.named_parameters():
            if name.endswith("scale_shift_table"):
                param.normal_(0.0, param.shape[-1] ** -0.5)
            elif name.endswith("pos_embed"):
                param.zero_()
        rope: Any = self.rope
        with torch.device("cpu"):
            fresh = WanRotaryPosEmbed(rope.attention_head_dim, rope.patch_size, rope.max_seq_len)
        rope.freqs_cos.copy_(fresh.freqs_cos)
        rope.freqs_sin.copy_(fresh.freqs_sin)

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> None:  # type: ignore[override]
        """diffusers' ``save_pretrained``; ``config.json`` names ``WanTransformer3DModel`` (not this class),
        so any diffusers pipeline or ``AutoModel`` loads the export."""
        super().save_pretrained(save_directory, **kwargs)
        name_diffusers_class(save_directory, WanTransformer3DModel)

    # -------------------------------------------------------------------------------------- parallel
    def use_context_parallel(self, mesh: DeviceMesh) -> None:
        """``ModelPlan.context_parallel``: split the video tokens over ``mesh["ulysses"]``
        (:mod:`mm_models_video.ulysses`)."""
        self._mm_ulysses = attach_ulysses(self, mesh)

    def tokens_of(self, latents: torch.Tensor) -> int:
        """Video tokens of one sample of ``latents`` [..., C, F, H, W] after patchify."""
        config: Any = self.config
        p_t, p_h, p_w = config.patch_size
        f, h, w = latents.shape[-3:]
        return (f // p_t) * (h // p_h) * (w // p_w)

    def local_tokens(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """``ModelPlan.count_tokens``: the video tokens of the micro-batch this rank computes (its share of
        them under context parallelism)."""
        latents = batch["latents"]
        tokens = latents.shape[0] * self.tokens_of(latents)
        split = self._mm_ulysses
        return torch.tensor(float(tokens // (split.size if split else 1)), dtype=torch.float64)

    # --------------------------------------------------------------------------------------- forward
    def velocity(
        self, x_t: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor
    ) -> torch.Tensor:
        """The transformer's prediction (diffusers' forward) for noised latents at ``timestep`` [B]. Called
        directly it bypasses FSDP's root hooks: sample with an unsharded model (e.g. the exported folder)."""
        out = super().forward(
            hidden_states=x_t,
            timestep=timestep,
            encoder_hidden_states=encoder_hidden_states,
            return_dict=False,
        )
        prediction: torch.Tensor = out[0]
        return prediction

    def forward(
        self,
        latents: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        noise_seed: Sequence[int] | torch.Tensor,
        **kwargs: Any,
    ) -> WanTrainingOutput:
        """The flow-matching loss of a batch (module docstring); ``kwargs`` (``use_cache``) are ignored."""
        if latents.dim() != 5:
            raise DataError(
                f"latents: expected [batch, channels, frames, height, width], got {tuple(latents.shape)}"
            )
        config: Any = self.config
        p_t, p_h, p_w = config.patch_size
        f, h, w = latents.shape[-3:]
        if f % p_t or h % p_h or w % p_w:
            raise DataError(
                f"latents of shape {tuple(latents.shape)}: frames/height/width must be multiples of the "
                f"patch size {(p_t, p_h, p_w)}"
            )
        seeds = [
            int(s) for s in (noise_seed.tolist() if isinstance(noise_seed, torch.Tensor) else noise_seed)
        ]
        flow = self.mm_training.flow
        x_t, sigmas, target = flow.noised(latents, seeds)
        timestep = sigmas * TIMESTEP_SCALE
        text = flow.drop_text(encoder_hidden_states.to(x_t.dtype), seeds)
        prediction = self.velocity(x_t, timestep, text)
        return WanTrainingOutput(loss=flow.loss(prediction, target, sigmas), sigmas=sigmas)
