"""``model.special_tokens``: tokens added to the run's tokenizer, and the embeddings resized to match.

::

    model:
      special_tokens: ["<tool_call>", "</tool_call>"]

The tokenizer is the one the dataset reads: the folder under the ``preprocess_parameters`` key its
``DataPlan.processor_key`` names (``model_name_or_path`` for mm's datasets). At the start of a run, rank 0
loads it, adds the tokens as special tokens (``add_tokens(..., special_tokens=True)``: never split, dropped by
``decode(skip_special_tokens=True)``; tokens it already has keep their ids) and saves the folder, with every
other file of the original (processor configs, chat template), to ``<output_dir>/tokenizer``; the run's
dataset then reads that folder (the key is pointed at it in the run's config, so checkpoints, ``config.yaml``,
``training.save_hf_interval`` and ``mm convert dcp-to-hf`` carry the extended tokenizer).

When the tokenizer then has more tokens than the model's input embedding has rows, the model is resized to
``len(tokenizer)`` with transformers' ``resize_token_embeddings`` before it is sharded: the input embedding
and the output head, tied (one matrix) or not, and ``config.vocab_size``. The new rows:

- a model whose weights are loaded from ``model.model_name_or_path``: the mean of the existing rows
  (transformers' ``mean_resizing``: drawn from a normal with the rows' mean and 1e-9 x their covariance, so
  the mean to within about 3e-5 of the rows' spread), for the embedding and an untied head alike. Such a
  model is built whole (``training.init_model_with_meta_device: auto`` resolves to false, ``true`` is an
  error): the mean needs the loaded rows before sharding;
- a model trained from scratch: built on the meta device, every row (new ones included) takes the model's
  own initialisation; built whole, the mean of the initialised rows as above;
- a resumed run: every row from the checkpoint.

A tokenizer that already fits the embedding (Qwen's embeddings have spare rows) changes no weight shape.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from mm_core.config.schema import MMConfig
from mm_core.errors import ConfigError

KEY = "model.special_tokens"


def _tokenizer_key(cfg: MMConfig) -> tuple[str, str]:
    """The ``preprocess_parameters`` key of the dataset's tokenizer folder and the folder."""
    from mm_core.data.plan import registered_data_plan

    dataset_type = cfg.data.dataset_param.dataset_type
    key = registered_data_plan(dataset_type).processor_key
    folder = cfg.data.dataset_param.preprocess_parameters.get(key) if key else None
    if not key or not isinstance(folder, str) or not Path(folder).is_dir():
        where = (
            f"data.dataset_param.preprocess_parameters.{key} ({folder!r}) is not a local folder"
            if key
            else f"dataset {dataset_type!r} names no tokenizer folder (its DataPlan has no processor_key)"
        )
        raise ConfigError(f"{KEY}: the tokens go into the dataset's tokenizer, but {where}")
    return key, folder


def tokenizer_with_tokens(cfg: MMConfig) -> Any:
    """The dataset's tokenizer with ``model.special_tokens`` added (in memory)."""
    from transformers import AutoTokenizer

    key, folder = _tokenizer_key(cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, ... depending on what is missing
        raise ConfigError(
            f"{KEY}: cannot load the tokenizer of data.dataset_param.preprocess_parameters.{key} "
            f"({folder!r}): {' '.join(str(e).split())}"
        ) from None
    tokenizer.add_tokens(list(cfg.model.special_tokens), special_tokens=True)
    return tokenizer


def vocabulary_size(cfg: MMConfig) -> int | None:
    """``len(tokenizer)`` with the special tokens added; None without ``model.special_tokens``."""
    return len(tokenizer_with_tokens(cfg)) if cfg.model.special_tokens else None


def prepare_tokenizer(cfg: MMConfig, out_dir: Path) -> str | None:
    """At the start of a run: write the extended tokenizer to ``<out_dir>/tokenizer`` (rank 0, the other
    ranks wait) and point the dataset's tokenizer key of ``cfg`` at it. Returns a line for the log (None
    without ``model.special_tokens``)."""
    tokens = list(cfg.model.special_tokens)
    if not tokens:
        return None
    key, folder = _tokenizer_key(cfg)
    dst = (out_dir / "tokenizer").resolve()
    if Path(folder).resolve() != dst and (not dist.is_initialized() or dist.get_rank() == 0):
        tokenizer = tokenizer_with_tokens(cfg)
        partial = dst.with_name(dst.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(
            folder, partial
        )  # processor configs, chat template...: the tokenizer's files replaced
        tokenizer.save_pretrained(partial)
        shutil.rmtree(dst, ignore_errors=True)
        partial.rename(dst)
    if dist.is_initialized():
        dist.barrier()
    params = cfg.data.dataset_param.preprocess_parameters
    cfg.data.dataset_param.preprocess_parameters = {**params, key: str(dst)}
    size = vocabulary_size(cfg)
    return (
        f"{KEY}: {len(tokens)} tokens added to the tokenizer of {folder} ({size} tokens now), saved to {dst} "
        f"(data.dataset_param.preprocess_parameters.{key})"
    )


def resize_embeddings(model: nn.Module, size: int | None, *, mean_init: bool) -> str | None:
    """Grow ``model``'s input embedding and output head to ``size`` rows when it has fewer (module
    docstring); ``mean_init``: new rows from the mean of the existing ones (else left to the model's
    initialisation, for a model on the meta device). Returns a line for the log, None when nothing changed."""
    if size is None:
        return None
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if not isinstance(embedding, nn.Embedding):
        raise ConfigError(
            f"{KEY}: {type(model).__name__} has no get_input_embeddings() returning an nn.Embedding, so its "
            "vocabulary cannot be resized"
        )
    old = embedding.num_embeddings
    if size <= old:
        return None
    resize = getattr(model, "resize_token_embeddings", None)
    if not callable(resize):
        raise ConfigError(f"{KEY}: {type(model).__name__} has no resize_token_embeddings()")
    resize(size, mean_resizing=mean_init)
    how = "the mean of the existing rows" if mean_init else "the model's initialisation or the checkpoint"
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    head = "tied output head" if tied else "output head"
    return f"{KEY}: input embedding and {head} resized from {old} to {size} rows (new rows: {how})"
