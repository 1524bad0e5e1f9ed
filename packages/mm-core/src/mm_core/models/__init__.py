"""Models: the custom-model contract, the model-plan contract and the hub that builds any registered model."""

from mm_core.models.base import BaseModel, ModelArguments
from mm_core.models.experts import TransformersExperts
from mm_core.models.hub import ModelHub
from mm_core.models.plan import ModelPlan, init_expert_adapters, plan_of

__all__ = [
    "BaseModel",
    "ModelArguments",
    "ModelHub",
    "ModelPlan",
    "TransformersExperts",
    "init_expert_adapters",
    "plan_of",
]
