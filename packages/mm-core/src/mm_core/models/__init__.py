"""Models: the custom-model contract and the hub that builds any registered model."""

from mm_core.models.base import BaseModel, ModelArguments, ModelPlans
from mm_core.models.hub import ModelHub

__all__ = ["BaseModel", "ModelArguments", "ModelHub", "ModelPlans"]
