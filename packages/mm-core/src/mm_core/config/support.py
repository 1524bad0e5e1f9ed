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
    ]
    for key, value, default in checks:
        if value != default:
            raise ConfigError(f"{key}: got {value!r}; {_NOT_YET}")
    # both dataloader modes read the order of torch's DistributedSampler through mm's global-order sampler
    # (see mm_core.data.sampling); the guide's BaseRandomBatchSampler is that order in micro-batches
    if dl.sampler_type != "BaseRandomBatchSampler":
        raise ConfigError(
            f"data.dataloader_param.sampler_type: got {dl.sampler_type!r}; mm reads every dataset in the "
            "seeded, resumable order of BaseRandomBatchSampler; for batches of similar lengths use "
            "data.dataloader_param.max_tokens_per_batch (with dynamic_batch_buffer) instead"
        )
