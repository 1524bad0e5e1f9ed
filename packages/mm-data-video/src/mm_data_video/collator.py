"""``video_latents``: stack samples of one latent shape into a batch for a video diffusion transformer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mm_core.data.params import COLLATE, anything, read_params
from mm_core.errors import DataError

COLLATE_FIELDS = {
    "collator_id": anything(None),
    "model_name": anything(None),
    "ignore_pad_token_for_loss": anything(True),
    "pad_to_multiple_of": anything(None),
}


#: optional sample fields, stacked when every sample of the micro-batch has them (audio-video models)
OPTIONAL = ("encoder_attention_mask", "audio_latents", "audio_encoder_hidden_states")


def _describe(video: tuple[int, ...], audio: tuple[int, ...] | None) -> str:
    return str(list(video)) + (f" + audio {list(audio)}" if audio is not None else "")


class VideoLatentsCollator:
    """``latents`` [B, C, F, H, W] and ``encoder_hidden_states`` [B, L, D] stacked; ``noise_seed`` a list of
    ints (it stays on the host: the model seeds CPU generators with it, no device sync); ``sample_id`` a
    tensor [B]; ``skipped_samples`` an int; ``encoder_attention_mask`` [B, L], ``audio_latents``
    [B, C_a, L_a, M] and ``audio_encoder_hidden_states`` [B, L, D_a] stacked when the samples carry them.
    Samples of different latent shapes (audio latents included), or with and without audio, are a DataError:
    batch by bucket (``max_tokens_per_batch`` with ``video_latents``' buckets) or use
    ``training.micro_batch_size: 1``."""

    def __init__(self, collate_param: Mapping[str, Any] | None = None, dataset: Any = None) -> None:
        read_params(collate_param, COLLATE_FIELDS, COLLATE)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not features:
            raise DataError("video_latents collate: got an empty list of samples")

        def shape(f: Mapping[str, Any]) -> tuple[Any, ...]:
            audio = f.get("audio_latents")
            return tuple(f["latents"].shape), None if audio is None else tuple(audio.shape)

        shapes = {shape(f) for f in features}
        if len(shapes) > 1:
            ids = ", ".join(f"{f.get('sample_id')}: {_describe(*shape(f))}" for f in features)
            raise DataError(
                f"video_latents collate: one micro-batch holds latents of {len(shapes)} shapes "
                f"(sample: shape {ids}); set data.dataloader_param.max_tokens_per_batch (micro-batches "
                "then hold one shape each) or training.micro_batch_size: 1"
            )
        batch = {
            "latents": torch.stack([f["latents"] for f in features]),
            "encoder_hidden_states": torch.stack([f["encoder_hidden_states"] for f in features]),
            "noise_seed": [int(f["noise_seed"]) for f in features],
            "sample_id": torch.tensor([int(f.get("sample_id", -1)) for f in features], dtype=torch.long),
            "skipped_samples": sum(int(f.get("skipped_samples", 0)) for f in features),
        }
        for key in OPTIONAL:
            present = [key in f for f in features]
            if all(present):
                batch[key] = torch.stack([f[key] for f in features])
            elif any(present):
                ids = ", ".join(str(f.get("sample_id")) for f, has in zip(features, present) if not has)
                raise DataError(
                    f"video_latents collate: samples {ids} lack {key}, others of the micro-batch have it"
                )
        return batch
