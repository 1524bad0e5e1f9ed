"""The contract a custom (non-Hugging-Face) model implements; default plans: :mod:`mm_core.models.plan`."""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import nn

from mm_core.config.schema import ModelConfig

#: The ``model`` block of the YAML, as passed to custom models (name kept from MindSpeed-MM).
ModelArguments = ModelConfig


class BaseModel(ABC):
    """A custom model: ``class MyModel(torch.nn.Module, BaseModel)``; default plans go in
    ``mm_plan: ClassVar[ModelPlan] = ModelPlan(...)`` (see :class:`~mm_core.models.plan.ModelPlan`).

    ``forward(**batch)`` receives the collated batch (plus keyword arguments such as ``use_cache``) and
    returns an object with ``.loss`` (and ``.logits`` when mm computes the loss, see ``model.loss_cfg``).
    """

    @classmethod
    @abstractmethod
    def _from_config(cls, args: ModelArguments) -> nn.Module:
        """Build the complete module structure from the config (used under the meta device)."""

    @classmethod
    @abstractmethod
    def from_pretrained(cls, args: ModelArguments) -> nn.Module:
        """Build the model and load its weights (from ``args.model_name_or_path`` or custom fields)."""

    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place (after meta-device build). Default:
        ``reset_parameters()`` on each submodule that has it."""
        for module in self.modules():  # type: ignore[attr-defined]
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
