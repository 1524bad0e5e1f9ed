"""Settings that the YAML accepts (for compatibility with MindSpeed-MM files) but mm cannot honour. Each one
is refused with a clear error that says why and what to use instead, never silently ignored."""

from __future__ import annotations

from mm_core.config.schema import MMConfig
from mm_core.errors import ConfigError

_MC2 = (
    "parallel.ep_plan.dispatcher: got 'mc2'; MC2 is Ascend's fused dispatch/combine kernel "
    "(torch_npu.npu_moe_distribute_dispatch/combine), which has no backward and caps the tokens per rank, so "
    "it cannot train; use dispatcher: alltoall (the default) or allgather"
)


def check_supported(cfg: MMConfig) -> None:
    """Raise :class:`ConfigError` for the first setting mm would otherwise have to ignore."""
    dl = cfg.data.dataloader_param
    if cfg.parallel.ep_plan.dispatcher == "mc2":
        raise ConfigError(_MC2)
    # both dataloader modes read the order of torch's DistributedSampler through mm's global-order sampler
    # (see mm_core.data.sampling); the guide's BaseRandomBatchSampler is that order in micro-batches
    if dl.sampler_type != "BaseRandomBatchSampler":
        raise ConfigError(
            f"data.dataloader_param.sampler_type: got {dl.sampler_type!r}; mm reads every dataset in the "
            "seeded, resumable order of BaseRandomBatchSampler; for batches of similar lengths use "
            "data.dataloader_param.max_tokens_per_batch (with dynamic_batch_buffer) instead"
        )
