"""Mixture-of-experts balance: the tokens each expert receives in a training step, and the auxiliary-loss-free
balancing of sigmoid-routed models (``model.loss_cfg.router_bias_update_rate``).

A mixture-of-experts block in transformers calls its fused experts module as
``experts(hidden_states, top_k_index, top_k_weights)`` after its router, and mm's expert-parallel adapter
(:class:`~mm_parallel.moe.ExpertParallelExperts`) keeps that call with this rank's tokens. A forward pre-hook
on each expert module (the model plan's ``expert_modules``, or ``parallel.ep_plan.apply_modules``) adds the
micro-batch's choices to a fixed-size device tensor ``[moe layers, experts]`` with ``index_add_`` (no host
sync), each row weighted by the micro-batch's real-token mask so that padding does not count. A layer counts
once per micro-batch: the forward recomputed in backward (``model.recompute``) and evaluation
(``torch.no_grad``) add nothing. Every rank holds distinct tokens (data, context and expert parallelism all
split the global batch), so the sum over every rank is the global load; the task sums it with the step's other
statistics in its one all-reduce and derives the logged metrics on the device (:meth:`ExpertLoad.metrics`).

DeepSeek-V3-style routers (Kimi K2.5, Step 3.7, MiniMax-M3) add a buffer ``e_score_correction_bias``
``[experts]`` to the sigmoid scores for the choice only; nothing trains it by gradient. With a positive
``router_bias_update_rate`` each applied optimizer step moves it by ``rate x sign(mean load - expert load)``
per layer (Megatron's ``moe_router_bias_update_rate``: an overloaded expert's bias decreases), from the global
loads on the device, so every layout and every rank updates its replicated copy identically. The buffer is
persistent, so the checkpoint carries it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
from torch import nn

from mm_core.errors import ConfigError

RATE_KEY = "model.loss_cfg.router_bias_update_rate"
#: the routers' correction bias (transformers' name in every DeepSeek-V3-style router)
BIAS = "e_score_correction_bias"
#: the logged balance metrics (each as ``moe/<name>`` for the whole model and as
#: ``moe/<name>/layers_<a>-<b>`` per group of consecutive MoE layers)
LOAD_RATIO = "load_max_over_mean"
DEAD = "dead_experts"
#: how many groups of consecutive MoE layers get their own metrics (fewer when there are fewer layers)
GROUPS = 4


def _layer_number(name: str, position: int) -> int:
    """The decoder layer index in an expert module's name (its last integer component), else its position
    among the MoE layers."""
    numbers = [int(part) for part in name.split(".") if re.fullmatch(r"\d+", part)]
    return numbers[-1] if numbers else position


class ExpertLoad:
    """Tokens per expert of the current step, per MoE layer, on the device (module docstring)."""

    def __init__(self, model: nn.Module, names: Sequence[str], device: torch.device) -> None:
        """Hook the expert modules ``names`` of ``model`` (built and sharded, in layer order)."""
        modules = [model.get_submodule(name) for name in names]
        widths = []
        for name, module in zip(names, modules, strict=True):
            w = getattr(module, "gate_up_proj", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 3:
                raise ConfigError(
                    f"expert load: {name} ({type(module).__name__}) has no 3-D gate_up_proj "
                    "[experts, 2*inter, hidden]; the model plan's expert_modules (or "
                    "parallel.ep_plan.apply_modules) must name fused experts modules"
                )
            widths.append(int(w.shape[0]))  # the global number of experts (a DTensor's global shape)
        self.names = list(names)
        self.widths = widths
        width = max(widths)
        self.counts = torch.zeros(len(names), width, dtype=torch.float64, device=device)
        #: the experts each layer has (a layer with fewer than the widest has columns that never count)
        self.valid = torch.tensor(
            [[e < w for e in range(width)] for w in widths], dtype=torch.bool, device=device
        )
        self._rows: torch.Tensor | None = None  # the current micro-batch's row weights (1: a real token)
        self._pending = [False] * len(names)  # layers not counted yet in the current micro-batch
        self._groups = self._layer_groups()
        self._handles = [
            module.register_forward_pre_hook(self._hook(i), with_kwargs=True)
            for i, module in enumerate(modules)
        ]
        self._model = model
        self._routers: list[tuple[nn.Module, str]] | None = None

    # --------------------------------------------------------------------------------------------- counting
    def start_step(self) -> None:
        """Zero the counts for a new training step."""
        self.counts.zero_()

    def start_micro_batch(self, row_mask: torch.Tensor | None) -> None:
        """Count the next forward: ``row_mask`` (``[batch, seq]`` or flat, 1 at real tokens; None: every
        row) weights the rows of the tokens each expert module receives."""
        self._rows = None if row_mask is None else row_mask.reshape(-1).to(torch.float64)
        self._pending = [True] * len(self.names)

    def stop(self) -> None:
        """Count nothing until :meth:`start_micro_batch` (after a step's last forward)."""
        self._pending = [False] * len(self.names)
        self._rows = None

    def _hook(self, layer: int) -> Callable[[nn.Module, tuple, dict], None]:
        @torch.compiler.disable
        def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._pending[layer] or not torch.is_grad_enabled():
                return
            self._pending[layer] = False  # a recomputed forward of this micro-batch adds nothing
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if not isinstance(index, torch.Tensor):
                raise TypeError(
                    f"expert load: {self.names[layer]} was called without top_k_index (expected "
                    "experts(hidden_states, top_k_index, top_k_weights), as transformers' MoE blocks call it)"
                )
            index = index.reshape(index.shape[0], -1)
            rows = self._rows
            if rows is None or rows.numel() != index.shape[0]:  # no mask, or rows the mask does not describe
                weights = torch.ones(index.shape, dtype=torch.float64, device=index.device)
            else:
                weights = rows.to(index.device)[:, None].expand(index.shape)
            self.counts[layer].index_add_(0, index.reshape(-1).long(), weights.reshape(-1))

        return count

    # ---------------------------------------------------------------------------------------------- metrics
    def _layer_groups(self) -> list[tuple[str, list[int]]]:
        """``(suffix, MoE-layer positions)``: the whole model (suffix ``""``) and, with more than one MoE
        layer, up to :data:`GROUPS` runs of consecutive layers (``/layers_<a>-<b>``: decoder layer
        indices)."""
        n = len(self.names)
        groups: list[tuple[str, list[int]]] = [("", list(range(n)))]
        if n < 2:
            return groups
        parts = min(GROUPS, n)
        bounds = [round(i * n / parts) for i in range(parts + 1)]
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            first, last = _layer_number(self.names[lo], lo), _layer_number(self.names[hi - 1], hi - 1)
            groups.append((f"/layers_{first}-{last}", list(range(lo, hi))))
        return groups

    def metrics(self, loads: torch.Tensor) -> dict[str, torch.Tensor]:
        """0-dim float64 device tensors from the global ``loads`` ``[layers, experts]`` (the counts summed
        over every rank): ``moe/load_max_over_mean`` (per layer, the busiest expert's tokens over the mean
        expert's, averaged over the layers) and ``moe/dead_experts`` (the share of experts that got no token),
        for the whole model and per group of layers."""
        valid = self.valid
        widths = valid.sum(dim=1, dtype=torch.float64)
        mean = loads.sum(dim=1) / widths
        busiest = torch.where(valid, loads, torch.zeros_like(loads)).amax(dim=1)
        ratio = busiest / mean.clamp(min=1e-12)  # 0 for a layer that got no token at all
        dead = ((loads == 0) & valid).sum(dim=1, dtype=torch.float64)
        out: dict[str, torch.Tensor] = {}
        for suffix, layers in self._groups:
            idx = torch.tensor(layers, device=loads.device)
            out[f"moe/{LOAD_RATIO}{suffix}"] = ratio[idx].mean()
            out[f"moe/{DEAD}{suffix}"] = dead[idx].sum() / widths[idx].sum()
        return out

    # ------------------------------------------------------------------------------------------ router bias
    def check_bias_update(self, rate: float) -> None:
        """Find each MoE layer's router correction bias (a buffer :data:`BIAS` of ``[experts]`` in the layer's
        block, beside its experts module); a positive ``rate`` for a model without them is a ConfigError."""
        if not rate:
            return
        routers: list[tuple[nn.Module, str]] = []
        missing = []
        for name, width in zip(self.names, self.widths, strict=True):
            parent_name, _, child = name.rpartition(".")
            parent = self._model.get_submodule(parent_name)
            found = [
                (buf_name, buf)
                for buf_name, buf in parent.named_buffers()
                if buf_name.rpartition(".")[2] == BIAS
                and not buf_name.startswith(f"{child}.")
                and buf.dim() == 1
                and buf.shape[0] == width
            ]
            if len(found) != 1:
                missing.append(name)
                continue
            owner, _, attr = found[0][0].rpartition(".")
            routers.append((parent.get_submodule(owner) if owner else parent, attr))
        if missing:
            model = type(self._model).__name__
            raise ConfigError(
                f"{RATE_KEY}: got {rate}; {model} has no router correction bias ({BIAS} [experts] beside "
                f"{missing[0]}): the auxiliary-loss-free balancing updates the bias of sigmoid-routed "
                "(DeepSeek-V3-style) routers; for a softmax-routed model set it to 0 and balance with "
                "model.loss_cfg.router_aux_loss_coef"
            )
        self._routers = routers

    def update_bias(self, loads: torch.Tensor, rate: float) -> None:
        """``bias += rate x sign(mean load - load)`` per layer, on the device, from the global ``loads``
        ``[layers, experts]``; call after an applied optimizer step (needs :meth:`check_bias_update`)."""
        if not rate or self._routers is None:
            return
        valid = self.valid
        mean = loads.sum(dim=1, keepdim=True) / valid.sum(dim=1, keepdim=True, dtype=torch.float64)
        step = torch.sign(mean - loads) * rate
        with torch.no_grad():
            for layer, (router, attr) in enumerate(self._routers):
                bias = getattr(router, attr)  # looked up each time: loading a checkpoint may replace it
                bias.add_(step[layer, : bias.shape[0]].to(bias.device, bias.dtype))

    def biases(self) -> list[torch.Tensor]:
        """The routers' correction biases, in layer order (empty without :meth:`check_bias_update`)."""
        return [getattr(router, attr) for router, attr in self._routers or []]


def expert_load_for(
    model: nn.Module, names: Sequence[str], rate: float, device: torch.device
) -> ExpertLoad | None:
    """The load statistics of ``model``'s expert modules ``names`` (the build plan's expert modules), with
    the router bias update of ``rate`` checked; None for a model without expert modules (a positive ``rate``
    is then a ConfigError)."""
    if not names:
        if rate:
            raise ConfigError(
                f"{RATE_KEY}: got {rate}; {type(model).__name__} has no mixture-of-experts layers (no expert "
                "modules in its plan or parallel.ep_plan.apply_modules); set it to 0"
            )
        return None
    load = ExpertLoad(model, names, device)
    load.check_bias_update(rate)
    return load
