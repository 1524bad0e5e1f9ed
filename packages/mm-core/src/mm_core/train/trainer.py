"""The training loop: build everything from the config, then step, log and checkpoint."""

from __future__ import annotations

import logging
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.distributed.fsdp import FSDPModule

from mm_core.checkpoint import (
    CheckpointSaver,
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
from mm_core.data import EpochIterator, build_collator, build_dataloader, build_dataset, move_to_device
from mm_core.errors import ConfigError, DataError, TrainingInterrupted
from mm_core.models.hub import ModelHub, has_weights
from mm_core.models.output import output_field
from mm_core.models.plan import plan_of
from mm_core.optim import build_optimizer, build_scheduler
from mm_core.optim.resume import apply_schedule_changes
from mm_core.parallel.apply import apply_freeze, check_initialised, materialize_meta, shard_model, to_dtype
from mm_core.parallel.context import LAYOUT_KWARG, ContextParallel
from mm_core.parallel.experts import router_aux_for
from mm_core.parallel.memory import chunked_loss_plan
from mm_core.parallel.state import ParallelState, init_parallel_state
from mm_core.registry import import_plugins
from mm_core.tools import StepTools
from mm_core.train.flops import StepFlops, peak_tflops
from mm_core.train.loss import count_units, loss_sum, loss_weights, shift_labels
from mm_core.train.metrics import MetricsLogger, peak_memory_gb
from mm_core.train.nonfinite import NonFiniteGuard
from mm_core.train.outputs import check_run_outputs
from mm_core.train.signals import StopRequest
from mm_parallel.grad import clip_grad_norm_
from mm_parallel.memory.chunked_loss import ChunkedLossHead

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

    _flops: torch.Tensor  # this rank's model FLOPs of the current step (see mm_core.train.flops)

    def __init__(self, cfg: MMConfig, config_path: str | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.out_dir = output_dir_for(cfg, config_path)
        self.stop = StopRequest()
        self.skipped_samples = 0  # records skipped by the data (on_error: skip), all ranks, this process
        self._skipped_pending = 0  # this rank's, not yet summed
        self._labels_withheld_ok = False
        self._saved_step: int | None = None
        self._plan_shown = False

    # ------------------------------------------------------------------------------------------ setup
    def setup(self) -> Trainer:
        cfg, tcfg = self.cfg, self.cfg.training
        check_supported(cfg)
        import_plugins(tcfg.plugin)
        self.state: ParallelState = init_parallel_state(cfg.parallel)
        if tcfg.use_deter_comp:
            set_deterministic(True)
        seed_everything(tcfg.seed)
        # where training.load points, resolved once: `auto` with no checkpoint yet means a fresh start,
        # so a meta-built model must then be initialised rather than left waiting for weights
        self.load_path = resolve_load_path(tcfg.load, tcfg.save) if tcfg.load is not None else None
        check_run_outputs(cfg, self.out_dir, self.load_path)  # another run's outputs, dataset folders
        self.model = self._build_model()
        self._model_name = type(self.model).__name__
        head_path, chunked_note = chunked_loss_plan(self.model, cfg)
        head = self.model.get_submodule(head_path) if head_path else None
        self.chunked_head = head if isinstance(head, ChunkedLossHead) else None
        self._zero = torch.zeros((), dtype=torch.float64, device=self.state.device)
        self.nonfinite = NonFiniteGuard(tcfg.skip_nonfinite_steps, tcfg.save, self._info)
        self.router_aux = router_aux_for(self.model, cfg.model.loss_cfg)  # None for dense models
        self.context = ContextParallel.build(self.model, cfg, self.state)  # None without context parallel
        self.flops = StepFlops.of(self.model)
        self.float_dtype: torch.dtype | None = to_dtype(cfg.parallel.fsdp_plan.param_dtype)
        self._peak_tflops = peak_tflops(self.state.device, self.float_dtype, cfg.tools.peak_tflops)
        if self.float_dtype == torch.float32:
            self.float_dtype = None

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

        built = build_optimizer(self.model, tcfg, plan_of(self.model))
        self.optimizer, self.clip_scale_only = built.optimizer, built.clip_scale_only
        self.scheduler = build_scheduler(self.optimizer, tcfg)
        self.progress = TrainProgress(world_size=self.state.sizes.world_size)
        self.train_state = TrainingState(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            progress=self.progress,
            data=self.batches,
            rng=RNGState(self.state.device, tcfg.seed),
            adapters_only=tcfg.lora.enable and tcfg.lora.save_adapters_only,
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
        self._resume()
        if cfg.model.loss_cfg.chunked_loss and cfg.model.loss_cfg.loss_type != "raw":
            self._info(chunked_note)  # once set up: a run that fails to start prints only its error
        return self

    def _build_model(self) -> nn.Module:
        cfg, tcfg = self.cfg, self.cfg.training
        meta = tcfg.init_model_with_meta_device
        model = ModelHub.build(cfg.model, meta=meta)
        apply_freeze(model, cfg.model.freeze)
        if not meta:
            model.to(self.state.device)
        model, self.gather_plan = shard_model(model, cfg, self.state)
        if meta:
            weights_from_load = self.load_path is not None
            hf_weights = (
                not cfg.model.from_scratch
                and cfg.model.model_name_or_path
                and has_weights(cfg.model.model_name_or_path)
            )
            materialize_meta(model, self.state.device, init=not (weights_from_load or hf_weights))
            if hf_weights and not weights_from_load:
                from mm_core.convert import load_hf_weights

                assert cfg.model.model_name_or_path is not None  # hf_weights implies it
                load_hf_weights(model, cfg.model.model_name_or_path)
                check_initialised(model)
        model.train()
        return model

    def _resume(self) -> None:
        tcfg = self.cfg.training
        if tcfg.load is None:
            return
        path = self.load_path
        if path is None:
            self._info(f"training.load: auto found no checkpoint under {tcfg.save}; starting fresh")
            return
        configured = [dict(g) for g in self.optimizer.param_groups]  # this run's settings, before loading
        report = load_checkpoint(
            path,
            self.train_state,
            load_optim=not tcfg.no_load_optim,
            load_rng=not tcfg.no_load_rng,
            strict=tcfg.load_strict,
        )
        if tcfg.init_model_with_meta_device:
            check_initialised(self.model)
        missing = report["missing_model_keys"]
        note = f"; {len(missing)} model tensors were not in it: {', '.join(missing[:5])}" if missing else ""
        saved_world = report["saved_world_size"]
        if saved_world is not None and saved_world != self.state.sizes.world_size:
            note += f"; resharded from {saved_world} to {self.state.sizes.world_size} ranks"
            if report["reseeded_rng"] or saved_world < self.state.sizes.world_size:
                note += f" (ranks {saved_world}.. got fresh random states from the seed, step and rank)"
        self._info(f"loaded {path} ({', '.join(report['loaded'])}) at step {self.progress.step}{note}")
        if "optimizer" in report["loaded"] or "scheduler" in report["loaded"]:
            for line in apply_schedule_changes(self.optimizer, self.scheduler, configured, path, self.cfg):
                self._info(line)

    def _info(self, msg: str) -> None:
        if self.state.is_main:
            log.warning(msg)

    # ------------------------------------------------------------------------------------------- step
    def _next_micro_batches(self) -> list[dict[str, Any]]:
        out = []
        for _ in range(self.cfg.training.grad_accum):
            batch = next(self.batches)
            batch.pop("sample_id", None)
            # records a dataset skipped (data.dataset_param.on_error: skip), counted by this rank; a plain
            # int from the collator (host data), summed over ranks with the step's other counts
            self._skipped_pending += int(batch.pop("skipped_samples", 0))
            out.append(batch)
        return out

    def _prepare(
        self, batch: dict[str, Any]
    ) -> tuple[dict[str, Any], torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Move one micro-batch to the device and take out the loss targets (labels shifted by one).

        Returns the model inputs, the targets (None for ``loss_type: raw``), this rank's number of loss units
        and of input tokens (0-dim tensors on the device: no host sync). Anything that reshapes the batch for
        a parallel layout belongs here, after the shift (so no target crosses a split)."""
        loss_type = self.cfg.model.loss_cfg.loss_type
        batch = move_to_device(batch, self.state.device, self.float_dtype)
        if loss_type == "raw":  # (context parallel: only a model that splits itself, see ModelPlan)
            return batch, None, self._zero, self._count_tokens(batch)
        if "labels" not in batch:
            raise DataError(
                f"the batch has no 'labels' (fields: {', '.join(batch)}); model.loss_cfg.loss_type "
                f"{loss_type!r} computes the loss from the model's logits and the labels; use a collator "
                "that produces labels, or loss_type: raw to use the model's own .loss"
            )
        targets = shift_labels(batch.pop("labels"))
        if self.context is not None:  # this rank's part of the sequence; counts below are of that part
            batch, targets = self.context.shard(batch, targets)
            tokens = self.context.local_tokens(batch).to(self._zero)
        else:
            tokens = self._count_tokens(batch)
        return batch, targets, count_units(targets, loss_type).to(torch.float64), tokens

    def _count_tokens(self, batch: dict[str, Any]) -> torch.Tensor:
        """Input tokens of a micro-batch (the model plan's count, else attention-mask ones, else every
        position), on the device."""
        count = plan_of(self.model).count_tokens
        if count is not None:
            return count(self.model, batch).to(self._zero)
        mask = batch.get("attention_mask")
        if mask is not None:
            return mask.sum(dtype=torch.float64)
        return torch.full_like(self._zero, float(batch["input_ids"].numel()))

    def _forward_loss(
        self, batch: dict[str, Any], targets: torch.Tensor | None, scale: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward one micro-batch (``tokens``: this rank's input tokens of it, from :meth:`_prepare`).
        Returns the loss to back-propagate and this rank's contribution to the reported loss (a sum over
        loss units, or the raw loss)."""
        moe = {"output_router_logits": True} if self.router_aux is not None else {}
        layout = batch.get(LAYOUT_KWARG)
        ids = batch.get("input_ids")  # none in a batch of video latents: no text attention to count
        context = layout.segments.shape[1] if layout is not None else ids.shape[1] if ids is not None else 0
        vision_share = 1.0 / self.state.sizes.cp if self.context and self.context.split_module else 1.0
        loss_type = self.cfg.model.loss_cfg.loss_type
        head = self.chunked_head if targets is not None else None
        chunked = (
            nullcontext()
            if head is None or targets is None
            else head.computing_loss(targets, loss_weights(targets, loss_type))
        )
        with chunked:
            out, flops = self.flops.forward_flops(
                lambda: self._call_model(batch, use_cache=False, **moe), tokens, context, vision_share
            )
        self._flops = self._flops + flops
        if targets is None:
            loss = output_field(out, "loss")
            if not isinstance(loss, torch.Tensor):
                raise ConfigError(
                    f"model.loss_cfg.loss_type: raw trains on the model's own .loss, but the forward of "
                    f"{self._model_name} returned loss={loss!r}; return the loss (e.g. compute it from the "
                    "labels the batch carries), or use loss_type: per_token_loss to let mm compute it from "
                    ".logits"
                )
            loss = loss * scale.to(loss.dtype)
            return loss, loss.detach()
        logits = output_field(out, "logits")
        if not isinstance(logits, torch.Tensor):
            raise ConfigError(
                f"model.loss_cfg.loss_type: {loss_type} computes the loss from the model's .logits, but the "
                f"forward of {self._model_name} returned none; return .logits, or set "
                "model.loss_cfg.loss_type: raw to train on the model's own .loss"
            )
        if head is not None:  # the head returned the summed loss as the "logits"
            if head.calls != 1 or logits.dim() != 0:
                raise ConfigError(
                    f"model.loss_cfg.chunked_loss: the plan of {self._model_name} names "
                    f"{plan_of(self.model).output_head} as its output head, but the forward called it "
                    f"{head.calls} times and returned .logits of shape {tuple(logits.shape)} (expected one "
                    "call whose output is returned unchanged); correct ModelPlan.output_head, or set "
                    "model.loss_cfg.chunked_loss: false"
                )
            s = logits
        else:
            s = loss_sum(logits, targets, loss_type)
        return self._add_router_loss(s * scale.to(s.dtype), out, batch), s.detach()

    def _call_model(self, batch: dict[str, Any], **kwargs: Any) -> Any:
        """The model's forward. mm keeps the labels unless ``loss_type: raw`` (it computes the loss from the
        logits); a model that cannot run without them fails on its first call: say so in one line."""
        if self._labels_withheld_ok or self.cfg.model.loss_cfg.loss_type == "raw":
            return self.model(**batch, **kwargs)
        try:
            out = self.model(**batch, **kwargs)
        except (TypeError, AttributeError) as exc:
            raise ConfigError(
                f"model.loss_cfg.loss_type: {self.cfg.model.loss_cfg.loss_type} computes the loss from the "
                f"logits, so mm calls the model without labels, and the forward of {self._model_name} failed "
                f"without them ({type(exc).__name__}: {exc}); set model.loss_cfg.loss_type: raw to train on "
                "the model's own .loss"
            ) from exc
        self._labels_withheld_ok = True
        return out

    def _add_router_loss(self, loss: torch.Tensor, out: Any, batch: dict[str, Any]) -> torch.Tensor:
        """Add ``router_aux_loss_coef`` x the load-balancing loss of the global micro-batch (this rank share,
        scaled like the main loss for FSDP's averaging and by 1 / micro-batches); record its value."""
        if self.router_aux is None:
            return loss
        mask = ContextParallel.local_mask(batch) if LAYOUT_KWARG in batch else batch.get("attention_mask")
        share, value = self.router_aux(output_field(out, "router_logits"), mask)
        self._aux_values.append(value.detach().to(torch.float64))
        if not self.router_aux.coef:
            return loss
        return loss + share * (self.router_aux.coef * self._aux_scale)

    def _defer_gradient_reduction(self, *, last: bool) -> None:
        """Before each micro-batch's backward: HSDP and DDP layouts all-reduce across replicas once per step,
        after the last micro-batch (the ones before keep their reduce-scattered gradients, no extra memory);
        with ``parallel.fsdp_plan.reduce_scatter_per_micro_batch: false`` the reduce-scatter waits as well."""
        model = self.model
        if not isinstance(model, FSDPModule) or self.cfg.training.grad_accum == 1:
            return
        if not self.cfg.parallel.fsdp_plan.reduce_scatter_per_micro_batch:
            model.set_requires_gradient_sync(last)
        elif self.state.sizes.dp_replicate > 1:
            model.set_requires_all_reduce(last)

    def _throughput(self, flops: float, seconds: float) -> dict[str, float]:
        """``tflops_per_s`` per device of a step of ``flops`` model FLOPs (all ranks) and, when the device's
        peak is known (``tools.peak_tflops`` or mm's table), ``mfu`` (see :mod:`mm_core.train.flops`)."""
        per_device = flops / max(seconds, 1e-12) / self.state.sizes.world_size / 1e12
        out = {"tflops_per_s": per_device}
        if self._peak_tflops:
            out["mfu"] = per_device / self._peak_tflops
        return out

    def _clip_grads(self) -> torch.Tensor:
        """Clip gradients by the global norm (the optimizer's clipping policy); returns the norm, on the
        device."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return clip_grad_norm_(params, self.cfg.training.clip_grad, scale_only=self.clip_scale_only)

    def train_step(
        self, micro_batches: list[dict[str, Any]], *, log_memory: bool = False
    ) -> dict[str, float]:
        """Forward/backward over the micro-batches, clip, step. Returns the step's global metrics.

        Every count stays on the device; the step makes one host sync, after clipping, that reads the loss,
        the grad norm, the counts (and, with ``log_memory``, the peak memory of every rank) together. A
        non-finite loss or grad norm skips the update (``training.skip_nonfinite_steps``) or stops the run.
        """
        raw = self.cfg.model.loss_cfg.loss_type == "raw"
        ws = self.state.sizes.world_size
        prepared = [self._prepare(b) for b in micro_batches]
        # one collective for the normalisers: global loss units, input tokens and skipped records
        skipped, self._skipped_pending = self._skipped_pending, 0
        counts = torch.stack(
            [
                torch.stack([p[2] for p in prepared]).sum(),
                torch.stack([p[3] for p in prepared]).sum(),
                torch.full_like(self._zero, float(skipped)),
            ]
        )
        dist.all_reduce(counts)
        global_units = counts[0]
        # FSDP averages gradients over every rank it reduces across; undo that so the gradient is the one of
        # (sum of losses / global units), the same for every layout
        scale = torch.full_like(self._zero, 1.0 / len(prepared)) if raw else ws / global_units.clamp(min=1.0)
        self._aux_values: list[torch.Tensor] = []
        self._aux_scale = float(ws) / len(prepared)
        self._flops = self._zero

        # the step's loss sum and, beside it, whether any rank was asked to stop (SIGTERM/SIGINT) and the
        # model FLOPs of every rank
        loss_acc = torch.zeros(3, dtype=torch.float64, device=self._zero.device)
        for i, (batch, targets, _, tokens) in enumerate(prepared):
            self._defer_gradient_reduction(last=i == len(prepared) - 1)
            loss, contrib = self._forward_loss(batch, targets, scale, tokens)
            loss.backward()
            loss_acc[0] += contrib.double()
        loss_acc[1] = float(self.stop.requested)
        loss_acc[2] = self._flops
        dist.all_reduce(loss_acc)
        grad_norm = self._clip_grads()
        stats = [loss_acc[0], grad_norm.to(loss_acc.device, torch.float64), counts[0], counts[1], counts[2]]
        stats += [loss_acc[1], loss_acc[2]]
        aux = self._aux_values
        stats.append(torch.stack(aux).sum() / len(aux) if aux else self._zero)
        if log_memory:
            peak = torch.full_like(self._zero, peak_memory_gb(self.state.device))
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            stats.append(peak)
        values = torch.stack(stats).tolist()  # the step's one host sync
        loss_sum_, gnorm, units, tokens, skipped_all, stop, flops, aux = values[:8]
        step_loss = loss_sum_ / (ws if raw else max(units, 1.0))
        self.stop.agreed = self.stop.agreed or stop > 0
        # ranks of one data-parallel group read the same records, so each skipped record is counted that often
        self.skipped_samples += int(skipped_all) // (ws // self.state.sizes.dp)
        lr = self.optimizer.param_groups[0]["lr"]
        metrics = {"loss": step_loss, "grad_norm": gnorm, "lr": lr, "tokens": int(tokens)}
        if self._aux_values:  # mixture-of-experts: the mean over micro-batches of the global router loss
            metrics["aux_loss"] = aux
        metrics["flops"] = flops  # of the whole step, every rank (popped for tflops_per_s and mfu)
        if log_memory:
            metrics["peak_mem_gb"] = values[8]
        if self.nonfinite.allows_update(self.progress.step + 1, step_loss, gnorm):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.cfg.training.skip_nonfinite_steps:
            metrics["skipped_nonfinite_steps"] = self.nonfinite.skipped
        return metrics

    # ------------------------------------------------------------------------------------------- loop
    def train(self) -> list[dict[str, Any]]:
        """Run until ``training.train_iters``; returns the logged records (on every rank).

        SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C) finish the current step, save a checkpoint when
        ``training.save`` is set and raise :class:`TrainingInterrupted`; ``training.load: auto`` resumes.
        """
        cfg, tcfg = self.cfg, self.cfg.training
        main = self.state.is_main
        if main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.yaml").write_text(self.config_text(), encoding="utf-8")
        tb = cfg.tools.tensorboard
        logger = MetricsLogger(
            self.out_dir,
            enabled=main,
            total_steps=tcfg.train_iters,
            start_step=self.progress.step,
            tensorboard_dir=(Path(tb.log_dir) if tb.log_dir else self.out_dir / "tb") if tb.enable else None,
            progress_bar=tcfg.progress_bar,
        )
        records: list[dict[str, Any]] = []
        tools = StepTools(cfg.tools, dist.get_rank(), self.state.device_type, self.out_dir)
        try:
            with self.stop.handling_signals():
                while self.progress.step < tcfg.train_iters:
                    step = self.progress.step + 1
                    logged = step % tcfg.log_interval == 0 or step == tcfg.train_iters
                    tools.step_begin(step)
                    # no device synchronize: the step's own host sync waits for the previous step's update,
                    # so in a steady state this is the time per step
                    t0 = time.perf_counter()
                    metrics = self.train_step(self._next_micro_batches(), log_memory=logged)
                    dt = time.perf_counter() - t0
                    tools.step_end(step)
                    self.progress.step = step
                    self.progress.consumed_samples += self.batches.take_samples_consumed()
                    self.progress.consumed_tokens += int(metrics["tokens"])
                    flops = metrics.pop("flops")
                    if logged:
                        peak = metrics.pop("peak_mem_gb")
                        record = {"step": step, **metrics, "tokens_per_s": metrics["tokens"] / dt}
                        record.update(step_time_s=dt, peak_mem_gb=peak)
                        record.update(self._throughput(flops, dt))
                        if cfg.data.dataset_param.on_error == "skip":
                            record["skipped_samples"] = self.skipped_samples
                        records.append(record)
                        logger.log(record)
                    logger.advance()
                    if self.saver is not None:
                        self.saver.poll()
                    if self.stop.agreed:
                        self._stop_on_signal(step)
                    if tcfg.save and (step % tcfg.save_interval == 0 or step == tcfg.train_iters):
                        self.save()
                    self._after_step(step)
            if self.saver is not None:
                self.saver.wait()
        finally:
            tools.close()
            logger.close()
        return records

    def _after_step(self, step: int) -> None:
        """The gathering plan (hook groups, prefetch) is shown once, after the forward that recorded it;
        with ``pregather`` the first units of the next forward are all-gathered now."""
        plan = self.gather_plan
        if plan is None:
            return
        if not self._plan_shown:
            self._plan_shown = True
            self._info(plan.describe() + (", pregather on" if self.cfg.parallel.fsdp_plan.pregather else ""))
        if self.cfg.parallel.fsdp_plan.pregather and step < self.cfg.training.train_iters:
            plan.pregather()

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
        self.nonfinite.check_weights(self.model, self.progress.step, self.state.device)
        self._saved_step = self.progress.step
        path = self.saver.save(self.progress.step, self.train_state, self.config_text())
        if not self.cfg.training.save_async:
            self._info(f"saved checkpoint {path}")
        return path

    def close(self) -> None:
        saver = getattr(self, "saver", None)  # None, or not set yet when __init__ failed
        if saver is not None:
            saver.close()  # a process exit waits for an asynchronous save in flight
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
