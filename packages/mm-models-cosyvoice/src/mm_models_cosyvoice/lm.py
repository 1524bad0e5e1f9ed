"""``cosyvoice3_lm``: CosyVoice3's text-speech language model (stage a), text -> 25 Hz speech tokens.

A Qwen2 decoder (transformers' ``Qwen2ForCausalLM``, official: the 0.5B ``CosyVoice-BlankEN``) reads one
stream of text and speech embeddings: text through Qwen2's own ``embed_tokens``, speech tokens and the
special ``sos`` / ``eos`` / ``task_id`` / ``fill`` rows through ``speech_embedding`` (``speech_vocab + 200``
rows), and ``llm_decoder`` (a linear layer without bias) predicts the next speech-side id from the final
hidden state. Qwen2's own ``lm_head`` (tied to ``embed_tokens``) is kept only so that the names are the
official ones; it is never used. The speaker embedding is not an input of the CosyVoice3 LM.

**Names.** The module tree is the official one: ``llm.model`` is the ``Qwen2ForCausalLM``, so the state dict
holds ``llm.model.model.embed_tokens.weight``, ``llm.model.model.layers.{i}...``, ``llm.model.model.norm
.weight``, ``llm.model.lm_head.weight``, ``speech_embedding.weight`` and ``llm_decoder.weight``, exactly the
keys of the official ``llm.pt``.

**Batch.** The ``cosyvoice_speech`` dataset (stage ``lm``) assembles each row
(:mod:`mm_data_audio.cosyvoice.sequence`): ``input_ids`` and ``speech_mask`` [B, N], ``attention_mask``, and
``labels`` in mm's convention. Two ways to train:

- ``model.loss_cfg.loss_type: per_token_loss`` (recommended): mm computes the cross entropy from
  ``.logits``, normalised by the speech tokens of the whole step over every rank: upstream's
  ``length_normalized_loss`` on any layout, with the chunked loss head (``llm_decoder``) available;
- ``loss_type: raw``: the forward's ``.loss``, the token mean of the micro-batch (what upstream computes per
  rank; it depends on how samples fall into micro-batches), with ``.acc``, the accuracy of the predicted
  tokens.

``model.config_overrides``: any ``Qwen2Config`` key (tiny sizes in tests) and ``speech_vocab`` (6561).
``model.model_name_or_path``: a folder with ``config.json`` (a Qwen2 config; or the official model folder,
whose ``CosyVoice-BlankEN/config.json`` is used) and ``model.safetensors`` or the official ``llm.pt``.
Without a config the official sizes are used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from transformers.utils import ModelOutput

from mm_core.errors import ConfigError
from mm_core.models import BaseModel, ModelArguments, ModelPlan
from mm_core.models.varlen import plain_attn_implementation
from mm_core.parallel.layer_bytes import (
    INDEX,
    ActivationCount,
    ActivationQuery,
    DecoderSizes,
    decoder_layer_bytes,
    loss_head_bytes,
    rms_norm_bytes,
    rotary_bytes,
)
from mm_core.train.loss import IGNORE_INDEX, shift_labels
from mm_data_audio.cosyvoice.sequence import SpeechIds, prompt_sequence

from .weights import (
    load_checked,
    read_state,
    refuse_official_only_on_meta,
    save_safetensors,
)

OVERRIDES = "model.config_overrides"
OFFICIAL_FILE = "llm.pt"
#: the official model folder keeps the Qwen2 config here
BACKBONE_FOLDER = "CosyVoice-BlankEN"
SPEECH_VOCAB = 6561
#: the Qwen2 backbone of Fun-CosyVoice3-0.5B (Qwen2.5-0.5B sizes)
OFFICIAL_QWEN2: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
    "use_sliding_window": False,
}


@dataclass
class CosyVoiceLMOutput(ModelOutput):
    """``logits`` [B, N, speech_vocab + 200]; with ``labels``: ``loss`` (token mean of the micro-batch) and
    ``acc`` (the share of predicted tokens the argmax gets right, detached)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    acc: torch.Tensor | None = None


class Qwen2Encoder(nn.Module):
    """The official ``llm`` wrapper: the Qwen2 causal LM under ``model``."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2ForCausalLM(config)


def _config_file(args: ModelArguments) -> Path | None:
    if not args.model_name_or_path:
        return None
    folder = Path(args.model_name_or_path)
    if not folder.is_dir():
        raise ConfigError(
            f"model.model_name_or_path: {str(folder)!r} is not a local folder; mm never downloads"
        )
    for path in (folder / "config.json", folder / BACKBONE_FOLDER / "config.json"):
        if path.is_file():
            return path
    return None


def read_config(args: ModelArguments) -> tuple[Qwen2Config, int]:
    """The Qwen2 config (the folder's, else the official sizes; then ``config_overrides``) and the speech
    vocabulary."""
    path = _config_file(args)
    data: dict[str, Any] = dict(OFFICIAL_QWEN2)
    if path is not None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ConfigError(f"model.model_name_or_path: {path} is not valid JSON ({exc})") from None
    speech_vocab = int(data.pop("speech_vocab", SPEECH_VOCAB))
    config = Qwen2Config.from_dict(data)
    overrides = dict(args.config_overrides)
    if "speech_vocab" in overrides:
        value = overrides.pop("speech_vocab")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{OVERRIDES}.speech_vocab: got {value!r}; expected a positive integer")
        speech_vocab = value
    if overrides:
        merged = config.to_dict()
        for key, value in overrides.items():
            if not hasattr(config, key):
                raise ConfigError(
                    f"{OVERRIDES}.{key}: neither speech_vocab nor a Qwen2Config key (e.g. hidden_size, "
                    "num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size, "
                    "vocab_size)"
                )
            merged[key] = value
            if key == "num_hidden_layers" and "layer_types" not in overrides:
                merged.pop("layer_types", None)
        try:
            config = Qwen2Config.from_dict(merged)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{OVERRIDES}: Qwen2Config rejects the overrides: {exc}") from None
    config._attn_implementation = plain_attn_implementation(args.attn_implementation)  # noqa: SLF001 - transformers' public switch
    config.use_cache = False
    return config, speech_vocab


def count_activations(model: nn.Module, query: ActivationQuery) -> ActivationCount:
    """``ModelPlan.activations``: what a micro-batch keeps for backward (``mm check``'s memory estimate).

    Qwen2's decoder layers (no q/k norms) over the micro-batch's tokens, the rotary tables, the two embedding
    lookups (their int64 indices and the speech mask that picks between them), the final norm and the loss
    over ``llm_decoder``'s ``speech_vocab + 200`` rows (not Qwen2's vocabulary: its ``lm_head`` is unused).
    The attention mask of a padded micro-batch is not counted (docs/memory.md)."""
    config: Any = model.config
    tokens, s = query.local_tokens, query.itemsize
    h, heads, kv_heads = (
        int(config.hidden_size),
        int(config.num_attention_heads),
        int(config.num_key_value_heads),
    )
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    sizes = DecoderSizes(h, int(config.intermediate_size), heads, kv_heads, head_dim)
    layer = decoder_layer_bytes(sizes, tokens, s, qk_norm=False)
    layers = {f"llm.model.model.layers.{i}": layer for i in range(int(config.num_hidden_layers))}
    head: Any = model.get_submodule("llm_decoder")
    rows = int(head.weight.shape[0])
    kept, peak, start = loss_head_bytes(tokens, h, rows, s, query.chunk)
    embeddings = tokens * (2 * INDEX + 1)
    final_norm = tokens * (rms_norm_bytes(h, s) + h * s)
    outside = embeddings + rotary_bytes(tokens, head_dim, s) + final_norm + kept
    return ActivationCount(layers, outside, peak, start)


class CosyVoice3LMForTraining(nn.Module, BaseModel):
    """CosyVoice3's LM (module docstring)."""

    mm_plan: ClassVar[ModelPlan] = ModelPlan(
        fsdp_units=("llm.model.model.layers.{*}",),
        recompute_units=("llm.model.model.layers.{*}",),
        muon_exclude_modules=(
            "llm.model.model.embed_tokens",
            "llm.model.lm_head",
            "speech_embedding",
            "llm_decoder",
        ),
        output_head="llm_decoder",
        activations=count_activations,
        rms_norm_classes=("Qwen2RMSNorm",),
    )

    def __init__(self, config: Qwen2Config, speech_vocab: int = SPEECH_VOCAB) -> None:
        super().__init__()
        self.config = config
        self.ids = SpeechIds(speech_vocab)
        self.llm = Qwen2Encoder(config)
        self.speech_embedding = nn.Embedding(self.ids.rows, config.hidden_size)
        self.llm_decoder = nn.Linear(config.hidden_size, self.ids.rows, bias=False)

    @property
    def speech_vocab(self) -> int:
        return self.ids.speech_vocab

    # --------------------------------------------------------------------------------------- building
    @classmethod
    def _from_config(cls, args: ModelArguments) -> CosyVoice3LMForTraining:
        refuse_official_only_on_meta(args, OFFICIAL_FILE, "cosyvoice3_lm")
        config, speech_vocab = read_config(args)
        return cls(config, speech_vocab)

    @classmethod
    def from_pretrained(cls, args: ModelArguments) -> CosyVoice3LMForTraining:
        """Build from the folder's config and load ``model.safetensors`` or the official ``llm.pt``."""
        if not args.model_name_or_path:
            raise ConfigError(
                "model.model_name_or_path: not set; point it at a folder with llm.pt or model.safetensors, "
                "or set model.from_scratch: true"
            )
        config, speech_vocab = read_config(args)
        model = cls(config, speech_vocab)
        state, source = read_state(Path(args.model_name_or_path), OFFICIAL_FILE)
        load_checked(model, state, source)
        return model

    @torch.no_grad()
    def init_weights(self) -> None:
        """Qwen2's own initialisation (rotary tables included) and torch's defaults for the speech table and
        the decoder, as the official model is constructed."""
        self.llm.model.init_weights()
        self.speech_embedding.reset_parameters()
        self.llm_decoder.reset_parameters()

    def save_pretrained(self, save_directory: str | Path, **_: Any) -> None:
        """``config.json`` (the Qwen2 config plus ``speech_vocab``) and ``model.safetensors``."""
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict()
        config["speech_vocab"] = self.speech_vocab
        (folder / "config.json").write_text(
            json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
        save_safetensors(self, folder)

    # ---------------------------------------------------------------------------------------- forward
    def embed(self, input_ids: torch.Tensor, speech_mask: torch.Tensor) -> torch.Tensor:
        """Text ids through Qwen2's ``embed_tokens``, speech-side ids through ``speech_embedding``."""
        text_table: Any = self.llm.model.model.embed_tokens
        text = text_table(input_ids.masked_fill(speech_mask, 0))
        speech = self.speech_embedding(input_ids.masked_fill(~speech_mask, 0))
        return torch.where(speech_mask.unsqueeze(-1), speech, text)

    def hidden_states(
        self, input_ids: torch.Tensor, speech_mask: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        backbone: Any = self.llm.model.model
        out = backbone(
            inputs_embeds=self.embed(input_ids, speech_mask), attention_mask=attention_mask, use_cache=False
        )
        hidden: torch.Tensor = out.last_hidden_state
        return hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        speech_mask: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **_: Any,
    ) -> CosyVoiceLMOutput:
        logits = self.llm_decoder(self.hidden_states(input_ids, speech_mask, attention_mask))
        if labels is None:
            return CosyVoiceLMOutput(logits=logits)
        targets = shift_labels(labels)
        valid = targets != IGNORE_INDEX
        flat = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        count = valid.sum()
        loss = flat / count.clamp(min=1)
        with torch.no_grad():
            hits = (logits.argmax(dim=-1) == targets) & valid
            acc = hits.sum().float() / count.clamp(min=1)
        return CosyVoiceLMOutput(loss=loss, logits=logits, acc=acc)

    # -------------------------------------------------------------------------------------- inference
    @torch.no_grad()
    def generate(
        self,
        instruct_ids: list[int],
        text_ids: list[int],
        prompt_speech: list[int] | None = None,
        *,
        top_k: int = 25,
        top_p: float = 0.8,
        window: int = 10,
        tau_r: float = 0.1,
        min_ratio: float = 2.0,
        max_ratio: float = 20.0,
        seed: int = 0,
    ) -> list[int]:
        """Speech tokens for one text (``text_ids`` should hold the prompt's transcript followed by the text
        to speak when ``prompt_speech`` is given), by upstream's repetition-aware sampling: nucleus sampling
        (``top_p``, at most ``top_k`` candidates); a token already drawn ``window × tau_r`` times among the
        last ``window`` is redrawn from the whole distribution without it. ``eos`` is barred before
        ``min_ratio × len(text_ids)`` tokens, and decoding stops at any special id or after
        ``max_ratio × len(text_ids)`` tokens. Runs without a KV cache (the sequence is re-read each step):
        meant for checks and examples, not for serving."""
        device = self.llm_decoder.weight.device
        ids, mask = prompt_sequence(instruct_ids, text_ids, prompt_speech or [], self.speech_vocab)
        ids, mask = ids.to(device)[None], mask.to(device)[None]
        g = torch.Generator()
        g.manual_seed(int(seed))
        out: list[int] = []
        min_len, max_len = int(min_ratio * len(text_ids)), int(max_ratio * len(text_ids))
        for step in range(max_len):
            logits = self.llm_decoder(self.hidden_states(ids, mask, None)[:, -1]).float()[0].cpu()
            if step < min_len:  # no stop token yet (eos, or any other special id)
                logits[self.speech_vocab :] = float("-inf")
            token = self._sample(logits, out, top_k, top_p, window, tau_r, g)
            if token >= self.speech_vocab:
                break
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
            mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.bool, device=device)], dim=1)
        return out

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        history: list[int],
        top_k: int,
        top_p: float,
        window: int,
        tau_r: float,
        g: torch.Generator,
    ) -> int:
        probs = logits.softmax(-1)
        sorted_p, order = probs.sort(descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p < top_p).nonzero().numel()
        keep = max(1, min(keep, top_k))
        choice = order[torch.multinomial(sorted_p[:keep], 1, generator=g)].item()
        if history[-window:].count(int(choice)) >= window * tau_r:
            probs = probs.clone()
            probs[int(choice)] = 0.0
            choice = torch.multinomial(probs, 1, generator=g).item()
        return int(choice)
