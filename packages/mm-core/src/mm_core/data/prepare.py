"""``mm data prepare`` and ``mm data verify``: a dataset's preparation ahead of training, and its check.

A dataset class (or factory) registered under ``mm.datasets`` that prepares its data in a cache (see
:mod:`mm_core.data.cache`) exposes two class methods, called with the config's ``data.dataset_param``
(:class:`PreparedDataset` implements both):

- ``prepare(basic_param, preprocess_param, dataset_param, *, workers, overwrite) -> list[str]``: prepare (or
  find current) the cache with ``workers`` local processes; the lines describe what is there;
- ``verify(basic_param, preprocess_param, dataset_param) -> list[str]``: every problem with the prepared cache
  (sources and prepared files re-hashed); empty when it is sound.

Training prepares the same cache on first use; preparing ahead keeps a long tokenisation out of the job (and
out of the collective timeouts of its first step).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from mm_core.config.schema import MMConfig
from mm_core.data.cache import Prepared, verify_cache
from mm_core.errors import ConfigError


def _hook(cfg: MMConfig, name: str) -> Callable[..., Any]:
    from mm_core.registry import data_register, import_plugins

    import_plugins(cfg.training.plugin)
    dp = cfg.data.dataset_param
    factory = data_register.get(dp.dataset_type)
    hook: Callable[..., Any] | None = getattr(factory, name, None)
    if not callable(hook):
        raise ConfigError(
            f"data.dataset_param.dataset_type: {dp.dataset_type!r} has nothing to {name}: it reads its files "
            "directly when training starts"
        )
    return hook


def prepare_data(
    cfg: MMConfig, *, workers: int | None, overwrite: bool, out: Callable[[str], object] = print
) -> None:
    dp = cfg.data.dataset_param
    hook = _hook(cfg, "prepare")
    t0 = time.perf_counter()
    lines = hook(
        dict(dp.basic_parameters),
        dict(dp.preprocess_parameters),
        dp,
        workers=workers,
        overwrite=overwrite,
    )
    for line in lines:
        out(f"{dp.dataset_type}: {line}")
    out(f"{dp.dataset_type}: done in {time.perf_counter() - t0:.1f} s")


def verify_data(cfg: MMConfig, out: Callable[[str], object] = print) -> bool:
    """Print every problem; True when there is none."""
    dp = cfg.data.dataset_param
    problems = list(_hook(cfg, "verify")(dict(dp.basic_parameters), dict(dp.preprocess_parameters), dp))
    for line in problems:
        out(f"{dp.dataset_type}: {line}")
    if not problems:
        out(f"{dp.dataset_type}: prepared data verified (sources and prepared files match their hashes)")
    return not problems


class PreparedDataset(ABC):
    """The ``prepare``/``verify`` hooks for a dataset class that prepares through
    :func:`mm_core.data.cache.open_cache`. The class is built as ``cls(basic_param, preprocess_param,
    dataset_param, workers=..., overwrite=...)``, sets ``self.prepared`` (the :class:`Prepared` folder) and
    ``self.built`` (whether this construction prepared it), and describes what is there in
    :meth:`prepared_summary`."""

    prepared: Prepared
    built: bool

    @abstractmethod
    def prepared_summary(self) -> list[str]:
        """Lines for ``mm data prepare`` after the folder's path: what the prepared data holds."""

    @classmethod
    def prepare(
        cls,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any = None,
        *,
        workers: int | None = None,
        overwrite: bool = False,
    ) -> list[str]:
        """``mm data prepare``: prepare the cache (nothing to do when it is current) and describe it."""
        # the dataset class's own constructor (the mixin's is object's): checked by its subclasses
        ds = cls(basic_param, preprocess_param, dataset_param, workers=workers, overwrite=overwrite)  # type: ignore[call-arg]  # noqa: E501
        state = "prepared" if ds.built else "already prepared (current)"
        return [f"{state}: {ds.prepared.path}", *ds.prepared_summary()]

    @classmethod
    def verify(
        cls,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any = None,
    ) -> list[str]:
        """``mm data verify``: every problem with the prepared cache (sources and prepared files re-hashed);
        a stale or missing cache is reported, not built."""
        basic = {**(basic_param or {}), "cache_stale": "error", "cache_missing": "error"}
        ds = cls(basic, preprocess_param, dataset_param)  # type: ignore[call-arg]
        return verify_cache(ds.prepared)
