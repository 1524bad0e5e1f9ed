"""Validation loss: ``data.eval_dataset_param`` every ``training.eval_interval`` steps and at the last step.

Each evaluation reads the same samples: the first ``training.eval_iters`` global batches of the eval set in
index order (no shuffling, no source weights; ``eval_iters: null``: every whole global batch of it), each
rank its share as training reads its own (``micro_batch_size`` x ``gradient_accumulation_steps``
micro-batches, or token-budget micro-batches). The task computes the loss under the training layout
(FSDP/EP/CP) with ``model.eval()`` and ``torch.no_grad()``, with the training loss function and
normalisation: the global token-weighted mean over every rank (:meth:`mm_core.tasks.Task.eval_step`), so it
is the same on any number of ranks. The eval loader has its own sampler and generator, and every random
generator of the rank is saved before and restored after an evaluation: turning evaluation on changes no
training loss, and exact resume stays exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mm_core.checkpoint import RNGState
from mm_core.config.schema import DataConfig, MMConfig
from mm_core.data import build_collator, build_dataloader, build_dataset
from mm_core.data.builder import EpochSampler
from mm_core.data.sources import Sources, source_names, tag_sources
from mm_core.errors import ConfigError, MMError
from mm_core.parallel.state import ParallelState
from mm_core.tasks.base import Task

KEY = "data.eval_dataset_param"


def eval_data_config(cfg: MMConfig) -> DataConfig:
    """The ``data`` block the eval set is built from: ``eval_dataset_param`` in place of ``dataset_param``,
    read in order and in whole batches."""
    assert cfg.data.eval_dataset_param is not None
    loader = cfg.data.dataloader_param.model_copy(update={"shuffle": False, "drop_last": True})
    return cfg.data.model_copy(
        update={
            "dataset_param": cfg.data.eval_dataset_param,
            "dataloader_param": loader,
            "eval_dataset_param": None,
        }
    )


def _prefixed(exc: MMError) -> MMError:
    """The same error, saying it is about the validation data."""
    return type(exc)(f"{KEY} (the validation data): {exc}")


def is_eval_step(cfg: MMConfig, step: int, last_step: int) -> bool:
    """Whether the run evaluates after ``step`` (every ``eval_interval`` steps and at the last)."""
    return cfg.data.eval_dataset_param is not None and (
        step % cfg.training.eval_interval == 0 or step == last_step
    )


class Evaluator:
    """The eval set's loader on this rank and the loop that feeds it to the task."""

    def __init__(self, cfg: MMConfig, state: ParallelState, task: Task) -> None:
        self.cfg, self.state, self.task = cfg, state, task
        tcfg = cfg.training
        self.rng = RNGState(state.device, tcfg.seed)
        saved = self.rng.state_dict()  # building the eval data draws nothing the training run would
        try:
            self._build(eval_data_config(cfg))
        finally:
            self.rng.load_state_dict(saved)

    def _build(self, data: DataConfig) -> None:
        tcfg, state = self.cfg.training, self.state
        try:
            dataset = build_dataset(data, tcfg.seed)
            self.loader = build_dataloader(
                dataset,
                build_collator(data, dataset),
                data,
                micro_batch_size=tcfg.micro_batch_size,
                dp_size=state.sizes.dp,
                dp_rank=state.dp_rank,
                seed=tcfg.seed,
                mix=False,
            )
        except MMError as exc:
            raise _prefixed(exc) from None
        self.sources = Sources.of(dataset, data.dataset_param.basic_parameters)
        self.names = tuple(source_names(self.sources))
        sampler = (
            self.loader.batch_sampler if data.dataloader_param.max_tokens_per_batch else self.loader.sampler
        )
        self.sampler: EpochSampler = sampler  # one of the two, by construction
        available = len(self.loader)  # micro-batches per rank in the eval set
        accum = tcfg.grad_accum
        if tcfg.eval_iters is None:
            self.micro_batches = available // accum * accum
        else:
            self.micro_batches = tcfg.eval_iters * accum
        if self.micro_batches == 0 or self.micro_batches > available:
            raise ConfigError(
                f"{KEY}: the validation set ({len(dataset)} samples) holds {available // accum} global "
                f"batches of {accum} micro-batch(es) per data-parallel rank ({state.sizes.dp} ranks), but "
                f"training.eval_iters asks for {tcfg.eval_iters or 1}; lower training.eval_iters (null: the "
                "whole set) or give more validation samples"
            )

    def describe(self) -> str:
        where = f", sources {', '.join(self.names)}" if self.names else ""
        return (
            f"evaluation: {self.micro_batches} micro-batches per rank from {KEY} every "
            f"{self.cfg.training.eval_interval} steps and at the end{where}"
        )

    def _batches(self) -> Iterator[dict[str, Any]]:
        """This evaluation's micro-batches, read from the start of the set."""
        self.sampler.set_position(0, 0)
        set_epoch = getattr(self.loader.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(0)
        if self.loader.generator is not None:
            self.loader.generator.manual_seed(self.cfg.training.seed)
        for read, batch in enumerate(self.loader, start=1):
            tag_sources(batch, self.sources)
            batch.pop("sample_id", None)
            batch.pop("skipped_samples", None)
            yield batch
            if read == self.micro_batches:
                return

    def evaluate(self) -> dict[str, float]:
        """``eval_loss`` (and ``eval_loss/<source>``) over this evaluation's batches, the same on every rank;
        every random generator of the rank is as it was before."""
        saved = self.rng.state_dict()
        try:
            result = self.task.eval_step(self._batches(), self.names)
        finally:
            self.rng.load_state_dict(saved)
        return {f"eval_{key}": value for key, value in result.items()}
