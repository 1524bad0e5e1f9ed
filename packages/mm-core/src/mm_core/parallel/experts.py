"""Expert parallelism from the YAML: ``parallel.expert_parallel_size`` and ``parallel.ep_plan``.

The expert modules named by ``parallel.ep_plan.apply_modules`` (or the model's default
``ModelPlan.expert_modules``) are replaced, in the model's own module tree, by mm-parallel's
:class:`ExpertParallelExperts` (or the ``ModelPlan.expert_adapter`` subclass of it): experts split over the
``ep`` dimension of
``ParallelState.expert_mesh`` and FSDP2-sharded over ``efsdp`` (x ``dp_replicate``). Also here: the router
load-balancing loss added to the training loss (``model.loss_cfg.router_aux_loss_coef``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mm_core.config.schema import EPPlan, LossConfig, ParallelConfig
from mm_core.errors import ConfigError
from mm_core.models.facts import text_config_of
from mm_core.models.plan import ModelPlan, plan_of
from mm_core.parallel.matching import ModuleMatches
from mm_core.parallel.state import ParallelSizes, ParallelState
from mm_parallel.moe import ExpertParallelExperts, load_balancing_loss, shard_experts, swap_experts

KEY = "parallel.ep_plan.apply_modules"
EFSDP_KEY = "parallel.ep_plan.apply_efsdp_modules"


def expert_modules(
    model: nn.Module, parallel: ParallelConfig, plan: ModelPlan, sizes: ParallelSizes, match: ModuleMatches
) -> tuple[list[str], str]:
    """Names of the modules that become expert-parallel (empty when EP is off), checked against ``sizes``,
    and where their patterns came from (``parallel.ep_plan.apply_modules``, or the model's default plan)."""
    ep_plan = parallel.ep_plan
    if ep_plan.apply_modules:
        patterns, source = list(ep_plan.apply_modules), KEY
    else:
        patterns, source = list(plan.expert_modules), f"default ep plan of {type(model).__name__}"
    ep = sizes.ep
    if ep == 1 and not ep_plan.apply_modules:
        check_efsdp_modules(ep_plan, [], ep, match)
        return [], source
    if not patterns:
        raise ConfigError(
            f"parallel.expert_parallel_size: got {ep}; {type(model).__name__} declares no default expert "
            f"plan (ModelPlan.expert_modules), so set {KEY} to its fused experts modules "
            "(e.g. model.layers.{*}.mlp.experts)"
        )
    names = list(match.select(patterns, source))
    for name in names:
        module = model.get_submodule(name)
        w = getattr(module, "gate_up_proj", None)
        if not isinstance(w, torch.Tensor) or w.ndim != 3 or not hasattr(module, "down_proj"):
            raise ConfigError(
                f"{source}: {name} ({type(module).__name__}) is not a fused experts module with 3-D "
                "gate_up_proj [experts, 2*inter, hidden] and down_proj weights; match the experts module "
                "itself (e.g. model.layers.{*}.mlp.experts), not its parent block"
            )
        if w.shape[0] % ep:
            raise ConfigError(
                f"parallel.expert_parallel_size: got {ep}; {name} has {w.shape[0]} experts, which must split "
                f"evenly (accepted: divisors of {w.shape[0]} that divide {sizes.fsdp})"
            )
    check_efsdp_modules(ep_plan, names, ep, match)
    return names, source


def check_efsdp_modules(ep_plan: EPPlan, names: list[str], ep: int, match: ModuleMatches) -> None:
    """``parallel.ep_plan.apply_efsdp_modules`` names the expert modules that are FSDP2-sharded over the
    expert-data-parallel mesh (``efsdp``). In mm that is every expert-parallel module (the default when the
    key is empty), so the key is accepted when it matches exactly the expert-parallel modules: an expert
    module left out would hold its weights replicated over ``efsdp`` with no FSDP unit to reduce their
    gradients, and a module outside the expert set has no ``efsdp`` mesh to be sharded over."""
    patterns = ep_plan.apply_efsdp_modules
    if not patterns:
        return
    if not names or ep == 1:
        raise ConfigError(
            f"{EFSDP_KEY}: got {patterns}, but expert parallelism is off (parallel.expert_parallel_size: "
            "1), so there is no expert-data-parallel mesh; remove the key or set expert_parallel_size"
        )
    wanted = set(match.select(list(patterns), EFSDP_KEY))
    outside = sorted(wanted - set(names))
    if outside:
        raise ConfigError(
            f"{EFSDP_KEY}: {outside[0]} is not an expert-parallel module (ep_plan.apply_modules); only "
            "expert modules have an expert-data-parallel (efsdp) mesh to be sharded over; other modules are "
            "sharded by parallel.fsdp_plan.apply_modules"
        )
    left_out = [n for n in names if n not in wanted]
    if left_out:
        more = f" (and {len(left_out) - 1} more)" if len(left_out) > 1 else ""
        raise ConfigError(
            f"{EFSDP_KEY}: {left_out[0]}{more} is expert-parallel but not listed; mm shards every "
            "expert-parallel module over efsdp (an unsharded one would have no FSDP unit to reduce its "
            "gradients), so list them all (the same patterns as ep_plan.apply_modules) or remove the key"
        )


def apply_expert_parallel(
    model: nn.Module,
    names: Sequence[str],
    plan: ModelPlan,
    dispatcher: str,
    state: ParallelState,
    **fully_shard_kwargs: Any,
) -> list[str]:
    """Swap the expert modules ``names`` for the expert-parallel adapter (``plan.expert_adapter``) and, with
    ``ep > 1``, FSDP2-shard them over the expert mesh. Call before the other FSDP units are wrapped. Returns
    the adapted module names."""
    if not names:
        return []
    sizes = state.sizes
    mesh = state.expert_mesh  # (dp_replicate, efsdp, ep); init_parallel_state builds it whenever ep > 1
    if sizes.ep > 1 and mesh is None:
        raise ValueError("expert parallelism (ep > 1) needs ParallelState.expert_mesh")
    ep_mesh = mesh["ep"] if mesh is not None and sizes.ep > 1 else None
    adapter = plan.expert_adapter or ExpertParallelExperts
    swapped = swap_experts(model, list(names), ep_mesh, adapter=adapter, dispatcher=dispatcher)
    if mesh is not None and sizes.ep > 1:
        fsdp_mesh = mesh["dp_replicate", "efsdp"] if sizes.dp_replicate > 1 else mesh["efsdp"]
        # the loss is scaled for an average over every rank (see Trainer.train_step): divide expert
        # gradients by the same number, although FSDP reduces them over only world / ep ranks
        shard_experts(list(swapped.values()), fsdp_mesh, sizes.world_size, **fully_shard_kwargs)
    return list(names)


def expert_layout(model: nn.Module, names: Sequence[str], sizes: ParallelSizes) -> list[str]:
    """Lines for ``mm check``: which experts each ep rank computes and which global ranks those are."""
    modules = dict(model.named_modules())
    counts = sorted({int(modules[n].gate_up_proj.shape[0]) for n in names})
    lines = []
    for num in counts:
        per = num // sizes.ep
        for j in range(sizes.ep):
            ranks = [r for r in range(sizes.world_size) if r % sizes.ep == j]
            shown = ", ".join(map(str, ranks[:8])) + (" ..." if len(ranks) > 8 else "")
            lines.append(
                f"  ep rank {j}: experts {j * per}-{(j + 1) * per - 1} of {num}  (global ranks {shown})"
            )
    return lines


@dataclass(frozen=True)
class RouterAux:
    """The router load-balancing loss of a mixture-of-experts model, over the global micro-batch."""

    num_experts: int
    top_k: int
    coef: float

    def __call__(
        self, router_logits: Sequence[torch.Tensor], attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(share, value)`` of :func:`mm_parallel.moe.load_balancing_loss`, reduced over every rank (the
        data- and context-parallel ranks of one micro-step). Padding rows (attention mask 0) are left out."""
        rows = router_logits[0].shape[0]
        mask = attention_mask
        if mask is not None and mask.numel() != rows:
            if bool(mask.all()):
                mask = None
            else:
                raise ConfigError(
                    f"model.loss_cfg.router_aux_loss_coef: the attention mask has {mask.numel()} entries for "
                    f"{rows} router rows on this rank, so padding cannot be left out of the router loss; "
                    "pack the data without padding or set router_aux_loss_coef: 0"
                )
        group = dist.group.WORLD if dist.is_initialized() else None
        return load_balancing_loss(list(router_logits), self.num_experts, self.top_k, mask, group)


def router_aux_for(model: nn.Module, loss_cfg: LossConfig, plan: ModelPlan | None = None) -> RouterAux | None:
    """The router loss of a model whose config (or its ``text_config``) has ``num_experts`` and
    ``num_experts_per_tok``, else None. A non-zero coefficient is refused for a model whose plan (``plan``,
    else the model's own) gives ``ModelPlan.router_loss_refusal`` (routing that mm's softmax load-balancing
    loss does not describe)."""
    coef = loss_cfg.router_aux_loss_coef
    refusal = (plan if plan is not None else plan_of(model)).router_loss_refusal
    if coef and refusal:
        raise ConfigError(
            f"model.loss_cfg.router_aux_loss_coef: got {coef}; {type(model).__name__} {refusal}, which mm's "
            "softmax load-balancing loss does not describe; set it to 0"
        )
    # a vision-language model keeps its language model's settings in its text config
    text = text_config_of(model)
    num_experts = getattr(text, "num_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    if not num_experts or not top_k:
        if coef:
            raise ConfigError(
                f"model.loss_cfg.router_aux_loss_coef: got {coef}; {type(model).__name__} has no router "
                "(no num_experts / num_experts_per_tok in its config); set it to 0"
            )
        return None
    if loss_cfg.loss_type == "raw":
        if coef:
            raise ConfigError(
                f"model.loss_cfg.router_aux_loss_coef: got {coef} with loss_type raw, which uses the model's "
                "own .loss as is; use loss_type per_token_loss (or default) to add the router loss"
            )
        return None
    return RouterAux(int(num_experts), int(top_k), float(coef))
