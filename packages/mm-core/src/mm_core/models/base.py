"""The contract a custom (non-Hugging-Face) model implements, and the default plans any model may supply."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from torch import nn

from mm_core.config.schema import ModelConfig

#: The ``model`` block of the YAML, as passed to custom models (name kept from MindSpeed-MM).
ModelArguments = ModelConfig


class ModelPlans:
    """Default plans a model class may declare, so a user's YAML can omit them.

    Hugging Face model classes registered with mm (e.g. a subclass of ``Qwen3ForCausalLM``) and custom
    :class:`BaseModel` classes both use these class attributes. Patterns use the syntax of
    ``parallel.fsdp_plan.apply_modules``.
    """

    #: modules wrapped as their own FSDP units before the root
    mm_fsdp_modules: ClassVar[list[str]] = []
    #: modules whose activations are recomputed in backward when ``model.recompute`` is on
    mm_recompute_modules: ClassVar[list[str]] = []
    #: expert modules split over the expert-parallel mesh
    mm_ep_modules: ClassVar[list[str]] = []
    #: modules whose weights must not take Muon even if 2-D (e.g. routers)
    mm_muon_exclude_modules: ClassVar[list[str]] = []
    #: context parallelism for models with other towers (vision): the module whose inputs are the whole
    #: sequence after the towers' features are merged and positions computed (e.g. the language model); mm
    #: splits the sequence at its input. None: the batch is split before the model (text decoders only).
    mm_context_parallel_module: ClassVar[str | None] = None
    #: inputs of that module holding one row per True of a ``[batch, seq]`` mask input (value: the mask's
    #: name), e.g. features added at the image tokens; mm keeps the rows of this rank's tokens
    mm_context_parallel_packed: ClassVar[dict[str, str]] = {}


class BaseModel(ModelPlans, ABC):
    """A custom model: ``class MyModel(torch.nn.Module, BaseModel)``.

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
