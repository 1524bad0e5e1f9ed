"""Qwen3-TTS (``model.model_id: qwen3_tts``): the talker and the code predictor of the 12 Hz Qwen3-TTS
models, written here from the published architecture on transformers 5's Qwen3 layers, trained on codec codes.

**What is trained.** Speech is 16 codebooks per 80 ms frame (the 12 Hz speech tokenizer, not part of this
model). The *talker*, a Qwen3 decoder, reads one position per text token and per frame (a text track and a
codec track summed) and predicts codebook 0 of the next frame with ``codec_head``; the *code predictor*, a
small Qwen3 decoder run once per frame over ``[talker state, codebook 0, ..., codebook 14]``, predicts
codebooks 1..15 with one head each. The module tree spells the official tensor names
(:mod:`.qwen3_tts_weights`), so an official ``model.safetensors`` loads strictly by name, and exports load
in the official code.

**Batch** (mm-data-audio's ``tts_codes`` dataset and collator build it), every field [B, S] over the
positions of the talker's sequence unless said otherwise:

- ``input_ids``: the text track (role tokens, ``tts_pad``, ``tts_bos``, the text, ``tts_eos``, ``tts_pad``);
- ``codec_ids`` and ``codec_mask``: the codec track (control ids, codebook 0 of each frame, ``codec_eos``)
  and where it is present (not at the role tokens, not at a speaker x-vector slot);
- ``codes`` [B, S, G]: all G codebooks at the frame positions (``frame_mask``), zeros elsewhere; the
  talker's input at a frame is the sum of the G codebook embeddings;
- ``labels``: codebook 0 at each frame position and ``codec_eos`` after the last frame, -100 elsewhere
  (unshifted, as Hugging Face labels);
- ``attention_mask``; optional ``speaker_vectors`` [B, H] with ``speaker_slot``: x-vectors written over the
  codec track at the slot.

**Losses** (the inference-consistent formulation; the official fine-tuning script shifts its labels twice
and feeds the code predictor the frame's own talker state, which mm does not reproduce):

- ``talker_loss``: cross-entropy of ``codec_head`` at position p against ``labels[p + 1]`` (one shift);
- ``code_predictor_loss``: for each frame, the talker's final state at the position *before* the frame
  (the one that predicted its codebook 0) starts the code predictor's sequence; head j-1 at position j
  predicts codebook j (no further shift);
- ``loss = talker_loss + code_predictor_loss_weight × code_predictor_loss`` (weight 0.3, the official
  value; ``model.config_overrides.code_predictor_loss_weight``).

Each loss is the mean over the micro-batch's samples of the sample's mean over its targets, so that the
mean over data-parallel ranks of each rank's loss is the loss of the global micro-batch: train with
``model.loss_cfg.loss_type: raw``; both parts are reported in ``metrics.jsonl`` (``ModelPlan.loss_parts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import create_causal_mask
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from mm_core.errors import ConfigError, DataError
from mm_core.models import BaseModel, ModelArguments, ModelPlan
from mm_core.models.varlen import plain_attn_implementation

from .qwen3_tts_activations import count_activations
from .qwen3_tts_config import (
    DEFAULT_LOSS_WEIGHT,
    DecoderConfig,
    Qwen3TTSConfig,
    apply_overrides,
    read_config_file,
)
from .qwen3_tts_weights import load_official, save_official

IGNORE_INDEX = -100

#: decoder layers of both stacks are FSDP and recompute units; embeddings, heads, the text projection and
#: the final norms stay in the root unit. Embeddings and the 1 + 15 output heads stay on AdamW under Muon.
QWEN3_TTS_PLAN = ModelPlan(
    fsdp_units=("talker.model.layers.{*}", "talker.code_predictor.model.layers.{*}"),
    recompute_units=("talker.model.layers.{*}", "talker.code_predictor.model.layers.{*}"),
    muon_exclude_modules=(
        "talker.model.text_embedding",
        "talker.model.codec_embedding",
        "talker.code_predictor.model.codec_embedding",
        "talker.codec_head",
        "talker.code_predictor.lm_head",
    ),
    loss_parts=("talker_loss", "code_predictor_loss"),
    activations=count_activations,
    rms_norm_classes=("Qwen3RMSNorm",),
)


@dataclass
class Qwen3TTSOutput:
    """The training forward's result: the joint loss and its two parts (detached, for the metrics)."""

    loss: torch.Tensor
    talker_loss: torch.Tensor
    code_predictor_loss: torch.Tensor


class DecoderStack(nn.Module):
    """``layers``, ``norm`` and ``rotary_emb`` of one Qwen3 decoder (transformers' own modules), run on
    embeddings with 1-D positions."""

    def __init__(self, config: DecoderConfig, attn_implementation: str) -> None:
        super().__init__()
        self.qwen3 = config.qwen3(attn_implementation)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(self.qwen3, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(self.qwen3)

    def decode(
        self, embeds: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Causal decoder over ``embeds`` [N, L, H] (``attention_mask`` [N, L] or None: no padding); the
        final-norm states."""
        mask = create_causal_mask(
            config=self.qwen3,
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            cache=None,
            position_ids=position_ids,
        )
        rotary = self.rotary_emb(embeds, position_ids)
        hidden = embeds
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary)
        out: torch.Tensor = self.norm(hidden)
        return out

    @torch.no_grad()
    def reset_rotary(self) -> None:
        """Recompute the rotary frequencies (non-persistent buffers: garbage after a meta-device build)."""
        with torch.device("cpu"):
            fresh = Qwen3RotaryEmbedding(self.qwen3)
        for name in ("inv_freq", "original_inv_freq"):
            getattr(self.rotary_emb, name).copy_(getattr(fresh, name))


class TalkerModel(DecoderStack):
    """``talker.model``: the text and codec embeddings and the talker's decoder."""

    def __init__(self, config: Qwen3TTSConfig, attn_implementation: str) -> None:
        super().__init__(config.talker, attn_implementation)
        self.text_embedding = nn.Embedding(config.text_vocab_size, config.text_hidden_size)
        self.codec_embedding = nn.Embedding(config.talker.vocab_size, config.talker.hidden_size)


class TextProjection(nn.Module):
    """``talker.text_projection``: text embedding width -> text width -> talker width, SiLU between."""

    def __init__(self, text_hidden_size: int, hidden_size: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden_size, text_hidden_size, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden_size, hidden_size, bias=True)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_fc2(self.act_fn(self.linear_fc1(x)))
        return out


class CodePredictorModel(DecoderStack):
    """``talker.code_predictor.model``: the embeddings of codebooks 1..G-1 (talker width) and the decoder."""

    def __init__(self, config: Qwen3TTSConfig, attn_implementation: str) -> None:
        super().__init__(config.code_predictor, attn_implementation)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(config.code_predictor.vocab_size, config.talker.hidden_size)
            for _ in range(config.num_code_groups - 1)
        )


class CodePredictor(nn.Module):
    """``talker.code_predictor``: projection to its width (a Linear only when the widths differ), decoder,
    and one head per codebook 1..G-1."""

    def __init__(self, config: Qwen3TTSConfig, attn_implementation: str) -> None:
        super().__init__()
        width, own = config.talker.hidden_size, config.code_predictor.hidden_size
        self.small_to_mtp_projection: nn.Module = (
            nn.Linear(width, own, bias=True) if config.has_projection else nn.Identity()
        )
        self.model = CodePredictorModel(config, attn_implementation)
        self.lm_head = nn.ModuleList(
            nn.Linear(own, config.code_predictor.vocab_size, bias=False)
            for _ in range(config.num_code_groups - 1)
        )


class Talker(nn.Module):
    """``talker``: its model, the text projection, the codebook-0 head and the code predictor."""

    def __init__(self, config: Qwen3TTSConfig, attn_implementation: str) -> None:
        super().__init__()
        self.model = TalkerModel(config, attn_implementation)
        self.text_projection = TextProjection(config.text_hidden_size, config.talker.hidden_size)
        self.codec_head = nn.Linear(config.talker.hidden_size, config.talker.vocab_size, bias=False)
        self.code_predictor = CodePredictor(config, attn_implementation)


def _sample_mean(values: torch.Tensor, sample: torch.Tensor, batch: int) -> torch.Tensor:
    """The mean over samples (that have any value) of each sample's mean of ``values`` [N] (``sample`` [N]:
    the sample each value belongs to)."""
    sums = values.new_zeros(batch).index_add(0, sample, values)
    counts = torch.bincount(sample, minlength=batch).to(values.dtype)
    present = counts > 0
    return (sums[present] / counts[present]).mean()


def load_config(args: ModelArguments) -> tuple[Qwen3TTSConfig, float]:
    """The model config (``model_name_or_path``'s config.json, else the 1.7B defaults, plus
    ``model.config_overrides``) and the code predictor's loss weight."""
    path = args.model_name_or_path
    data = read_config_file(path) if path else {}
    data, weight = apply_overrides(data, args.config_overrides)
    where = f"{path}/config.json" if path else "model.config_overrides"
    return Qwen3TTSConfig.from_dict(data, where), weight


class Qwen3TTSForTraining(nn.Module, BaseModel):
    """Qwen3-TTS talker + code predictor with both training losses (module docstring)."""

    mm_plan: ClassVar[ModelPlan] = QWEN3_TTS_PLAN

    def __init__(
        self,
        config: Qwen3TTSConfig,
        attn_implementation: str = "sdpa",
        code_predictor_loss_weight: float = DEFAULT_LOSS_WEIGHT,
    ) -> None:
        super().__init__()
        self.config = config
        self.code_predictor_loss_weight = code_predictor_loss_weight
        self.talker = Talker(config, attn_implementation)

    # --------------------------------------------------------------------------------------- building
    @classmethod
    def _from_config(cls, args: ModelArguments) -> nn.Module:
        """The structure from the config (on the meta device under ``init_model_with_meta_device``; else
        initialised as :meth:`init_weights` does)."""
        config, weight = load_config(args)
        model = cls(config, plain_attn_implementation(args.attn_implementation), weight)
        if next(model.parameters()).device.type != "meta":
            model.init_weights()
        return model

    @classmethod
    def from_pretrained(cls, args: ModelArguments) -> nn.Module:
        """Build from ``model.model_name_or_path`` and load its safetensors strictly by the official names
        (:mod:`.qwen3_tts_weights`)."""
        if not args.model_name_or_path:
            raise ConfigError(
                "model.model_name_or_path: qwen3_tts loads a local Qwen3-TTS folder (config.json, "
                "model.safetensors); set it, or model.from_scratch: true to train from a random "
                "initialisation"
            )
        config, weight = load_config(args)
        with torch.device("meta"):
            model = cls(config, plain_attn_implementation(args.attn_implementation), weight)
        model.to_empty(device="cpu")
        load_official(model, Path(args.model_name_or_path))
        model.reset_buffers()
        return model

    def save_pretrained(self, save_directory: str | Path, **_: Any) -> None:
        """Write ``model.safetensors`` under the official names and ``config.json`` (the official layout,
        one weights file: ``mm convert dcp-to-hf``'s ``max_shard_size`` does not apply)."""
        save_official(self, save_directory, self.config.to_dict())

    def reset_buffers(self) -> None:
        """Recompute the non-persistent buffers (both stacks' rotary frequencies)."""
        self.talker.model.reset_rotary()
        self.talker.code_predictor.model.reset_rotary()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter as the Qwen3 models do (normal(0, ``initializer_range``) weights, zero
        biases, unit norms) and the rotary buffers."""
        std = self.config.talker.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
            elif isinstance(module, Qwen3RMSNorm):
                module.weight.fill_(1.0)
        self.reset_buffers()

    # --------------------------------------------------------------------------------------- forward
    def talker_inputs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        codec_ids: torch.Tensor,
        codec_mask: torch.Tensor,
        codes: torch.Tensor,
        frame_mask: torch.Tensor,
        speaker_vectors: torch.Tensor | None = None,
        speaker_slot: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The talker's input embeddings [B, S, H]: projected text track + codec track (all G codebook
        embeddings summed at frames, x-vectors at their slot)."""
        talker = self.talker
        text = talker.text_projection(talker.model.text_embedding(input_ids))
        text = text * attention_mask.unsqueeze(-1).to(text.dtype)
        codec = talker.model.codec_embedding(codec_ids) * codec_mask.unsqueeze(-1).to(text.dtype)
        where = frame_mask.bool().nonzero(as_tuple=True)
        frame_codes = codes[where]  # [frames, G]
        tables = talker.code_predictor.model.codec_embedding
        residual = sum(
            (table(frame_codes[:, j]) for j, table in enumerate(tables, start=1)),
            start=codec.new_zeros(frame_codes.shape[0], codec.shape[-1]),
        )
        codec = codec.index_put(where, residual, accumulate=True)
        if speaker_vectors is not None:
            if speaker_slot is None:
                raise DataError("the batch has speaker_vectors but no speaker_slot saying where they go")
            slot = speaker_slot.bool().unsqueeze(-1)
            codec = torch.where(slot, speaker_vectors.to(codec.dtype).unsqueeze(1), codec)
        return text + codec

    def code_predictor_logits(self, hidden: torch.Tensor, frame_codes: torch.Tensor) -> torch.Tensor:
        """Logits [frames, G-1, V] of codebooks 1..G-1 from each frame's talker state ``hidden`` [frames, H]
        (the position before the frame) and its codes ``frame_codes`` [frames, G]."""
        predictor = self.talker.code_predictor
        groups = frame_codes.shape[1]
        seq = [hidden, self.talker.model.codec_embedding(frame_codes[:, 0])]
        seq += [predictor.model.codec_embedding[j - 1](frame_codes[:, j]) for j in range(1, groups - 1)]
        x = predictor.small_to_mtp_projection(torch.stack(seq, dim=1))
        positions = torch.arange(groups, device=x.device).unsqueeze(0).expand(x.shape[0], groups)
        y = predictor.model.decode(x, None, positions)
        return torch.stack([predictor.lm_head[j - 1](y[:, j]) for j in range(1, groups)], dim=1)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        codec_ids: torch.Tensor,
        codec_mask: torch.Tensor,
        codes: torch.Tensor,
        frame_mask: torch.Tensor,
        labels: torch.Tensor,
        speaker_vectors: torch.Tensor | None = None,
        speaker_slot: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Qwen3TTSOutput:
        """Both losses of a batch (module docstring); ``kwargs`` (``use_cache``) are ignored."""
        groups = self.config.num_code_groups
        if codes.dim() != 3 or codes.shape[-1] != groups:
            raise DataError(f"codes: expected [batch, positions, {groups}], got {tuple(codes.shape)}")
        x = self.talker_inputs(
            input_ids, attention_mask, codec_ids, codec_mask, codes, frame_mask, speaker_vectors, speaker_slot
        )
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = self.talker.model.decode(x, attention_mask, positions)
        batch = input_ids.shape[0]

        # talker: the state at p predicts labels[p + 1]
        targets = labels[:, 1:]
        rows, cols = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
        if rows.numel() == 0:
            raise DataError("the batch has no codebook-0 labels (no frames): nothing to train the talker on")
        logits = self.talker.codec_head(hidden[rows, cols])
        ce = F.cross_entropy(logits.float(), targets[rows, cols], reduction="none")
        talker_loss = _sample_mean(ce, rows, batch)

        # code predictor: the state one position before each frame starts its sequence
        frames = frame_mask.bool()
        before = torch.zeros_like(frames)
        before[:, :-1] = frames[:, 1:]
        frame_rows = frames.nonzero(as_tuple=True)[0]
        states = hidden[before]
        if states.shape[0] != frame_rows.shape[0]:
            raise DataError("frame_mask: a frame at position 0 has no talker state before it")
        frame_codes = codes[frames]
        logits = self.code_predictor_logits(states, frame_codes)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), frame_codes[:, 1:].flatten(), reduction="none")
        code_loss = _sample_mean(ce.view(-1, groups - 1).mean(1), frame_rows, batch)

        loss = talker_loss + self.code_predictor_loss_weight * code_loss
        return Qwen3TTSOutput(
            loss=loss, talker_loss=talker_loss.detach(), code_predictor_loss=code_loss.detach()
        )
