"""The training loop: build everything from the config, then step, log and checkpoint.

What is trained and how one step goes is the task's (``training.task``, :mod:`mm_core.tasks`; ``standard``
by default); the trainer owns what every task shares: the process groups, the data, the checkpoints of all
the task's models and optimizers, the loop, metrics, profiling tools and stopping on a signal.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from mm_core.checkpoint import (
    CheckpointSaver,
    ModelParts,
    RNGState,
    TrainingState,
    TrainProgress,
    load_checkpoint,
    resolve_load_path,
    set_deterministic,
)
from mm_core.checkpoint.layout import read_latest
from mm_core.config.schema import MMConfig
from mm_core.config.support import check_supported
from mm_core.data import EpochIterator, build_collator, build_dataloader, build_dataset
from mm_core.data.epochs import iters_for_epochs
from mm_core.data.sources import Sources, source_names, tag_sources
from mm_core.errors import TrainingInterrupted
from mm_core.models.special_tokens import prepare_tokenizer
from mm_core.optim.resume import apply_schedule_changes
from mm_core.parallel.apply import to_dtype
from mm_core.parallel.state import ParallelState, init_parallel_state
from mm_core.registry import import_plugins
from mm_core.tasks.base import (
    MAIN,
    StepResult,
    Task,
    TaskContext,
    TaskParts,
    check_step_result,
    task_class,
)
from mm_core.tools import StepTools
from mm_core.train.evaluation import Evaluator, is_eval_step
from mm_core.train.flops import peak_tflops
from mm_core.train.hf_save import hf_dir, save_hf_folder
from mm_core.train.metrics import MetricsLogger, peak_memory_gb
from mm_core.train.outputs import check_run_outputs
from mm_core.train.precision import set_fp32_precision
from mm_core.train.signals import StopRequest

log = logging.getLogger("mm")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def output_dir_for(cfg: MMConfig, config_path: str | None) -> Path:
    """``training.output_dir``, or ``outputs/<config file stem>``."""
    if cfg.training.output_dir:
        return Path(cfg.training.output_dir)
    return Path("outputs") / (Path(config_path).stem if config_path else "run")


class Trainer:
    """Owns one training run. ``Trainer(cfg).train()`` is the whole job; every piece is built in
    :meth:`setup` from the config and the live process group."""

    def __init__(self, cfg: MMConfig, config_path: str | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.out_dir = output_dir_for(cfg, config_path)
        self.stop = StopRequest()
        self.skipped_samples = 0  # records skipped by the data (on_error: skip), all ranks, this process
        self._skipped_pending = 0  # this rank's, not yet summed
        self._saved_step: int | None = None

    # ------------------------------------------------------------------------------------------ setup
    def setup(self) -> Trainer:
        cfg, tcfg = self.cfg, self.cfg.training
        check_supported(cfg)
        import_plugins(tcfg.plugin)
        make_task = task_class(tcfg.task)  # an unknown task fails before any process group work
        self.state: ParallelState = init_parallel_state(cfg.parallel)
        if tcfg.use_deter_comp:
            set_deterministic(True)
        precision_note = set_fp32_precision(self.state.device, tcfg.use_deter_comp)
        seed_everything(tcfg.seed)
        # where training.load points, resolved once: `auto` with no checkpoint yet means a fresh start,
        # so a meta-built model must then be initialised rather than left waiting for weights
        self.load_path = resolve_load_path(tcfg.load, tcfg.save) if tcfg.load is not None else None
        check_run_outputs(cfg, self.out_dir, self.load_path)  # another run's outputs, dataset folders
        self.setup_notes: list[str] = []
        # model.special_tokens: the extended tokenizer, which the dataset then reads
        tokens_note = prepare_tokenizer(cfg, self.out_dir)
        if tokens_note:
            self.setup_notes.append(tokens_note)
        # the data before the models: training.train_epochs needs the dataset's size for the lr schedule
        dataset = build_dataset(cfg.data, tcfg.seed)
        collate = build_collator(cfg.data, dataset)
        self.loader = build_dataloader(
            dataset,
            collate,
            cfg.data,
            micro_batch_size=tcfg.micro_batch_size,
            dp_size=self.state.sizes.dp,
            dp_rank=self.state.dp_rank,
            seed=tcfg.seed,
        )
        self.batches = EpochIterator(self.loader)
        # several sources (basic_parameters.dataset entries): each row's source goes with its micro-batch
        self.train_sources = Sources.of(dataset, cfg.data.dataset_param.basic_parameters)
        if tcfg.train_epochs is not None:
            iters, note = iters_for_epochs(self.loader, tcfg.train_epochs, tcfg.grad_accum)
            tcfg.set_epoch_iters(iters)
            self.setup_notes.append(note)
        seed_everything(tcfg.seed)  # the models start from the seed, whatever building the data drew
        self.progress = TrainProgress(world_size=self.state.sizes.world_size)
        self.ctx = TaskContext(cfg, self.state, self.load_path, self.progress, self.stop)
        self.task: Task = make_task(self.ctx)
        self.parts: TaskParts = self.task.build()
        self._zero = torch.zeros((), dtype=torch.float64, device=self.state.device)
        dtype = to_dtype(cfg.parallel.fsdp_plan.param_dtype)
        float_dtype = None if dtype == torch.float32 else dtype
        self._peak_tflops = peak_tflops(self.state.device, float_dtype, cfg.tools.peak_tflops)

        parts = self.parts
        self.train_state = TrainingState(
            model=parts.models[MAIN],
            optimizer=parts.optimizers.get(MAIN),
            scheduler=parts.schedulers.get(MAIN),
            progress=self.progress,
            data=self.batches,
            rng=RNGState(self.state.device, tcfg.seed),
            adapters_only=tcfg.lora.enable and tcfg.lora.save_adapters_only,
            extra={
                name: ModelParts(model, parts.optimizers.get(name), parts.schedulers.get(name))
                for name, model in parts.models.items()
                if name != MAIN
            },
        )
        self.saver = (
            CheckpointSaver(
                tcfg.save,
                async_save=tcfg.save_async,
                keep=tcfg.save_total_limit,
                save_optim=not tcfg.no_save_optim,
                save_rng=not tcfg.no_save_rng,
            )
            if tcfg.save
            else None
        )
        if self.task.reads_sources:
            self.ctx.sources = tuple(source_names(self.train_sources))
        self.evaluator = (
            Evaluator(cfg, self.state, self.task) if cfg.data.eval_dataset_param is not None else None
        )
        self._resume()
        for line in self.ctx.build_log:  # the build plan of each model, as mm check prints it
            self._info(line)
        if self.evaluator is not None:
            self._info(self.evaluator.describe())
        self._info(precision_note)
        for line in self.setup_notes:
            self._info(line)
        if self.task.setup_note:
            self._info(self.task.setup_note)  # once set up: a run that fails to start prints only its error
        return self

    @property
    def model(self) -> nn.Module:
        """The task's main model (``parts.models["model"]``)."""
        return self.parts.models[MAIN]

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The main model's optimizer."""
        return self.parts.optimizers.get(MAIN)

    def _resume(self) -> None:
        tcfg = self.cfg.training
        if tcfg.load is None:
            return
        path = self.load_path
        if path is None:
            self._info(f"training.load: auto found no checkpoint under {tcfg.save}; starting fresh")
            return
        # this run's optimizer settings, before loading (the configured values win, see optim.resume)
        configured = {n: [dict(g) for g in o.param_groups] for n, o in self.parts.optimizers.items()}
        report = load_checkpoint(
            path,
            self.train_state,
            load_optim=not tcfg.no_load_optim,
            load_rng=not tcfg.no_load_rng,
            strict=tcfg.load_strict,
        )
        self.task.after_load(path, report)
        missing = report["missing_model_keys"]
        note = f"; {len(missing)} model tensors were not in it: {', '.join(missing[:5])}" if missing else ""
        saved_world = report["saved_world_size"]
        if saved_world is not None and saved_world != self.state.sizes.world_size:
            note += f"; resharded from {saved_world} to {self.state.sizes.world_size} ranks"
            if report["reseeded_rng"] or saved_world < self.state.sizes.world_size:
                note += f" (ranks {saved_world}.. got fresh random states from the seed, step and rank)"
        self._info(f"loaded {path} ({', '.join(report['loaded'])}) at step {self.progress.step}{note}")
        loaded = set(report["loaded"])
        for name, optimizer in self.parts.optimizers.items():
            suffix = "" if name == MAIN else f"_{name}"
            scheduler = self.parts.schedulers.get(name)
            if (
                not isinstance(scheduler, LambdaLR)
                or not {f"optimizer{suffix}", f"scheduler{suffix}"} & loaded
            ):
                continue
            lines = apply_schedule_changes(optimizer, scheduler, configured[name], path, self.cfg)
            for line in lines if name == MAIN else ():  # the same config lines for every optimizer
                self._info(line)

    def _info(self, msg: str) -> None:
        if self.state.is_main:
            log.warning(msg)

    # ------------------------------------------------------------------------------------------- step
    def _next_micro_batches(self) -> list[dict[str, Any]]:
        out = []
        for _ in range(self.cfg.training.grad_accum):
            batch = next(self.batches)
            if self.task.reads_sources:
                tag_sources(batch, self.train_sources)
            batch.pop("sample_id", None)
            # records a dataset skipped (data.dataset_param.on_error: skip), counted by this rank; a plain
            # int from the collator (host data), summed over ranks when a step is logged
            self._skipped_pending += int(batch.pop("skipped_samples", 0))
            out.append(batch)
        return out

    def train_step(self, micro_batches: list[dict[str, Any]], *, log_memory: bool = False) -> StepResult:
        """One step of the task (:meth:`mm_core.tasks.Task.train_step`). The result always carries the stop
        agreement of every rank (from the task's own collective, or made here) and, with ``log_memory``, the
        peak memory of the fullest rank."""
        result = self.task.train_step(micro_batches, log_memory=log_memory)
        check_step_result(result, self.cfg.training.task)
        stop = result.stop if result.stop is not None else self.ctx.reduce({}).stop
        peak = result.peak_mem_gb
        if log_memory and peak is None:
            peak_t = torch.full_like(self._zero, peak_memory_gb(self.state.device))
            dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
            peak = float(peak_t)
        return replace(result, stop=stop, peak_mem_gb=peak)

    def _sum_skipped(self) -> None:
        """Add the records every rank skipped since the last call to :attr:`skipped_samples` (a collective:
        every rank calls it at the same steps)."""
        pending = torch.full_like(self._zero, float(self._skipped_pending))
        self._skipped_pending = 0
        dist.all_reduce(pending)
        # ranks of one data-parallel group read the same records, so each skipped record is counted that often
        self.skipped_samples += int(pending.item()) // (self.state.sizes.world_size // self.state.sizes.dp)

    def _throughput(self, flops: float, seconds: float) -> dict[str, float]:
        """``tflops_per_s`` per device of a step of ``flops`` model FLOPs (all ranks) and, when the device's
        peak is known (``tools.peak_tflops`` or mm's table), ``mfu`` (see :mod:`mm_core.train.flops`)."""
        per_device = flops / max(seconds, 1e-12) / self.state.sizes.world_size / 1e12
        out = {"tflops_per_s": per_device}
        if self._peak_tflops:
            out["mfu"] = per_device / self._peak_tflops
        return out

    # ------------------------------------------------------------------------------------------- loop
    def train(self) -> list[dict[str, Any]]:
        """Run until ``training.train_iters`` (or the steps of ``train_epochs``); returns the logged
        records (on every rank).

        SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C) finish the current step, save a checkpoint when
        ``training.save`` is set and raise :class:`TrainingInterrupted`; ``training.load: auto`` resumes.
        """
        cfg, tcfg = self.cfg, self.cfg.training
        main = self.state.is_main
        if main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.yaml").write_text(self.config_text(), encoding="utf-8")
        logger = MetricsLogger(
            self.out_dir,
            enabled=main,
            total_steps=tcfg.total_iters,
            start_step=self.progress.step,
            tools=cfg.tools,
            run_config=cfg.model_dump(mode="json") if main else None,
            progress_bar=tcfg.progress_bar,
        )
        records: list[dict[str, Any]] = []
        tools = StepTools(cfg.tools, dist.get_rank(), self.state.device_type, self.out_dir)
        try:
            with self.stop.handling_signals():
                while self.progress.step < tcfg.total_iters:
                    step = self.progress.step + 1
                    logged = step % tcfg.log_interval == 0 or step == tcfg.total_iters
                    evaluate = self.evaluator is not None and is_eval_step(cfg, step, tcfg.total_iters)
                    logged = logged or evaluate
                    tools.step_begin(step)
                    # no device synchronize: the step's own host sync waits for its statistics, which the
                    # device computes after the previous step's update, so in a steady state this is the time
                    # per step (the last update may still be running when the loop ends)
                    t0 = time.perf_counter()
                    result = self.train_step(self._next_micro_batches(), log_memory=logged)
                    metrics = result.metrics
                    dt = time.perf_counter() - t0
                    tools.step_end(step)
                    self.progress.step = step
                    self.progress.consumed_samples += self.batches.take_samples_consumed()
                    tokens = int(metrics.get("tokens", 0))
                    self.progress.consumed_tokens += tokens
                    if evaluate:
                        assert self.evaluator is not None
                        metrics = {**metrics, **self.evaluator.evaluate()}
                    if logged:
                        record: dict[str, Any] = {"step": step, **metrics}
                        if "tokens" in metrics:
                            record["tokens_per_s"] = tokens / dt
                        record.update(step_time_s=dt, peak_mem_gb=result.peak_mem_gb)
                        if result.flops is not None:
                            record.update(self._throughput(result.flops, dt))
                        if cfg.data.dataset_param.on_error == "skip":
                            self._sum_skipped()
                            record["skipped_samples"] = self.skipped_samples
                        records.append(record)
                        logger.log(record)
                    logger.advance()
                    if self.saver is not None:
                        self.saver.poll()
                    if result.stop:
                        self._stop_on_signal(step)
                    if tcfg.save and (step % tcfg.save_interval == 0 or step == tcfg.total_iters):
                        self.save()
                    hf_every = tcfg.save_hf_interval
                    if hf_every is not None and (step % hf_every == 0 or step == tcfg.total_iters):
                        self.save_hf()
                    self.task.after_step(step)
            if self.saver is not None:
                self.saver.wait()
        finally:
            tools.close()
            logger.close()
        return records

    def _stop_on_signal(self, step: int) -> None:
        """Every rank saw the stop request at this step: save (unless this step's checkpoint exists) and
        raise :class:`TrainingInterrupted`."""
        path = None
        if self.saver is not None:
            if self._saved_step != step:
                self.save()
            self.saver.wait()
            path = read_latest(self.saver.root)
        where = (
            f"saved {path}; resume with training.load: auto"
            if path is not None
            else "nothing saved (training.save is not set)"
        )
        raise TrainingInterrupted(f"stopped by {self.stop.signal_name} after step {step}: {where}")

    def config_text(self) -> str:
        return yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False)

    def save(self) -> Path:
        """Save a checkpoint of this step (with ``training.save_async``, start one; it completes later)."""
        assert self.saver is not None, "training.save is not set"
        self.task.before_save(self.progress.step)
        self._saved_step = self.progress.step
        path = self.saver.save(self.progress.step, self.train_state, self.config_text())
        if not self.cfg.training.save_async:
            self._info(f"saved checkpoint {path}")
        return path

    def save_hf(self) -> Path:
        """Write the Hugging Face folder of this step (``training.save_hf_interval``, see
        :mod:`mm_core.train.hf_save`)."""
        step = self.progress.step
        self.task.before_save(step)  # no folder of non-finite weights
        path = save_hf_folder(self.model, self.cfg, hf_dir(self.cfg, self.out_dir, step), self.state.device)
        self._info(f"saved Hugging Face folder {path}")
        return path

    def close(self) -> None:
        saver = getattr(self, "saver", None)  # None, or not set yet when __init__ failed
        if saver is not None:
            saver.close()  # a process exit waits for an asynchronous save in flight
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
