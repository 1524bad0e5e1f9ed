"""Plugin registries backed by Python entry points (groups ``mm.models``, ``mm.datasets``, ``mm.collators``,
``mm.optimizers``, ``mm.tasks``).

Lookup is lazy: only the entry point asked for is imported. In-process registration with
``model_register.register(name)`` still works for notebooks and tests.
"""

from __future__ import annotations

import difflib
import importlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from mm_core.errors import ConfigError, PluginError


@dataclass(frozen=True)
class PluginInfo:
    """One name in a registry, and where it comes from."""

    name: str
    kind: str
    provider: str  # distribution name, or "<in-process>" for decorator registrations
    target: str  # "module:attr"


def _dist_name(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "<unknown distribution>"


class Registry:
    """Names of one kind (models, datasets, ...) resolved from an entry-point group and decorators."""

    def __init__(self, kind: str, group: str, config_key: str) -> None:
        self.kind = kind
        self.group = group
        self.config_key = config_key
        self._local: dict[str, Any] = {}
        self._loaded: dict[str, Any] = {}

    # ---------------------------------------------------------------- registration
    def register(self, name: str) -> Callable[[Any], Any]:
        """Decorator that registers an object under ``name`` in this process."""

        def deco(obj: Any) -> Any:
            if name in self._local and self._local[name] is not obj:
                raise PluginError(
                    f"{self.kind} {name!r} is already registered in this process by {self._local[name]!r}"
                )
            self._local[name] = obj
            return obj

        return deco

    def unregister(self, name: str) -> None:
        """Remove an in-process registration (for tests and notebooks)."""
        self._local.pop(name, None)
        self._loaded.pop(name, None)

    # ---------------------------------------------------------------- discovery
    def _entry_points(self) -> dict[str, list[EntryPoint]]:
        found: dict[str, list[EntryPoint]] = {}
        for ep in entry_points(group=self.group):
            bucket = found.setdefault(ep.name, [])
            # the same distribution can be seen twice (e.g. an editable install on two sys.path entries)
            if not any(_dist_name(e) == _dist_name(ep) and e.value == ep.value for e in bucket):
                bucket.append(ep)
        return found

    def names(self) -> list[str]:
        return sorted(set(self._local) | set(self._entry_points()))

    def infos(self) -> list[PluginInfo]:
        out = [
            PluginInfo(n, self.kind, "<in-process>", f"{o.__module__}:{getattr(o, '__qualname__', o)}")
            for n, o in self._local.items()
        ]
        for name, eps in self._entry_points().items():
            out.extend(PluginInfo(name, self.kind, _dist_name(ep), ep.value) for ep in eps)
        return sorted(out, key=lambda i: (i.name, i.provider))

    # ---------------------------------------------------------------- lookup
    def get(self, name: str) -> Any:
        """The object registered as ``name``; imports only that entry point."""
        if name in self._local:
            return self._local[name]
        if name in self._loaded:
            return self._loaded[name]
        eps = self._entry_points().get(name)
        if not eps:
            known = self.names()
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            listing = ", ".join(known) if known else "none (install a plugin package that provides one)"
            raise ConfigError(f"{self.config_key}: unknown {self.kind} {name!r}{hint} (installed: {listing})")
        if len(eps) > 1:
            who = " and ".join(f"{_dist_name(ep)} ({ep.value})" for ep in eps)
            raise PluginError(f"{self.kind} {name!r} is registered twice, by {who}; uninstall one of them")
        ep = eps[0]
        try:
            obj = ep.load()
        except Exception as exc:  # noqa: BLE001 - re-raised with the plugin's name and distribution
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            raise PluginError(
                f"{self.kind} {name!r} from {_dist_name(ep)} failed to import ({ep.value}): {detail}"
            ) from exc
        self._loaded[name] = obj
        return obj


model_register = Registry("model", "mm.models", "model.model_id")
data_register = Registry("dataset", "mm.datasets", "data.dataset_param.dataset_type")
collator_register = Registry("collator", "mm.collators", "data.dataloader_param.collate_param.collator_id")
optimizer_register = Registry("optimizer", "mm.optimizers", "training.optimizer")
task_register = Registry("task", "mm.tasks", "training.task")

REGISTRIES = (model_register, data_register, collator_register, optimizer_register, task_register)


def import_plugins(modules: list[str]) -> None:
    """Import the dotted module names in ``training.plugin`` (file paths are rejected)."""
    for i, mod in enumerate(modules):
        key = f"training.plugin[{i}]"
        if "/" in mod or "\\" in mod or mod.endswith(".py"):
            raise ConfigError(
                f"{key}: {mod!r} looks like a file path; mm imports plugins by dotted module name only. "
                "Make the plugin a pip-installable package that registers through entry points "
                '([project.entry-points."mm.models"] etc.), or list its module here, e.g. my_pkg.models'
            )
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            raise PluginError(f"{key}: cannot import {mod!r} ({exc}); is its package installed?") from exc
