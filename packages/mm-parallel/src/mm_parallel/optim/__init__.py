"""Optimizers for FSDP2/DTensor parameters: a distributed Muon with built-in AdamW groups."""

from .muon import Muon
from .newton_schulz import adjust_lr, zeropower_via_newtonschulz
from .param_groups import (
    MuonParamPlan,
    ParamDecision,
    classify_muon_params,
    muon_param_groups,
)
from .stats import MuonStepStats

__all__ = [
    "Muon",
    "MuonParamPlan",
    "MuonStepStats",
    "ParamDecision",
    "adjust_lr",
    "classify_muon_params",
    "muon_param_groups",
    "zeropower_via_newtonschulz",
]
