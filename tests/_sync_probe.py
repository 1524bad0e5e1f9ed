"""A probe that counts host syncs: the calls that make the host wait for an accelerator's queued work.

On a GPU or NPU the host must wait for the device when it reads a value the device computes (``item``,
``bool``/``int``/``float`` of a tensor, ``tolist``), when an op's output size depends on the values
(``nonzero``, ``bincount``, ``unique``, ``masked_select``, indexing with a boolean mask, ``repeat_interleave``
with a tensor of repeats and no ``output_size``), and on a device ``synchronize()``. On this CPU-only machine
none of them waits, so the probe counts the calls themselves: the same code run on an accelerator would wait
at each one.

:class:`SyncProbe` is a context manager (active on the calling thread) that counts them, each under a
``kind`` (``item``, ``tolist``, ``bincount``, ``synchronize``, ...) and a ``where`` (the innermost frame
outside torch and this file); :func:`measure` trains a config for 3 and for 6 steps under the probe and
writes the counts of both runs, so a test takes the difference as the syncs of 3 steady-state steps. It is
called on every rank of a launch (``_launch.Call``). Nothing in mm imports this file."""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: ops whose output size depends on their input values (the host must read them to allocate the output)
_DATA_DEPENDENT = {
    aten.nonzero.default: "nonzero",
    aten.bincount.default: "bincount",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.masked_select.default: "masked_select",
}
_VALUE_READS = {aten._local_scalar_dense.default: "item"}  # item(), bool(t), int(t), float(t)
#: the fused optimizer updates (logged in order with the syncs, not counted: see SyncProbe.log)
_UPDATES = {getattr(aten, name).default for name in ("_fused_adam_", "_fused_adamw_") if hasattr(aten, name)}
_TORCH_FILES = (os.path.dirname(torch.__file__), __file__)
#: the device modules whose synchronize() is counted (looked up at call time by code that calls it)
_SYNC_MODULES = ("cpu", "cuda", "npu", "xpu", "mps", "accelerator")


def _where() -> str:
    """``file:line`` of the innermost frame outside torch and this probe (the code that asked)."""
    frame = sys._getframe(2)
    # past torch, this file and mm's read_once (its caller is the place that reads)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_FILES) or frame.f_code.co_name == "read_once"
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    parts = Path(frame.f_code.co_filename).parts
    short = "/".join(parts[-3:])
    return f"{short}:{frame.f_lineno}"


def _bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _Dispatch(TorchDispatchMode):
    def __init__(self, probe: SyncProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _UPDATES and not self.probe.paused:
            self.probe.log.append("update")
        kind = _DATA_DEPENDENT.get(func) or _VALUE_READS.get(func)
        if kind is None:
            if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                kind = "repeat_interleave"
            elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and _bool_index(
                args[1]
            ):
                kind = "bool_index"
        if kind is not None and not self.probe.inside_read:
            self.probe.add(kind)
        return func(*args, **kwargs)


class SyncProbe:
    """Counts host syncs while active (see the module docstring): ``counts[(kind, where)]``; ``log`` has
    them in order (``"kind where"``) with ``"update"`` where a fused optimizer update was issued."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.log: list[str] = []
        self.inside_read = False
        self.paused = False
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode: _Dispatch | None = None

    def add(self, kind: str) -> None:
        if not self.paused:
            where = _where()
            self.counts[(kind, where)] += 1
            self.log.append(f"{kind} {where}")

    def pausing(self, fn: Any) -> Any:
        """``fn`` with the probe paused while it runs (host-side work such as building batches from the
        dataset, whose reads of host tensors never wait for a device)."""

        def paused(*args: Any, **kwargs: Any) -> Any:
            self.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused = False

        return paused

    def _tolist(self, original: Any) -> Any:
        # Tensor.tolist reads the values without dispatching a read op on CPU, and a torch-function mode is
        # not active in backward (recomputed forwards, autograd functions), so it is counted by a wrapper
        def tolist(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.add("tolist")
            self.inside_read = True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self.inside_read = False

        return tolist

    def _counting(self, original: Any) -> Any:
        def synchronize(*args: Any, **kwargs: Any) -> Any:
            self.add("synchronize")
            return original(*args, **kwargs)

        return synchronize

    def __enter__(self) -> SyncProbe:
        for name in _SYNC_MODULES:
            module = getattr(torch, name, None)
            original = getattr(module, "synchronize", None)
            if module is not None and callable(original):
                self._saved.append((module, "synchronize", original))
                module.synchronize = self._counting(original)
        self._saved.append((torch.Tensor, "tolist", torch.Tensor.tolist))
        torch.Tensor.tolist = self._tolist(torch.Tensor.tolist)  # type: ignore[method-assign]
        self._mode = _Dispatch(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []

    def by_kind(self) -> dict[str, int]:
        out: collections.Counter[str] = collections.Counter()
        for (kind, _), n in self.counts.items():
            out[kind] += n
        return dict(out)


def _train_counted(config: str, overrides: list[str]) -> dict[str, Any]:
    from mm_core.config import load_config
    from mm_core.train.trainer import Trainer

    trainer = Trainer(load_config(config, overrides), config).setup()
    probe = SyncProbe()
    # the micro-batches are built from the dataset on the host (host tensors: nothing waits for a device)
    trainer._next_micro_batches = probe.pausing(trainer._next_micro_batches)  # type: ignore[method-assign]
    try:
        with probe:
            trainer.train()
    finally:
        if trainer.saver is not None:
            trainer.saver.close()
    return {
        "by_kind": probe.by_kind(),
        "where": {f"{k} {w}": n for (k, w), n in probe.counts.items()},
        "log": probe.log,
    }


def measure(name: str, config: str, overrides: list[str], out_dir: str) -> None:
    """Train ``config`` with ``overrides`` for 3 and for 6 steps under the probe (on every rank of a launch);
    write ``{out_dir}/{name}.rank{RANK}.json`` with the counts of both runs (``steps3``, ``steps6``)."""
    result = {}
    for steps in (3, 6):
        out = Path(out_dir) / f"{name}_{steps}"
        extra = [f"training.train_iters={steps}", f"training.output_dir={out}"]
        result[f"steps{steps}"] = _train_counted(config, [*overrides, *extra])
    rank = os.environ.get("RANK", "0")
    path = Path(out_dir) / f"{name}.rank{rank}.json"
    path.write_text(json.dumps(result, indent=1), encoding="utf-8")


def read_log(out_dir: Path, name: str, rank: int = 0) -> list[str]:
    """The ordered log (:attr:`SyncProbe.log`) of the 6-step run that :func:`measure` wrote."""
    data = json.loads((out_dir / f"{name}.rank{rank}.json").read_text(encoding="utf-8"))
    log: list[str] = data["steps6"]["log"]
    return log


def per_step(out_dir: Path, name: str, rank: int = 0) -> tuple[dict[str, float], dict[str, float]]:
    """From what :func:`measure` wrote: the syncs of one steady-state step, by kind and by place
    (``(6-step count - 3-step count) / 3``)."""
    data = json.loads((out_dir / f"{name}.rank{rank}.json").read_text(encoding="utf-8"))
    out = []
    for key in ("by_kind", "where"):
        six, three = data["steps6"][key], data["steps3"][key]
        diff = {k: (six.get(k, 0) - three.get(k, 0)) / 3 for k in set(six) | set(three)}
        out.append({k: v for k, v in diff.items() if v})
    return out[0], out[1]
