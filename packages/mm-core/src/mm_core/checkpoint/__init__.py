"""DCP checkpoints: atomic ``step_<N>`` folders, a ``latest`` marker, resume and weights-only loads."""

from mm_core.checkpoint.dcp_io import (
    CONFIG_FILE,
    ModelParts,
    ModelState,
    TrainingState,
    TrainProgress,
    load_checkpoint,
    save_checkpoint,
)
from mm_core.checkpoint.layout import read_latest, resolve_load_path
from mm_core.checkpoint.rng import RNGState, set_deterministic
from mm_core.checkpoint.saver import CheckpointSaver

__all__ = [
    "CONFIG_FILE",
    "CheckpointSaver",
    "ModelParts",
    "ModelState",
    "RNGState",
    "TrainProgress",
    "TrainingState",
    "load_checkpoint",
    "read_latest",
    "resolve_load_path",
    "save_checkpoint",
    "set_deterministic",
]
