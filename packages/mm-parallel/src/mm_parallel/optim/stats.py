"""Per-step counters of the Muon optimizer (communication and Newton–Schulz work on this rank)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class MuonStepStats:
    """What the last ``Muon.step()`` did on this rank.

    ``bytes_sent``/``bytes_received`` count payload exchanged with OTHER ranks (the self chunk of an
    all-to-all is excluded). ``ns_seconds`` is wall time spent in Newton–Schulz on this rank; it is
    exact on CPU and, on accelerators, only when ``Muon.sync_timing`` is True. ``ns_cpu_seconds`` is
    the CPU time of the calling thread in Newton–Schulz (the compute itself on a CPU-only run, not
    inflated when ranks share cores); ``ns_cost`` is the estimated work, sum of m*n*min(m, n).
    """

    all_to_all_calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    matrices_orthogonalized: int = 0
    ns_cost: int = 0
    ns_seconds: float = 0.0
    ns_cpu_seconds: float = 0.0
    step_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
