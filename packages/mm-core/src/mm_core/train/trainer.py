"""The training loop: build everything from the config, then step, log and checkpoint."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch import nn

from mm_core.checkpoint import (
    CheckpointSaver,
    RNGState,
    TrainingState,
    TrainProgress,
    load_checkpoint,
    resolve_load_path,
    set_deterministic,
)
from mm_core.config.schema import MMConfig
from mm_core.config.support import check_supported
from mm_core.data import EpochIterator, build_collator, build_dataloader, build_dataset, move_to_device
from mm_core.errors import DataError
from mm_core.models.hub import ModelHub, has_weights, model_plans
from mm_core.optim import build_optimizer, build_scheduler
from mm_core.optim.muon import clip_grad_norm_adamw_only_
from mm_core.parallel.apply import apply_freeze, check_initialised, materialize_meta, shard_model, to_dtype
from mm_core.parallel.context import ContextParallel
from mm_core.parallel.experts import router_aux_for
from mm_core.parallel.state import ParallelState, init_parallel_state
from mm_core.registry import import_plugins
from mm_core.tools import StepTools
from mm_core.train.loss import count_units, loss_sum, shift_labels
from mm_core.train.metrics import MetricsLogger, peak_memory_gb
from mm_parallel.grad import clip_grad_norm_

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
        self.model = self._build_model()
        self.router_aux = router_aux_for(self.model, cfg.model.loss_cfg)  # None for dense models
        self.context = ContextParallel.build(self.model, cfg, self.state)  # None without context parallel
        self.float_dtype = to_dtype(cfg.parallel.fsdp_plan.param_dtype)
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

        self.optimizer = build_optimizer(self.model, tcfg, model_plans(self.model))
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
        return self

    def _build_model(self) -> nn.Module:
        cfg, tcfg = self.cfg, self.cfg.training
        meta = tcfg.init_model_with_meta_device
        model = ModelHub.build(cfg.model, meta=meta)
        apply_freeze(model, cfg.model.freeze)
        if not meta:
            model.to(self.state.device)
        model = shard_model(model, cfg, self.state)
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

    def _info(self, msg: str) -> None:
        if self.state.is_main:
            log.warning(msg)

    # ------------------------------------------------------------------------------------------- step
    def _next_micro_batches(self) -> list[dict[str, Any]]:
        out = []
        for _ in range(self.cfg.training.grad_accum):
            batch = next(self.batches)
            batch.pop("sample_id", None)
            # records a dataset skipped (data.dataset_param.on_error: skip), counted by this rank
            self.skipped_samples = getattr(self, "skipped_samples", 0) + int(batch.pop("skipped_samples", 0))
            out.append(batch)
        return out

    def _prepare(self, batch: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor | None, float, int]:
        """Move one micro-batch to the device and take out the loss targets (labels shifted by one).

        Returns the model inputs, the targets (None for ``loss_type: raw``), this rank's number of loss units
        and of input tokens. Anything that reshapes the batch for a parallel layout belongs here, after the
        shift (so no target crosses a split)."""
        loss_type = self.cfg.model.loss_cfg.loss_type
        batch = move_to_device(batch, self.state.device, self.float_dtype)
        if loss_type == "raw":  # (context parallel refuses raw: see mm_core.parallel.context)
            mask = batch.get("attention_mask")
            return batch, None, 0.0, int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        if "labels" not in batch:
            raise DataError(
                f"the batch has no 'labels' (fields: {', '.join(batch)}); model.loss_cfg.loss_type "
                f"{loss_type!r} computes the loss from the model's logits and the labels; use a collator "
                "that produces labels, or loss_type: raw to use the model's own .loss"
            )
        targets = shift_labels(batch.pop("labels"))
        if self.context is not None:  # this rank's part of the sequence; counts below are of that part
            batch, targets = self.context.shard(batch, targets)
            tokens = self.context.local_tokens(batch)
        else:
            mask = batch.get("attention_mask")
            tokens = int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        return batch, targets, float(count_units(targets, loss_type)), tokens

    def _forward_loss(
        self, batch: dict[str, Any], targets: torch.Tensor | None, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward one micro-batch. Returns the loss to back-propagate and this rank's contribution to the
        reported loss (a sum over loss units, or the raw loss)."""
        moe = {"output_router_logits": True} if self.router_aux is not None else {}
        out = self.model(**batch, use_cache=False, **moe)
        if targets is None:
            loss = out.loss * scale
            return loss, loss.detach()
        s = loss_sum(out.logits, targets, self.cfg.model.loss_cfg.loss_type)
        return self._add_router_loss(s * scale, out, batch), s.detach()

    def _add_router_loss(self, loss: torch.Tensor, out: Any, batch: dict[str, Any]) -> torch.Tensor:
        """Add ``router_aux_loss_coef`` x the load-balancing loss of the global micro-batch (this rank share,
        scaled like the main loss for FSDP's averaging and by 1 / micro-batches); record its value."""
        if self.router_aux is None:
            return loss
        share, value = self.router_aux(out.router_logits, batch.get("attention_mask"))
        self._aux_values.append(float(value))
        if not self.router_aux.coef:
            return loss
        return loss + share * (self.router_aux.coef * self._aux_scale)

    def _clip_and_step(self) -> tuple[float, float]:
        """Clip gradients by the global norm, step optimizer and schedule; returns (grad norm, lr used)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        tcfg = self.cfg.training
        if tcfg.optimizer == "muon" and not tcfg.muon.clip_muon_params:
            grad_norm = clip_grad_norm_adamw_only_(params, self.optimizer, tcfg.clip_grad)
        else:
            grad_norm = clip_grad_norm_(params, tcfg.clip_grad)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm), lr

    def train_step(self, micro_batches: list[dict[str, Any]]) -> dict[str, float]:
        """Forward/backward over the micro-batches, clip, step. Returns the step's global metrics."""
        raw = self.cfg.model.loss_cfg.loss_type == "raw"
        prepared = [self._prepare(b) for b in micro_batches]
        # one collective for the normalisers: global loss units and input tokens of this step
        counts = torch.tensor([sum(p[2] for p in prepared), sum(p[3] for p in prepared)], dtype=torch.float64)
        dist.all_reduce(counts)
        global_units, global_tokens = counts.tolist()
        # FSDP averages gradients over every rank it reduces across; undo that so the gradient is the one of
        # (sum of losses / global units), the same for every layout
        ranks_averaged = float(self.state.sizes.world_size)
        scale = 1.0 / len(prepared) if raw else ranks_averaged / max(global_units, 1.0)
        self._aux_values: list[float] = []
        self._aux_scale = ranks_averaged / len(prepared)

        loss_acc = torch.zeros((), dtype=torch.float64)
        for batch, targets, _, _ in prepared:
            loss, contrib = self._forward_loss(batch, targets, scale)
            loss.backward()
            loss_acc += contrib.double().cpu()
        dist.all_reduce(loss_acc)
        step_loss = loss_acc.item() / (self.state.sizes.world_size if raw else max(global_units, 1.0))
        grad_norm, lr = self._clip_and_step()
        metrics = {"loss": step_loss, "grad_norm": grad_norm, "lr": lr, "tokens": int(global_tokens)}
        if self._aux_values:  # mixture-of-experts: the mean over micro-batches of the global router loss
            metrics["aux_loss"] = sum(self._aux_values) / len(self._aux_values)
        return metrics

    # ------------------------------------------------------------------------------------------- loop
    def train(self) -> list[dict[str, Any]]:
        """Run until ``training.train_iters``; returns the logged records (on every rank)."""
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
        sync = getattr(torch, self.state.device_type).synchronize if self.state.device_type != "cpu" else None
        tools = StepTools(cfg.tools, dist.get_rank(), self.state.device_type, self.out_dir)
        try:
            while self.progress.step < tcfg.train_iters:
                tools.step_begin(self.progress.step + 1)
                t0 = time.perf_counter()
                micro = self._next_micro_batches()
                metrics = self.train_step(micro)
                if sync is not None:
                    sync()
                dt = time.perf_counter() - t0
                tools.step_end(self.progress.step + 1)
                self.progress.step += 1
                self.progress.consumed_samples += (
                    tcfg.micro_batch_size * tcfg.grad_accum * self.state.sizes.dp
                )
                self.progress.consumed_tokens += metrics["tokens"]
                step = self.progress.step
                if step % tcfg.log_interval == 0 or step == tcfg.train_iters:
                    peak = torch.tensor([peak_memory_gb(self.state.device)])
                    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                    record = {
                        "step": step,
                        **metrics,
                        "tokens_per_s": metrics["tokens"] / dt,
                        "step_time_s": dt,
                        "peak_mem_gb": peak.item(),
                    }
                    if cfg.data.dataset_param.on_error == "skip":
                        skipped = torch.tensor([getattr(self, "skipped_samples", 0)], dtype=torch.int64)
                        dist.all_reduce(skipped)  # ranks of one data-parallel group read the same records
                        record["skipped_samples"] = int(skipped.item()) // (
                            self.state.sizes.world_size // self.state.sizes.dp
                        )
                    records.append(record)
                    logger.log(record)
                logger.advance()
                if self.saver is not None:
                    self.saver.poll()
                if tcfg.save and (step % tcfg.save_interval == 0 or step == tcfg.train_iters):
                    self.save()
            if self.saver is not None:
                self.saver.wait()
        finally:
            tools.close()
            logger.close()
        return records

    def config_text(self) -> str:
        return yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False)

    def save(self) -> Path:
        """Save a checkpoint of this step (with ``training.save_async``, start one; it completes later)."""
        assert self.saver is not None, "training.save is not set"
        path = self.saver.save(self.progress.step, self.train_state, self.config_text())
        if not self.cfg.training.save_async:
            self._info(f"saved checkpoint {path}")
        return path

    def close(self) -> None:
        if getattr(self, "saver", None) is not None:
            self.saver.close()  # a process exit waits for an asynchronous save in flight
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
