"""Every random state of a rank (python, numpy, torch CPU, accelerator) as plain tensors, for DCP."""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch


class RNGState:
    """A DCP ``Stateful`` for this rank's random generators (no pickled objects: tensors only)."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.seed = seed

    def reseed(self, step: int, rank: int) -> None:
        """Fresh generators for a rank that has no saved state (elastic resume onto more ranks): seeded from
        ``(seed, step, rank)``, so the same resume is reproducible."""
        seed = (self.seed * 1_000_003 + step * 1_009 + rank) % (2**32)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # CPU and every accelerator device

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        # numpy's stub types the default (legacy=True) result as the dict form; it is the MT19937 tuple
        np_state = cast("tuple[str, npt.NDArray[np.uint32], int, int, float]", np.random.get_state())
        state = {
            "python_version": torch.tensor(version, dtype=torch.int64),
            "python_state": torch.tensor(internal, dtype=torch.int64),
            "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
            "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "numpy_rest": torch.tensor([np_state[2], np_state[3], np_state[4]], dtype=torch.float64),
            "torch_cpu": torch.get_rng_state(),
        }
        if self.device.type in ("cuda", "npu"):
            state["torch_device"] = getattr(torch, self.device.type).get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        gauss_flag, gauss = state["python_gauss"].tolist()
        random.setstate(
            (
                int(state["python_version"]),
                tuple(int(x) for x in state["python_state"].tolist()),
                gauss if gauss_flag else None,
            )
        )
        pos, has_gauss, cached = state["numpy_rest"].tolist()
        np.random.set_state(
            (
                "MT19937",
                state["numpy_keys"].numpy().astype(np.uint32),
                int(pos),
                int(has_gauss),
                float(cached),
            )
        )
        torch.set_rng_state(state["torch_cpu"].cpu())
        if "torch_device" in state and self.device.type in ("cuda", "npu"):
            getattr(torch, self.device.type).set_rng_state(state["torch_device"].cpu(), self.device)


def set_deterministic(enabled: bool) -> None:
    """``training.use_deter_comp``: deterministic algorithms where the backend has them (a warning, not an
    error, for operations that have none), and cuBLAS's fixed workspace so its matmuls are reproducible."""
    import os

    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    if torch.backends.cudnn.is_available():  # type: ignore[no-untyped-call]  # unannotated in torch
        torch.backends.cudnn.benchmark = not enabled and torch.backends.cudnn.benchmark
        torch.backends.cudnn.deterministic = enabled
