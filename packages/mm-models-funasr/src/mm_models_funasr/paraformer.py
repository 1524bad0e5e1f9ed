"""Paraformer (``model.model_id: paraformer``): funasr's non-autoregressive ASR model behind an mm adapter.

This is the "third-party model behind an adapter" pattern of the MindSpeed-MM FSDP2 guide: the model's code
stays in its own library (``funasr``, the optional extra ``mm-models-funasr[paraformer]``), and a thin
:class:`~mm_core.models.BaseModel` turns mm's batch into the library's forward arguments and the library's
result into an object with ``.loss``. mm shards, recomputes, checkpoints and optimises the library's modules
like its own; the loss is the library's (``model.loss_cfg.loss_type: raw``).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.utils import ModelOutput

from mm_core.errors import ConfigError, DataError
from mm_core.models import BaseModel, ModelArguments, ModelPlan
from mm_core.train.loss import IGNORE_INDEX

from ._funasr import paraformer_class
from .paraformer_config import (
    CONFIG_FILE,
    SAFETENSORS_FILE,
    TOKENS_FILE,
    TORCH_FILE,
    Frontend,
    input_size,
    read_config,
    vocab_size,
)

#: funasr's stacks of layers (``encoders0``: the first encoder layer, which reads the feature rows;
#: ``decoders2`` / ``decoders3``: the decoder's layers without cross-attention) are the FSDP and recompute
#: units. Never Muon: the FSMN memories (depthwise ``Conv1d`` ``[H, 1, K]``), the CIF predictor's convolution
#: (``[H, H, 3]``, not a batch of matrices) and its one-row output, the token embedding and the two output
#: layers (attention decoder, CTC).
PARAFORMER_PLAN = ModelPlan(
    fsdp_units=("model.encoder.encoders*.{*}", "model.decoder.decoders*.{*}"),
    recompute_units=("model.encoder.encoders*.{*}", "model.decoder.decoders*.{*}"),
    muon_exclude_modules=(
        "model.encoder.encoders*.{*}.self_attn.fsmn_block",
        "model.decoder.decoders*.{*}.self_attn.fsmn_block",
        "model.predictor.cif_conv1d",
        "model.predictor.cif_output",
        "model.decoder.embed",
        "model.decoder.output_layer",
        "model.ctc.ctc_lo",
    ),
)


@dataclass
class ParaformerOutput(ModelOutput):
    """Paraformer's loss and the statistics its forward reports (None where its configuration has none)."""

    loss: torch.Tensor | None = None
    #: the attention decoder's (label-smoothed) loss
    loss_att: torch.Tensor | None = None
    #: the CIF predictor's token-count loss (|predicted - true length|)
    loss_pre: torch.Tensor | None = None
    #: the CTC loss (``ctc_weight > 0`` only)
    loss_ctc: torch.Tensor | None = None
    #: the decoder's token accuracy on this batch
    acc: torch.Tensor | None = None
    #: funasr's weight of this batch (its size, or its token count with ``length_normalized_loss``)
    weight: torch.Tensor | None = None


def _zero_padded_frames(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of funasr's encoder: its output ``(frames [clips, time, dim], lengths, ...)`` with the
    frames past each clip's length set to zero.

    funasr's CIF predictor runs a convolution over time on the encoder's output, padded frames included, so a
    clip's predicted token count (and ``loss_pre``) depended on how long the other clips of its micro-batch
    were. With the padded frames zero the convolution reads zeros there, as its own zero padding gives a clip
    encoded alone; the attention decoder and CTC never read them (masked by the lengths)."""
    frames, lengths = output[0], output[1]
    if isinstance(frames, tuple):
        return output
    keep = torch.arange(frames.shape[1], device=frames.device) < lengths.to(frames.device).unsqueeze(1)
    return (frames * keep.unsqueeze(-1).to(frames.dtype), *output[1:])


class ParaformerForTraining(nn.Module, BaseModel):
    """funasr's ``Paraformer`` (``self.model``) behind an mm adapter.

    The adapter pattern: mm's batch goes in, funasr's ``forward(speech, speech_lengths, text, text_lengths)
    -> (loss, stats, weight)`` runs unchanged, a :class:`ParaformerOutput` with ``.loss`` (and the stats as
    fields) comes out. Train with ``model.loss_cfg.loss_type: raw``: mm back-propagates this loss, averaged
    over micro-batches and ranks. funasr normalises it per sample (``length_normalized_loss: false``), the
    same objective in every layout; per token (``true``, funasr's recipes) weighs each micro-batch's tokens
    within that micro-batch, as funasr's own data-parallel trainer does. The encoder's output is zero at
    padded frames (:func:`_zero_padded_frames`): funasr's CIF predictor would otherwise read them, and a
    clip's loss depended on the other clips of its micro-batch.

    Batch fields (mm-data-audio's ``asr_manifest`` / ``audio_sft`` with the ``audio`` collator and a
    ``fun-asr-nano`` processor folder, whose features are funasr's ``WavFrontend`` filter banks):

    - ``input_features`` [clips, rows, 560] and ``input_features_mask`` [clips, rows]: one clip per sample.
      The front end of ``config.yaml`` is applied here: the int16 scale funasr applies to waveforms (a
      constant on log energies) and the CMVN of ``frontend_conf.cmvn_file``;
    - ``labels`` [samples, tokens]: the labelled positions (not -100), in order, are the transcript's token
      ids in Paraformer's vocabulary. The processor's tokenizer must share these ids
      (:func:`mm_data_audio.processor_funasr.build_paraformer_processor` writes a template whose assistant
      turn is the bare transcript). ``input_ids`` and ``attention_mask`` are not used (mm counts tokens from
      them).

    The folder (``model.model_name_or_path``, see :mod:`~mm_models_funasr.paraformer_config`): funasr's
    ``config.yaml`` (``model.config_overrides`` merge into it), weights in ``model.safetensors`` (this
    class's parameter names, what :meth:`save_pretrained` and ``mm convert dcp-to-hf`` write) or funasr's
    ``model.pt`` (funasr's names, read with ``torch.load(weights_only=True)``). Meta-device init loads
    safetensors only: :func:`convert_funasr_weights` writes them from ``model.pt`` once."""

    mm_plan: ClassVar[ModelPlan] = PARAFORMER_PLAN
    #: the CMVN of ``frontend_conf.cmvn_file`` (zeros and ones without one), refilled by :meth:`init_weights`
    cmvn_shift: torch.Tensor
    cmvn_scale: torch.Tensor
    #: the resolved config.yaml (``vocab_size`` and ``input_size`` filled in); not called ``config``, which
    #: parts of mm read as a transformers config
    funasr_config: dict[str, Any]

    def __init__(self, config: Mapping[str, Any], folder: str | Path | None = None) -> None:
        super().__init__()
        paraformer = paraformer_class()  # first: without funasr, the error names the extra to install
        where = Path(folder) if folder is not None else None
        model_name = config.get("model", "Paraformer")
        if model_name != "Paraformer":
            raise ConfigError(
                f"{CONFIG_FILE}: model {model_name!r}: model_id paraformer builds funasr's Paraformer only"
            )
        resolved = dict(config)
        resolved["vocab_size"] = vocab_size(config, where, "model.model_name_or_path")
        resolved["input_size"] = input_size(config)
        self.funasr_config = resolved
        self.folder = where
        self.frontend = Frontend.of(resolved, where, resolved["input_size"])
        dim = resolved["input_size"]
        self.register_buffer("cmvn_shift", torch.empty(dim), persistent=False)
        self.register_buffer("cmvn_scale", torch.empty(dim), persistent=False)
        self._fill_cmvn()
        kwargs = {k: v for k, v in resolved.items() if k != "model_conf"}
        kwargs.update(resolved.get("model_conf") or {})
        try:
            self.model = paraformer(**kwargs)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ConfigError(
                f"{CONFIG_FILE}: funasr could not build Paraformer from this configuration "
                f"({type(exc).__name__}: {exc}); check the encoder/decoder/predictor names and their *_conf"
            ) from None
        self.ignore_id = int(self.model.ignore_id)
        # the CIF predictor's convolution reads the encoder's output at padded frames next to a clip's end
        self.model.encoder.register_forward_hook(_zero_padded_frames)

    def _fill_cmvn(self) -> None:
        if self.cmvn_shift.device.type == "meta":
            return
        with torch.no_grad():
            if self.frontend.cmvn is None:
                self.cmvn_shift.zero_()
                self.cmvn_scale.fill_(1.0)
            else:
                self.cmvn_shift.copy_(self.frontend.cmvn[0])
                self.cmvn_scale.copy_(self.frontend.cmvn[1])

    # ------------------------------------------------------------------------------- construction
    @classmethod
    def _from_config(cls, args: ModelArguments) -> nn.Module:
        folder = args.model_name_or_path
        if not folder:
            raise ConfigError(
                "model.model_name_or_path: model_id paraformer needs a folder with funasr's config.yaml "
                "(even with model.from_scratch: true, it says which Paraformer to build)"
            )
        path = Path(folder)
        if (
            not args.from_scratch
            and not (path / SAFETENSORS_FILE).is_file()
            and (path / TORCH_FILE).is_file()
        ):
            raise ConfigError(
                f"model.model_name_or_path: {folder!r} holds funasr's {TORCH_FILE} only, which meta-device "
                f"init cannot read; write {SAFETENSORS_FILE} once with "
                f"python -m mm_models_funasr.paraformer {folder}, or set "
                "training.init_model_with_meta_device: false"
            )
        return cls(read_config(path, args.config_overrides, "model.model_name_or_path"), path)

    @classmethod
    def from_pretrained(cls, args: ModelArguments) -> nn.Module:
        with torch.device("cpu"):
            model = cls(
                read_config(
                    Path(args.model_name_or_path or ""), args.config_overrides, "model.model_name_or_path"
                ),
                args.model_name_or_path,
            )
        model.load_weights()
        return model

    def load_weights(self) -> None:
        """Load ``model.safetensors`` (this class's names) or else funasr's ``model.pt``; every tensor must be
        there and nothing else."""
        folder = self.folder
        if folder is None:
            raise ConfigError("model.model_name_or_path: no folder to load Paraformer weights from")
        if (folder / SAFETENSORS_FILE).is_file():
            from safetensors.torch import load_file

            state = load_file(str(folder / SAFETENSORS_FILE))
            target: nn.Module = self
            source = folder / SAFETENSORS_FILE
        elif (folder / TORCH_FILE).is_file():
            state = funasr_state_dict(folder / TORCH_FILE)
            target = self.model
            source = folder / TORCH_FILE
        else:
            raise ConfigError(
                f"model.model_name_or_path: {str(folder)!r} holds no {SAFETENSORS_FILE} or {TORCH_FILE}; set "
                "model.from_scratch: true to train from a random initialisation"
            )
        try:
            result = target.load_state_dict(state, strict=False)
        except RuntimeError as exc:
            raise ConfigError(f"model.model_name_or_path: {source}: {' '.join(str(exc).split())}") from None
        for kind, keys in (("lacks", result.missing_keys), ("has unexpected", result.unexpected_keys)):
            if keys:
                shown = ", ".join(sorted(keys)[:5]) + (" ..." if len(keys) > 5 else "")
                raise ConfigError(
                    f"model.model_name_or_path: {source} {kind} tensors for this Paraformer "
                    f"({len(keys)}: {shown}); check that config.yaml describes the checkpoint"
                )

    def init_weights(self) -> None:
        """Every submodule's ``reset_parameters()`` (funasr's layers are torch layers) and the CMVN."""
        super().init_weights()
        self._fill_cmvn()

    def save_pretrained(self, out_dir: str | Path, **_: Any) -> None:
        """Write a folder :meth:`from_pretrained` reads: ``config.yaml`` (resolved: ``vocab_size``,
        ``input_size``), ``model.safetensors`` (one file, this class's parameter names) and the CMVN and
        ``tokens.json`` of the source folder."""
        import yaml
        from safetensors.torch import save_model

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        config = dict(self.funasr_config)
        if self.frontend.cmvn_file is not None:
            shutil.copy2(self.frontend.cmvn_file, out / self.frontend.cmvn_file.name)
            config["frontend_conf"] = {**config["frontend_conf"], "cmvn_file": self.frontend.cmvn_file.name}
        if self.folder is not None and (self.folder / TOKENS_FILE).is_file():
            shutil.copy2(self.folder / TOKENS_FILE, out / TOKENS_FILE)
        (out / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        save_model(self, str(out / SAFETENSORS_FILE))

    # ------------------------------------------------------------------------------------ forward
    def speech(self, input_features: torch.Tensor, input_features_mask: torch.Tensor) -> torch.Tensor:
        """funasr's features from mm's: the front end's log offset and CMVN on valid rows, zeros elsewhere
        (funasr pads with zeros)."""
        if input_features.shape[-1] != self.funasr_config["input_size"]:
            raise DataError(
                f"paraformer: input_features have {input_features.shape[-1]} values per row but the model's "
                f"input_size is {self.funasr_config['input_size']}; use a processor whose feature_size × "
                "num_frames_lfr matches it"
            )
        x = input_features.float() + self.frontend.log_offset
        x = (x + self.cmvn_shift) * self.cmvn_scale
        return x * input_features_mask.unsqueeze(-1).to(x.dtype)

    def transcripts(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's labelled ids, moved to the front and padded with funasr's ``ignore_id``; their
        counts."""
        keep = labels != IGNORE_INDEX
        lengths = keep.sum(dim=1)
        if bool((lengths == 0).any()):
            rows = [int(i) for i in torch.nonzero(lengths == 0).flatten()]
            raise DataError(
                f"paraformer: samples {rows} of the micro-batch have no labelled transcript token"
            )
        ids = labels[keep]
        vocab = int(self.funasr_config["vocab_size"])
        if bool(((ids < 0) | (ids >= vocab)).any()):
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise DataError(
                f"paraformer: label id {bad} is outside the model's vocabulary (vocab_size {vocab}); the "
                "processor's tokenizer must use Paraformer's token ids"
            )
        order = torch.argsort(
            (~keep).to(torch.int8), dim=1, stable=True
        )  # labelled positions first, in order
        width = int(lengths.max())
        text = labels.gather(1, order)[:, :width]
        valid = torch.arange(width, device=labels.device) < lengths.unsqueeze(1)
        return text.masked_fill(~valid, self.ignore_id), lengths

    def forward(
        self,
        labels: torch.Tensor,
        input_features: torch.Tensor | None = None,
        input_features_mask: torch.Tensor | None = None,
        **_: Any,
    ) -> ParaformerOutput:
        if input_features is None or input_features_mask is None:
            raise DataError(
                "paraformer: the micro-batch has no input_features / input_features_mask; every sample needs "
                "one clip (asr_manifest, or audio_sft with one <audio> per sample)"
            )
        if input_features.shape[0] != labels.shape[0]:
            raise DataError(
                f"paraformer: {input_features.shape[0]} clips for {labels.shape[0]} samples; Paraformer "
                "transcribes exactly one clip per sample"
            )
        text, text_lengths = self.transcripts(labels)
        speech = self.speech(input_features, input_features_mask)
        speech_lengths = input_features_mask.sum(dim=-1).long()
        loss, stats, weight = self.model(speech, speech_lengths, text, text_lengths)

        def stat(name: str) -> torch.Tensor | None:
            value = stats.get(name)
            return value.detach().sum() if isinstance(value, torch.Tensor) else None

        # sum() of the one-element tensors funasr returns: a 0-dim tensor that is not a view (FSDP hooks
        # outputs for backward and warns about views)
        return ParaformerOutput(
            loss=loss.sum(),
            loss_att=stat("loss_att"),
            loss_pre=stat("loss_pre"),
            loss_ctc=stat("loss_ctc"),
            acc=stat("acc"),
            weight=weight.detach().sum() if isinstance(weight, torch.Tensor) else None,
        )


def funasr_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of funasr's ``model.pt`` (a state dict, possibly under ``state_dict`` or ``model``), read
    with ``torch.load(weights_only=True)``."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError, ... by cause
        raise ConfigError(
            f"model.model_name_or_path: {path} is not a tensor checkpoint that "
            "torch.load(weights_only=True) reads "
            f"({type(exc).__name__}: {' '.join(str(exc).split())})"
        ) from None
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConfigError(f"model.model_name_or_path: {path} does not hold a state dict of tensors")
    return obj


def convert_funasr_weights(folder: str | Path) -> Path:
    """Write ``model.safetensors`` (this class's names) beside funasr's ``model.pt`` in ``folder``: what
    meta-device init and ``training.load``-free runs read fastest. Returns the file."""
    path = Path(folder)
    state = funasr_state_dict(path / TORCH_FILE)
    from safetensors.torch import save_file

    out = path / SAFETENSORS_FILE
    save_file({f"model.{k}": v.contiguous() for k, v in state.items()}, str(out))
    return out


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        raise SystemExit(
            "usage: python -m mm_models_funasr.paraformer MODEL_FOLDER (writes model.safetensors)"
        )
    print(convert_funasr_weights(sys.argv[1]))
