"""``lm_gan``: a task with two models and two optimizers, stepped in turn (as a GAN vocoder trains).

Each step, for the micro-batches of the step: (1) the critic learns to score real next tokens (one-hot) 1
and the model's predicted distributions (detached) 0, least squares; its optimizer steps. (2) The model
learns cross-entropy plus ``adversarial_weight`` times the least-squares term that pushes the critic's
scores of its predictions to 1; its optimizer steps (the critic's gradients from this pass are dropped).
Losses are means over this rank's tokens; FSDP averages the gradients over ranks, so with equal micro-batch
sizes every layout trains the same models.

``training.task_param``: ``critic`` (the critic's ``config_overrides``), ``critic_lr`` (its learning rate;
the model uses ``training.lr``), ``adversarial_weight``.

Clipping, the non-finite policy and the checks after a load and before a save are mm's
(:class:`mm_core.tasks.TaskToolkit`); the step returns its metrics and the stop agreement of its one
collective (:meth:`TaskContext.reduce`) as a :class:`mm_core.tasks.StepResult`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mm_core.config.schema import MMConfig, ModelConfig
from mm_core.data import move_to_device
from mm_core.errors import ConfigError
from mm_core.optim import build_optimizer, build_scheduler
from mm_core.tasks import MAIN, StepResult, Task, TaskParts, TaskToolkit, build_model

CRITIC = "critic"
KEYS = ("critic", "critic_lr", "adversarial_weight")


class LMGanTask(Task):
    """The model against a critic (module docstring)."""

    @classmethod
    def model_blocks(cls, cfg: MMConfig) -> dict[str, ModelConfig | None]:
        """The model (the YAML's ``model:``) and the critic (``training.task_param.critic``: overrides)."""
        param = cfg.training.task_param
        unknown = sorted(set(param) - set(KEYS))
        if unknown:
            raise ConfigError(f"training.task_param.{unknown[0]}: unknown key; accepted: {', '.join(KEYS)}")
        critic = ModelConfig(
            model_id="tiny_gan_critic", from_scratch=True, config_overrides=param.get(CRITIC, {})
        )
        return {MAIN: None, CRITIC: critic}

    def build(self) -> TaskParts:
        blocks = self.model_blocks(self.ctx.cfg)
        param = self.ctx.param
        tcfg = self.ctx.cfg.training
        self.weight = float(param.get("adversarial_weight", 0.1))
        built, built_critic = build_model(self.ctx), build_model(self.ctx, blocks[CRITIC])
        self.model, self.critic = built.model, built_critic.model
        critic_training = tcfg.model_copy(update={"lr": float(param.get("critic_lr", tcfg.lr))})
        self.opt = build_optimizer(self.model, tcfg, built.plan.model_plan).optimizer
        self.opt_critic = build_optimizer(
            self.critic, critic_training, built_critic.plan.model_plan
        ).optimizer
        self.sched = build_scheduler(self.opt, tcfg)
        self.sched_critic = build_scheduler(self.opt_critic, critic_training)
        self.toolkit = TaskToolkit(self.ctx, [self.model, self.critic])
        return TaskParts(
            {MAIN: self.model, CRITIC: self.critic},
            {MAIN: self.opt, CRITIC: self.opt_critic},
            {MAIN: self.sched, CRITIC: self.sched_critic},
        )

    def after_load(self, path: Path, report: Any) -> None:
        self.toolkit.after_load()

    def before_save(self, step: int) -> None:
        self.toolkit.before_save(step)

    def train_step(self, micro_batches: list[dict[str, Any]], *, log_memory: bool = False) -> StepResult:
        n = len(micro_batches)
        step = self.ctx.progress.step + 1
        batches = [move_to_device(b, self.ctx.device, None) for b in micro_batches]
        vocab = self.model.head.out_features
        # (1) the critic, on the model's current predictions
        critic_loss = torch.zeros((), device=self.ctx.device)
        for batch in batches:
            with torch.no_grad():
                fake = self.model(input_ids=batch["input_ids"]).logits[:, :-1].softmax(-1)
            real = F.one_hot(batch["input_ids"][:, 1:], vocab).float()
            scores_real, scores_fake = self.critic(torch.cat([real, fake])).chunk(2)  # one forward
            loss_d = ((scores_real - 1) ** 2).mean() + (scores_fake**2).mean()
            (loss_d / n).backward()
            critic_loss = critic_loss + loss_d.detach() / n
        critic_norm = float(self.toolkit.clip(self.critic))
        self.toolkit.update(self.opt_critic, self.sched_critic, step=step, grad_norm=critic_norm)
        # (2) the model: cross-entropy plus the adversarial term
        ce_total = torch.zeros((), device=self.ctx.device)
        adv_total = torch.zeros((), device=self.ctx.device)
        for batch in batches:
            logits = self.model(input_ids=batch["input_ids"]).logits[:, :-1]
            labels = batch["labels"][:, 1:]
            ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
            adv = ((self.critic(logits.softmax(-1)) - 1) ** 2).mean()
            ((ce + self.weight * adv) / n).backward()
            ce_total, adv_total = ce_total + ce.detach() / n, adv_total + adv.detach() / n
        model_norm = float(self.toolkit.clip(self.model))
        self.toolkit.update(self.opt, self.sched, step=step, grad_norm=model_norm)
        self.opt_critic.zero_grad(set_to_none=True)  # the critic's gradients of pass (2)
        ws = self.ctx.state.sizes.world_size
        reduced = self.ctx.reduce({"loss": ce_total, "loss_adv": adv_total, "loss_critic": critic_loss})
        metrics = {k: v / ws for k, v in reduced.sums.items()}
        metrics["grad_norm"] = model_norm
        metrics["grad_norm_critic"] = critic_norm
        metrics["lr"] = self.opt.param_groups[0]["lr"]
        metrics["lr_critic"] = self.opt_critic.param_groups[0]["lr"]
        return StepResult(metrics, stop=reduced.stop)
