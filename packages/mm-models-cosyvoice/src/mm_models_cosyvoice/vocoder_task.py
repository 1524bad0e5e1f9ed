"""``training.task: cosyvoice_vocoder``: CosyVoice3's HiFT vocoder trained against its discriminators.

Two models, two optimizers, stepped in turn every step (the official GAN loop):

1. **discriminator**: the generator synthesises each micro-batch's waves without gradients; the
   discriminator scores the real crops and the (detached) fakes; its loss is least-squares GAN + TPR
   (:mod:`mm_models_cosyvoice.vocoder_losses`); its gradients are clipped, its optimizer and lr schedule
   step;
2. **generator**: it synthesises again (fresh noise), the discriminator scores real and fake, and the
   generator's loss is ``adv + feature_weight · fm + mel_weight · mel + tpr_weight · tpr + f0_weight · f0``
   (official weights 1, 2, 45, 1, 1); its gradients are clipped, its optimizer and schedule step; the
   discriminator's gradients from this pass are dropped.

The generator is the YAML's ``model:`` (``model_id: cosyvoice3_hift``, e.g. ``model_name_or_path`` a folder
with the official ``hift.pt``); the discriminator (``cosyvoice3_hift_disc``) is built from scratch. Both are
built through :func:`mm_core.tasks.build_model`, so each is FSDP-sharded by its plan, and both are in every
checkpoint (the discriminator as ``discriminator.*``, ``optimizer_discriminator``,
``scheduler_discriminator``). Data: the ``cosyvoice_speech`` dataset with ``stage: vocoder`` and the
``cosyvoice_vocoder`` collator (``audio`` [B, L], ``mel`` [B, T, 80], ``noise_seed``); every sample of a
micro-batch must have the same length (``segment_samples``, the default, crops them so).

**Pitch target.** The official recipe trains the pitch predictor on pyworld F0 computed by its data
pipeline. A batch field ``f0`` [B, T] (Hz) is used when a collator provides it; otherwise, with
``f0_target: estimate`` (the default), the task estimates F0 from the real crop with YIN
(:mod:`mm_models_cosyvoice.pitch`). With ``f0_target: none`` there is no pitch loss, and the pitch predictor
must be frozen (``model.freeze: [f0_predictor]``: nothing else trains it), e.g. to fine-tune the official
vocoder with its own pitch predictor kept as it is.

**Exactness.** The generator's noise is drawn per sample from its ``noise_seed`` (a different stream for
each turn), and every loss is a mean over samples (TPR per sample, see
:mod:`mm_models_cosyvoice.vocoder_losses`), so with equal micro-batch sizes per rank FSDP's averaged
gradient is the global batch's: 1 or N ranks train the same models, and a resume continues exactly.

**Clipping and non-finite steps** (mm's :class:`~mm_core.tasks.TaskToolkit`). Each turn clips its own
model's gradients to ``training.clip_grad`` (global norm over the sharded parameters). The official loop
clips over both models' parameters; in the generator turn that norm also counts the discriminator gradients
it then discards, here it does not. A turn whose gradient norm is not finite skips that update and its lr
step (counted against ``training.skip_nonfinite_steps``, else the run stops), as the official loop skips it.

``training.task_param`` (unknown keys are errors): ``discriminator`` (its ``config_overrides``, see
:class:`~mm_models_cosyvoice.discriminator.DiscriminatorConfig`), ``discriminator_lr`` (default
``training.lr``), ``mel_weight`` (45), ``feature_weight`` (2), ``tpr_weight`` (1), ``tpr_tau`` (0.04),
``f0_weight`` (1), ``f0_target`` (``estimate`` | ``none``). Metrics: ``loss`` (the generator's total),
``loss_adv``, ``loss_fm``, ``loss_mel``, ``loss_tpr``, ``loss_f0`` (when on), ``loss_disc``, ``grad_norm``,
``grad_norm_discriminator``, ``lr``, ``lr_discriminator``: means over ranks and micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mm_core.config.schema import MMConfig, ModelConfig
from mm_core.data import move_to_device
from mm_core.errors import ConfigError, DataError
from mm_core.models.plan import plan_of
from mm_core.optim import build_optimizer, build_scheduler
from mm_core.tasks import MAIN, StepResult, Task, TaskParts, TaskToolkit, build_model

from . import vocoder_losses as losses
from .discriminator import DiscriminatorConfig
from .hift import HiFTGenerator
from .pitch import estimate_f0

DISCRIMINATOR = "discriminator"
DISCRIMINATOR_MODEL_ID = "cosyvoice3_hift_disc"
#: default weights (the official train_conf_gan)
WEIGHTS = {"mel_weight": 45.0, "feature_weight": 2.0, "tpr_weight": 1.0, "tpr_tau": 0.04, "f0_weight": 1.0}
F0_TARGETS = ("estimate", "none")
KEYS = ("discriminator", "discriminator_lr", *WEIGHTS, "f0_target")
#: XOR-ed into a sample's noise_seed for the generator turn (the discriminator turn uses the seed itself)
GENERATOR_STREAM = 0x9E3779B97F4A7C15 & (2**63 - 1)
_SEED_MASK = 2**63 - 1


@dataclass
class _MicroBatch:
    audio: torch.Tensor  # [B, L]
    mel: torch.Tensor  # [B, T, 80]
    seeds: list[int]
    f0: torch.Tensor | None  # [B, T] from the batch, or None


def _number(param: dict[str, Any], key: str, default: float) -> float:
    value = param.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"training.task_param.{key}: got {value!r}; expected a number >= 0")
    return float(value)


class CosyVoiceVocoderTask(Task):
    """The HiFT generator against its discriminators (module docstring)."""

    # ------------------------------------------------------------------------------------------ build
    @classmethod
    def model_blocks(cls, cfg: MMConfig) -> dict[str, ModelConfig | None]:
        """The generator (the YAML's ``model:``) and the discriminator (``training.task_param.discriminator``:
        its config_overrides)."""
        overrides = cfg.training.task_param.get(DISCRIMINATOR) or {}
        if not isinstance(overrides, dict):
            raise ConfigError(
                f"training.task_param.{DISCRIMINATOR}: got {overrides!r}; expected a mapping of the "
                "discriminator's config_overrides"
            )
        DiscriminatorConfig.from_overrides(overrides, f"training.task_param.{DISCRIMINATOR}")
        disc = ModelConfig(model_id=DISCRIMINATOR_MODEL_ID, from_scratch=True, config_overrides=overrides)
        return {MAIN: None, DISCRIMINATOR: disc}

    def build(self) -> TaskParts:
        param = self.ctx.param
        unknown = sorted(set(param) - set(KEYS))
        if unknown:
            raise ConfigError(f"training.task_param.{unknown[0]}: unknown key; accepted: {', '.join(KEYS)}")
        tcfg = self.ctx.cfg.training
        self.weights = {k: _number(param, k, v) for k, v in WEIGHTS.items()}
        self.f0_target = param.get("f0_target", "estimate")
        if self.f0_target not in F0_TARGETS:
            raise ConfigError(
                f"training.task_param.f0_target: got {self.f0_target!r}; accepted: {', '.join(F0_TARGETS)}"
            )
        disc_cfg = self.model_blocks(self.ctx.cfg)[DISCRIMINATOR]
        disc_lr = _number(param, "discriminator_lr", tcfg.lr)

        self.generator = build_model(self.ctx).model
        if not isinstance(self.generator, HiFTGenerator):
            raise ConfigError(
                f"model.model_id: the cosyvoice_vocoder task trains the HiFT generator (cosyvoice3_hift), "
                f"got {self.ctx.cfg.model.model_id!r} ({type(self.generator).__name__})"
            )
        self.hop = self.generator.config.hop_length
        self._check_f0_predictor()
        self.disc = build_model(self.ctx, disc_cfg).model

        disc_training = tcfg.model_copy(update={"lr": disc_lr})
        built = build_optimizer(self.generator, tcfg, plan_of(self.generator))
        built_d = build_optimizer(self.disc, disc_training, plan_of(self.disc))
        self.opt, self.scale_only = built.optimizer, built.clip_scale_only
        self.opt_d, self.scale_only_d = built_d.optimizer, built_d.clip_scale_only
        self.sched = build_scheduler(self.opt, tcfg)
        self.sched_d = build_scheduler(self.opt_d, disc_training)
        self.toolkit = TaskToolkit(self.ctx, [self.generator, self.disc])
        return TaskParts(
            {MAIN: self.generator, DISCRIMINATOR: self.disc},
            {MAIN: self.opt, DISCRIMINATOR: self.opt_d},
            {MAIN: self.sched, DISCRIMINATOR: self.sched_d},
        )

    def _check_f0_predictor(self) -> None:
        """Without a pitch loss nothing trains the pitch predictor: it must be frozen (module docstring)."""
        trainable = [
            n for n, p in self.generator.named_parameters() if p.requires_grad and "f0_predictor" in n
        ]
        off = self.f0_target == "none" or self.weights["f0_weight"] == 0
        if off and trainable:
            raise ConfigError(
                "training.task_param.f0_target: without a pitch loss (f0_target: none or f0_weight: 0) "
                f"nothing trains the pitch predictor ({trainable[0]}, ...); freeze it with model.freeze: "
                "[f0_predictor], or use f0_target: estimate"
            )
        self.f0_on = not off

    # ------------------------------------------------------------------------------------------ hooks
    def after_load(self, path: Path, report: Any) -> None:
        self.toolkit.after_load()

    def before_save(self, step: int) -> None:
        self.toolkit.before_save(step)

    # ------------------------------------------------------------------------------------------- step
    def _prepare(self, batch: dict[str, Any]) -> _MicroBatch:
        """The micro-batch on the device, checked: equal lengths, ``L = 480 · T``."""
        missing = [k for k in ("audio", "mel", "noise_seed") if k not in batch]
        if missing:
            raise DataError(
                f"the batch has no {', '.join(repr(k) for k in missing)} (fields: {', '.join(batch)}); the "
                "cosyvoice_vocoder task trains on the cosyvoice_vocoder collator's batches (dataset "
                "cosyvoice_speech, stage: vocoder)"
            )
        batch = move_to_device(batch, self.ctx.device, None)
        audio, mel = batch["audio"], batch["mel"]
        hop = self.hop
        if audio.dim() != 2 or mel.dim() != 3 or audio.shape[1] != hop * mel.shape[1]:
            raise DataError(
                f"audio {tuple(audio.shape)} and mel {tuple(mel.shape)}: expected [B, {hop}·T] and [B, T, 80]"
            )
        for key, full in (("audio_lengths", audio.shape[1]), ("mel_lengths", mel.shape[1])):
            lengths = batch.get(key)
            if isinstance(lengths, torch.Tensor) and bool((lengths != full).any()):
                raise DataError(
                    f"{key}: {lengths.tolist()}: the samples of a micro-batch have different lengths; the "
                    "vocoder trains on equal crops (data.dataset_param.basic_parameters.segment_samples) or "
                    "training.micro_batch_size: 1"
                )
        f0 = batch.get("f0")
        if f0 is not None and (not isinstance(f0, torch.Tensor) or tuple(f0.shape) != tuple(mel.shape[:2])):
            shape = tuple(f0.shape) if isinstance(f0, torch.Tensor) else type(f0).__name__
            raise DataError(f"f0: expected [B, T] = {tuple(mel.shape[:2])} (Hz per mel frame), got {shape}")
        return _MicroBatch(audio.float(), mel, [int(s) for s in batch["noise_seed"]], f0)

    def train_step(self, micro_batches: list[dict[str, Any]], *, log_memory: bool = False) -> StepResult:
        n = len(micro_batches)
        step = self.ctx.progress.step + 1
        batches = [self._prepare(b) for b in micro_batches]
        w = self.weights
        zero = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        lr, lr_d = self.opt.param_groups[0]["lr"], self.opt_d.param_groups[0]["lr"]

        # (1) the discriminator, on detached fakes
        loss_disc = zero
        for b in batches:
            with torch.no_grad():
                fake = self.generator(speech_feat=b.mel, noise_seed=b.seeds).waveform
            out = self.disc(waveform=torch.cat([b.audio, fake.float()]))
            real_s, fake_s = zip(*(s.chunk(2) for s in out.scores))
            loss_d = losses.discriminator_adversarial(real_s, fake_s)
            loss_d = loss_d + w["tpr_weight"] * losses.tpr(real_s, fake_s, w["tpr_tau"])
            (loss_d / n).backward()
            loss_disc = loss_disc + loss_d.detach().double() / n
        norm_d = float(self.toolkit.clip(self.disc, self.scale_only_d))
        self.toolkit.update(self.opt_d, self.sched_d, step=step, grad_norm=norm_d)

        # (2) the generator, against the updated discriminator
        parts = {k: zero for k in ("loss", "loss_adv", "loss_fm", "loss_mel", "loss_tpr", "loss_f0")}
        for b in batches:
            seeds = [(s ^ GENERATOR_STREAM) & _SEED_MASK for s in b.seeds]
            gen = self.generator(speech_feat=b.mel, noise_seed=seeds)
            fake = gen.waveform.float()
            out = self.disc(waveform=torch.cat([b.audio, fake]))
            real_s, fake_s = zip(*(s.chunk(2) for s in out.scores))
            real_f = [[f.chunk(2)[0] for f in fmap] for fmap in out.features]
            fake_f = [[f.chunk(2)[1] for f in fmap] for fmap in out.features]
            values = {
                "loss_adv": losses.generator_adversarial(fake_s),
                "loss_fm": losses.feature_matching(real_f, fake_f),
                "loss_mel": losses.mel_l1(b.audio, fake),
                "loss_tpr": losses.tpr(fake_s, real_s, w["tpr_tau"]),
            }
            total = (
                values["loss_adv"]
                + w["feature_weight"] * values["loss_fm"]
                + w["mel_weight"] * values["loss_mel"]
                + w["tpr_weight"] * values["loss_tpr"]
            )
            if self.f0_on:
                target = b.f0 if b.f0 is not None else estimate_f0(b.audio)
                values["loss_f0"] = losses.f0_l1(gen.f0, target)
                total = total + w["f0_weight"] * values["loss_f0"]
            (total / n).backward()
            values["loss"] = total
            for k, v in values.items():
                parts[k] = parts[k] + v.detach().double() / n
        norm = float(self.toolkit.clip(self.generator, self.scale_only))
        self.toolkit.update(self.opt, self.sched, step=step, grad_norm=norm)
        self.opt_d.zero_grad(set_to_none=True)  # the discriminator's gradients of pass (2)

        if not self.f0_on:
            del parts["loss_f0"]
        ws = self.ctx.state.sizes.world_size
        reduced = self.ctx.reduce({**parts, "loss_disc": loss_disc})
        metrics: dict[str, float] = {k: v / ws for k, v in reduced.sums.items()}
        metrics["grad_norm"] = norm
        metrics["grad_norm_discriminator"] = norm_d
        metrics["lr"] = lr
        metrics["lr_discriminator"] = lr_d
        metrics.update(self.toolkit.nonfinite_metrics())
        return StepResult(metrics, stop=reduced.stop)
