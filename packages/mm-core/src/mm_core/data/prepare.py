"""``mm data prepare`` and ``mm data verify``: a dataset's preparation ahead of training, and its check.

A dataset class (or factory) registered under ``mm.datasets`` that prepares its data in a cache (see
:mod:`mm_core.data.cache`) exposes two class methods, called with the config's ``data.dataset_param``:

- ``prepare(basic_param, preprocess_param, dataset_param, *, workers, overwrite) -> list[str]``: prepare (or
  find current) the cache with ``workers`` local processes; the lines describe what is there;
- ``verify(basic_param, preprocess_param, dataset_param) -> list[str]``: every problem with the prepared cache
  (sources and prepared files re-hashed); empty when it is sound.

Training prepares the same cache on first use; preparing ahead keeps a long tokenisation out of the job (and
out of the collective timeouts of its first step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mm_core.config.schema import MMConfig
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
