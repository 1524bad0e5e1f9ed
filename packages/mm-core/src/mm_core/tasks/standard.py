"""``standard``: the default task. One model (``model:``), one optimizer (``training.optimizer``), one loss:
mm's token loss from the model's logits and the batch's labels (``model.loss_cfg.loss_type``), or the
model's own ``.loss`` (``loss_type: raw``: diffusion transformers, models that compute their loss).

Language models, vision-language models, audio/omni models and video diffusion transformers all train
with it. What it adds over the task contract: the loss normalisation that makes every layout train the same
model (global loss units, see :mod:`mm_core.train.loss`), gradient accumulation with deferred reduction,
context parallelism, the chunked loss head, the router load-balancing loss, model-FLOPs accounting,
gradient clipping, and skipping non-finite steps; every count of a step stays on the device until one host
sync after clipping.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from mm_core.data import move_to_device
from mm_core.data.sources import SOURCE_KEY
from mm_core.errors import ConfigError, DataError
from mm_core.models.output import output_field
from mm_core.models.plan import plan_of
from mm_core.models.varlen import document_kwargs, uses_varlen
from mm_core.optim import build_optimizer, build_scheduler
from mm_core.optim.lr_scaling import unscaled_lr
from mm_core.parallel.apply import to_dtype
from mm_core.parallel.context import LAYOUT_KWARG, ContextParallel
from mm_core.parallel.expert_load import expert_load_for
from mm_core.parallel.experts import router_aux_for
from mm_core.tasks.base import MAIN, StepResult, Task, TaskParts
from mm_core.tasks.building import build_model
from mm_core.tasks.stats import read_on_host, start_read, sum_over_ranks
from mm_core.tasks.toolkit import TaskToolkit
from mm_core.train.flops import StepFlops
from mm_core.train.loss import count_units, loss_sum_and_rows, loss_weights, row_units, shift_labels
from mm_core.train.metrics import peak_memory_gb
from mm_parallel.memory.chunked_loss import ChunkedLossHead


class _Prepared(NamedTuple):
    """One micro-batch on the device (see :meth:`StandardTask._prepare`)."""

    batch: dict[str, Any]  # the model inputs
    targets: torch.Tensor | None  # the loss targets (None for loss_type: raw)
    units: torch.Tensor  # this rank's loss units, 0-dim on the device
    tokens: torch.Tensor  # this rank's input tokens, 0-dim on the device
    sources: torch.Tensor | None = None  # each row's source index (mixed sources; see mm_core.data.sources)


class StandardTask(Task):
    """One model, one optimizer, one loss (module docstring)."""

    _flops: torch.Tensor  # this rank's model FLOPs of the current step (see mm_core.train.flops)
    reads_sources = True  # losses per source (loss/<source>) with mixed training data

    def build(self) -> TaskParts:
        cfg, tcfg, state = self.ctx.cfg, self.ctx.cfg.training, self.ctx.state
        if tcfg.task_param:
            raise ConfigError(
                f"training.task_param: the standard task takes no settings (got {sorted(tcfg.task_param)})"
            )
        built = build_model(self.ctx)
        self.model, self.gather_plan, self.plan = built.model, built.gather_plan, built.plan
        self._model_name = type(self.model).__name__
        self._labels_withheld_ok = False
        self._plan_shown = False
        head_path, chunked_note = self.plan.chunked.path, self.plan.chunked.note
        loss_cfg = cfg.model.loss_cfg
        if loss_cfg.chunked_loss and loss_cfg.loss_type != "raw":
            self.setup_note = chunked_note
        head = self.model.get_submodule(head_path) if head_path else None
        self.chunked_head = head if isinstance(head, ChunkedLossHead) else None
        self._zero = torch.zeros((), dtype=torch.float64, device=state.device)
        self.toolkit = TaskToolkit(self.ctx, [self.model])
        plan = self.plan
        self.router_aux = router_aux_for(self.model, cfg.model.loss_cfg, plan.model_plan)  # None: dense
        # tokens per expert of each step, and the router bias update (None: no MoE layers)
        self.bias_rate = cfg.model.loss_cfg.router_bias_update_rate
        expert_names = plan.experts.names or plan.default_experts
        self.expert_load = expert_load_for(self.model, expert_names, self.bias_rate, state.device)
        # None without context parallel
        self.context = ContextParallel.build(self.model, plan.context, plan.model_plan, plan.facts, state)
        self.flops = StepFlops.of(self.model, plan)
        self.loss_parts = plan.model_plan.loss_parts
        self._one = torch.ones((), dtype=torch.float64, device=state.device)
        self._by_source: torch.Tensor | None = None  # [source, (loss sum, units)] of mixed sources
        self._uncovered = self._zero
        dtype = to_dtype(cfg.parallel.fsdp_plan.param_dtype)
        self.float_dtype = None if dtype == torch.float32 else dtype
        optimizer = build_optimizer(self.model, tcfg, plan.model_plan)
        self.optimizer, self.clip_scale_only = optimizer.optimizer, optimizer.clip_scale_only
        self.scheduler = build_scheduler(self.optimizer, tcfg)
        return TaskParts({MAIN: self.model}, {MAIN: self.optimizer}, {MAIN: self.scheduler})

    # ------------------------------------------------------------------------------------ the hooks
    def after_load(self, path: Path, report: Any) -> None:
        self.toolkit.after_load()

    def before_save(self, step: int) -> None:
        self.toolkit.before_save(step)

    def after_step(self, step: int) -> None:
        """The gathering plan (hook groups, prefetch) is shown once, after the forward that recorded it;
        with ``pregather`` the first units of the next forward are all-gathered now."""
        plan = self.gather_plan
        if plan is None:
            return
        fsdp_plan = self.ctx.cfg.parallel.fsdp_plan
        if not self._plan_shown:
            self._plan_shown = True
            self.ctx.info(plan.describe() + (", pregather on" if fsdp_plan.pregather else ""))
        if fsdp_plan.pregather and step < self.ctx.cfg.training.total_iters:
            plan.pregather()

    # ------------------------------------------------------------------------------------------ step
    def _prepare(self, batch: dict[str, Any]) -> _Prepared:
        """Move one micro-batch to the device and take out the loss targets (labels shifted by one).

        Returns the model inputs, the targets (None for ``loss_type: raw``), this rank's number of loss units
        and of input tokens (0-dim tensors on the device: no host sync). Anything that reshapes the batch for
        a parallel layout belongs here, after the shift (so no target crosses a split)."""
        loss_type = self.ctx.cfg.model.loss_cfg.loss_type
        sources = batch.pop(SOURCE_KEY, None)
        if uses_varlen(self.model):  # the documents of the micro-batch, read on the host once for every layer
            batch = {**batch, **document_kwargs(batch)}
        batch = move_to_device(batch, self.ctx.device, self.float_dtype)
        if loss_type == "raw":  # (context parallel: only a model that splits itself, see ModelPlan)
            return _Prepared(batch, None, self._zero, self._count_tokens(batch))
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
        if isinstance(sources, torch.Tensor):
            sources = sources.to(self.ctx.device) if sources.shape == targets.shape[:1] else None
        units = count_units(targets, loss_type).to(torch.float64)
        return _Prepared(batch, targets, units, tokens, sources)

    def _add_by_source(self, targets: torch.Tensor, rows: torch.Tensor, sources: torch.Tensor | None) -> None:
        """Add each row's loss and loss units to its source's ``[loss sum, units]`` in :attr:`_by_source`
        (rows of no known source count nowhere; a micro-batch without sources marks the step uncovered)."""
        if self._by_source is None:
            return
        if sources is None:
            self._uncovered = self._uncovered + 1.0
            return
        loss_type = self.ctx.cfg.model.loss_cfg.loss_type
        known = sources >= 0
        index = sources.clamp(min=0)
        values = torch.stack([rows.double(), row_units(targets, loss_type).double()], dim=1)
        self._by_source.index_add_(0, index, values * known.unsqueeze(1))

    def _source_metrics(self, values: dict[str, float], names: Sequence[str]) -> dict[str, float]:
        """``loss/<source>`` for every source with loss units in the step (none when some micro-batch's rows
        had no sources)."""
        if not names or values.get("uncovered", 0.0) > 0:
            return {}
        out = {}
        for i, name in enumerate(names):
            units = values[f"src:{i}:units"]
            if units > 0:
                out[f"loss/{name}"] = values[f"src:{i}:sum"] / units
        return out

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
        self,
        batch: dict[str, Any],
        targets: torch.Tensor | None,
        scale: torch.Tensor,
        tokens: torch.Tensor,
        sources: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward one micro-batch (``tokens``: this rank's input tokens of it, from :meth:`_prepare`).
        Returns the loss to back-propagate and this rank's contribution to the reported loss (a sum over
        loss units, or the raw loss)."""
        moe = {"output_router_logits": True} if self.router_aux is not None else {}
        layout = batch.get(LAYOUT_KWARG)
        ids = batch.get("input_ids")  # none in a batch of video latents: no text attention to count
        context = layout.segments.shape[1] if layout is not None else ids.shape[1] if ids is not None else 0
        vision_share = 1.0 / self.ctx.state.sizes.cp if self.context and self.context.split_module else 1.0
        loss_type = self.ctx.cfg.model.loss_cfg.loss_type
        head = self.chunked_head if targets is not None else None
        by_row = self._by_source is not None and targets is not None and targets.dim() == 2
        positions = (
            torch.zeros(targets.shape, dtype=torch.float32, device=targets.device)
            if by_row and head is not None and targets is not None
            else None
        )
        chunked = (
            nullcontext()
            if head is None or targets is None
            else head.computing_loss(targets, loss_weights(targets, loss_type), positions)
        )
        with chunked:
            out, flops = self.flops.forward_flops(
                lambda: self._call_model(batch, use_cache=False, **moe), tokens, context, vision_share
            )
        self._flops = self._flops + flops
        for name in self.loss_parts:
            value = output_field(out, name)
            if isinstance(value, torch.Tensor):
                self._parts[name] += torch.stack([value.detach().double().reshape(()), self._one])
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
            if positions is not None:
                self._add_by_source(targets, positions.sum(dim=-1), sources)
        else:
            s, rows = loss_sum_and_rows(logits, targets, loss_type)
            if by_row:
                self._add_by_source(targets, rows, sources)
        return self._add_router_loss(s * scale.to(s.dtype), out, batch), s.detach()

    def _call_model(self, batch: dict[str, Any], **kwargs: Any) -> Any:
        """The model's forward. mm keeps the labels unless ``loss_type: raw`` (it computes the loss from the
        logits); a model that cannot run without them fails on its first call: say so in one line."""
        loss_type = self.ctx.cfg.model.loss_cfg.loss_type
        if self._labels_withheld_ok or loss_type == "raw":
            return self.model(**batch, **kwargs)
        try:
            out = self.model(**batch, **kwargs)
        except (TypeError, AttributeError) as exc:
            raise ConfigError(
                f"model.loss_cfg.loss_type: {loss_type} computes the loss from the logits, so mm calls the "
                f"model without labels, and the forward of {self._model_name} failed without them "
                f"({type(exc).__name__}: {exc}); set model.loss_cfg.loss_type: raw to train on the model's "
                "own .loss"
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
        if not isinstance(model, FSDPModule) or self.ctx.cfg.training.grad_accum == 1:
            return
        if not self.ctx.cfg.parallel.fsdp_plan.reduce_scatter_per_micro_batch:
            model.set_requires_gradient_sync(last)
        elif self.ctx.state.sizes.dp_replicate > 1:
            model.set_requires_all_reduce(last)

    def train_step(self, micro_batches: list[dict[str, Any]], *, log_memory: bool = False) -> StepResult:
        """Forward/backward over the micro-batches, clip, step. Returns the step's global metrics.

        Every count stays on the device; the step makes one host sync, after clipping, that reads the loss,
        the grad norm, the counts, the stop request (and, with ``log_memory``, the peak memory of every rank)
        together. A non-finite loss or grad norm skips the update (``training.skip_nonfinite_steps``) or
        stops the run.
        """
        raw = self.ctx.cfg.model.loss_cfg.loss_type == "raw"
        ws = self.ctx.state.sizes.world_size
        prepared = [self._prepare(b) for b in micro_batches]
        # one collective for the normalisers: global loss units and input tokens
        counts = sum_over_ranks(
            {
                "units": torch.stack([p.units for p in prepared]).sum(),
                "tokens": torch.stack([p.tokens for p in prepared]).sum(),
            }
        )
        # FSDP averages gradients over every rank it reduces across; undo that so the gradient is the one of
        # (sum of losses / global units), the same for every layout
        scale = (
            torch.full_like(self._zero, 1.0 / len(prepared)) if raw else ws / counts["units"].clamp(min=1.0)
        )
        self._aux_values: list[torch.Tensor] = []
        self._aux_scale = float(ws) / len(prepared)
        self._flops = self._zero
        # each loss part: [sum of the micro-batches' values, number of them], on the device
        self._parts = {
            name: torch.zeros(2, dtype=torch.float64, device=self._zero.device) for name in self.loss_parts
        }
        names = () if raw else self.ctx.sources
        self._start_by_source(names)
        load = self.expert_load
        if load is not None:
            load.start_step()

        loss_sum_ = self._zero
        for i, p in enumerate(prepared):
            self._defer_gradient_reduction(last=i == len(prepared) - 1)
            if load is not None:  # the experts' tokens of this forward, padding left out
                load.start_micro_batch(
                    ContextParallel.local_mask(p.batch)
                    if LAYOUT_KWARG in p.batch
                    else p.batch.get("attention_mask")
                )
            loss, contrib = self._forward_loss(p.batch, p.targets, scale, p.tokens, p.sources)
            loss.backward()
            loss_sum_ = loss_sum_ + contrib.double()
        if load is not None:
            load.stop()
        # one collective for the step's loss sum, whether any rank was asked to stop (SIGTERM/SIGINT), the
        # model FLOPs of every rank, the loss parts and the tokens per expert (every rank's are distinct)
        stop = torch.full_like(self._zero, float(self.ctx.stop_requested))
        summed = sum_over_ranks(
            {"loss_sum": loss_sum_, "stop": stop, "flops": self._flops}
            | {f"part:{name}": part for name, part in self._parts.items()}
            | self._by_source_values()
            | ({"expert_load": load.counts.reshape(-1)} if load is not None else {})
        )
        loads = summed["expert_load"].reshape(load.counts.shape) if load is not None else None
        grad_norm = self.toolkit.clip(self.model, self.clip_scale_only)
        aux = self._aux_values
        stats = {
            "loss_sum": summed["loss_sum"],
            "grad_norm": grad_norm.to(self._zero.device, torch.float64),
            "units": counts["units"],
            "tokens": counts["tokens"],
            "stop": summed["stop"],
            "flops": summed["flops"],
            "aux_loss": torch.stack(aux).sum() / len(aux) if aux else self._zero,
        }
        if log_memory:
            peak = torch.full_like(self._zero, peak_memory_gb(self.ctx.device))
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            stats["peak_mem_gb"] = peak
        for name in self._parts:  # (sum, count) of each loss part
            stats[f"part:{name}:sum"], stats[f"part:{name}:count"] = summed[f"part:{name}"]
        stats.update(self._by_source_stats(summed, len(names)))
        balance = load.metrics(loads) if load is not None and loads is not None else {}
        stats.update(balance)
        step = self.ctx.progress.step + 1
        lr = unscaled_lr(self.optimizer)  # the rate of this step's update (training.lr_scaling_plan aside)
        pending = start_read(stats)  # the step's one host sync, waited for below
        if self.toolkit.masks_on_device(self.optimizer):
            # the update is issued first, masked on the device if the loss or the grad norm is not finite,
            # so the device runs it while the host waits only for the statistics copied before it
            values, applied = self.toolkit.update_then_read(
                self.optimizer,
                self.scheduler,
                step=step,
                loss=stats["loss_sum"],
                grad_norm=stats["grad_norm"],
                read=pending.result,
                names=("loss_sum", "grad_norm"),
            )
        else:  # the optimizer cannot skip on the device: the policy decides on the host values first
            values = pending.result()
        step_loss = values["loss_sum"] / (ws if raw else max(values["units"], 1.0))
        gnorm = values["grad_norm"]
        metrics = {"loss": step_loss, "grad_norm": gnorm, "lr": lr, "tokens": int(values["tokens"])}
        if aux:  # mixture-of-experts: the mean over micro-batches of the global router loss
            metrics["aux_loss"] = values["aux_loss"]
        for name in self._parts:
            count = values[f"part:{name}:count"]
            if count:
                metrics[name] = values[f"part:{name}:sum"] / count
        metrics.update(self._source_metrics(values, names))
        metrics.update({key: values[key] for key in balance})
        if not self.toolkit.masks_on_device(self.optimizer):
            applied = self.toolkit.update(
                self.optimizer, self.scheduler, step=step, grad_norm=gnorm, loss=step_loss
            )
        if applied and load is not None and loads is not None:  # a skipped step leaves the bias as well
            load.update_bias(loads, self.bias_rate)
        metrics.update(self.toolkit.nonfinite_metrics())
        return StepResult(
            metrics,
            stop=values["stop"] > 0,
            flops=values["flops"],  # of the whole step, every rank
            peak_mem_gb=values["peak_mem_gb"] if log_memory else None,
        )

    # ------------------------------------------------------------------------------- losses per source
    def _start_by_source(self, names: Sequence[str]) -> None:
        """Per-source ``[loss sum, units]`` for this step's (or evaluation's) micro-batches; None without
        mixed sources."""
        self._by_source = (
            torch.zeros(len(names), 2, dtype=torch.float64, device=self._zero.device) if names else None
        )
        self._uncovered = self._zero

    def _by_source_values(self) -> dict[str, torch.Tensor]:
        if self._by_source is None:
            return {}
        return {"by_source": self._by_source, "uncovered": self._uncovered}

    def _by_source_stats(self, summed: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
        if not count:
            return {}
        stats = {"uncovered": summed["uncovered"]}
        for i in range(count):
            stats[f"src:{i}:sum"], stats[f"src:{i}:units"] = summed["by_source"][i]
        return stats

    # ------------------------------------------------------------------------------------ evaluation
    def eval_step(
        self, micro_batches: Iterable[dict[str, Any]], sources: Sequence[str] = ()
    ) -> dict[str, float]:
        """The loss of the model on ``micro_batches`` (read one at a time) as training computes it: the same
        loss function and normalisation (the global token-weighted mean over every rank's micro-batches; for
        ``loss_type: raw`` the mean of the model's own loss), under ``model.eval()`` and
        ``torch.no_grad()``; with ``sources``, ``loss/<source>`` too. No training state changes (no
        gradient, optimizer step or FLOPs count)."""
        raw = self.ctx.cfg.model.loss_cfg.loss_type == "raw"
        ws = self.ctx.state.sizes.world_size
        names = () if raw else tuple(sources)
        was_training = self.model.training
        flops = getattr(self, "_flops", self._zero)
        self._flops, self._aux_values, self._aux_scale = self._zero, [], float(ws)
        self._parts = {
            name: torch.zeros(2, dtype=torch.float64, device=self._zero.device) for name in self.loss_parts
        }
        self._start_by_source(names)
        loss_sum_, units, count = self._zero, self._zero, 0
        self.model.eval()
        try:
            with torch.no_grad():
                for batch in micro_batches:
                    p = self._prepare(batch)
                    _, contrib = self._forward_loss(p.batch, p.targets, self._one, p.tokens, p.sources)
                    loss_sum_ = loss_sum_ + contrib.double()
                    units = units + p.units
                    count += 1
        finally:
            self.model.train(was_training)
            self._flops = flops
        summed = sum_over_ranks({"loss_sum": loss_sum_, "units": units} | self._by_source_values())
        stats = {"loss_sum": summed["loss_sum"], "units": summed["units"]}
        stats.update(self._by_source_stats(summed, len(names)))
        values = read_on_host(stats)
        loss = values["loss_sum"] / (ws * max(count, 1) if raw else max(values["units"], 1.0))
        return {"loss": loss, **self._source_metrics(values, names)}
