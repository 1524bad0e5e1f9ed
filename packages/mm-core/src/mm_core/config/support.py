"""Settings that the YAML accepts (for compatibility with MindSpeed-MM files) but this version of mm does
not provide yet. Each one is refused with a clear error instead of being silently ignored."""

from __future__ import annotations

from mm_core.config.schema import MMConfig
from mm_core.errors import ConfigError

_NOT_YET = "this version of mm does not provide it yet; remove it or set it back to its default"


def check_supported(cfg: MMConfig) -> None:
    """Raise :class:`ConfigError` for the first setting mm would otherwise have to ignore."""
    plan, dl = cfg.parallel.fsdp_plan, cfg.data.dataloader_param
    checks = [
        ("parallel.fsdp_plan.hook_modules", plan.hook_modules, []),
        ("parallel.fsdp_plan.pregather", plan.pregather, False),
        ("parallel.ep_plan.apply_efsdp_modules", cfg.parallel.ep_plan.apply_efsdp_modules, []),
        ("parallel.ep_plan.dispatcher", cfg.parallel.ep_plan.dispatcher, "alltoall"),
        # mm always reads data through its seeded, resumable global-order sampler (what MindSpeed-MM calls
        # dataloader_mode: sampler with BaseRandomBatchSampler); other modes would be silently different
        ("data.dataloader_param.dataloader_mode", dl.dataloader_mode, "sampler"),
        ("data.dataloader_param.sampler_type", dl.sampler_type, "BaseRandomBatchSampler"),
    ]
    for key, value, default in checks:
        if value != default:
            raise ConfigError(f"{key}: got {value!r}; {_NOT_YET}")
