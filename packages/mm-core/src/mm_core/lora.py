"""LoRA adapters through peft (``training.lora``): injected in place, so module paths, FSDP plans and
checkpoint names stay those of the model (adapters appear as ``<layer>.lora_A.default.weight`` and the
wrapped weight as ``<layer>.base_layer.weight``)."""

from __future__ import annotations

from torch import nn

from mm_core.config.schema import LoraConfig
from mm_core.errors import ConfigError


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError(
            "training.lora.enable: true needs peft; install it with `pip install mm-core[lora]` "
            "(or `pip install peft`)"
        ) from None
    return peft


def check_lora_settings(cfg: LoraConfig, from_scratch: bool, has_base_weights: bool) -> None:
    """Settings that cannot work together, named by key."""
    if cfg.save_adapters_only and not cfg.enable:
        raise ConfigError("training.lora.save_adapters_only: true needs training.lora.enable: true")
    if cfg.enable and cfg.save_adapters_only and (from_scratch or not has_base_weights):
        raise ConfigError(
            "training.lora.save_adapters_only: true needs base weights that can be found again: set "
            "model.model_name_or_path to a folder with *.safetensors and model.from_scratch: false "
            "(an adapters-only checkpoint of a randomly initialised model could never be restored)"
        )


def apply_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Inject LoRA adapters into the modules named by ``cfg.target_modules`` and freeze everything else.
    Returns the names of the adapted modules. Call after ``model.freeze`` and before FSDP (on a meta-built
    model the adapters are meta tensors too: ``mm check`` counts them; training refuses LoRA with
    ``training.init_model_with_meta_device``, see :func:`~mm_core.parallel.apply.prepare_model`)."""
    if not cfg.target_modules:
        raise ConfigError(
            "training.lora.target_modules: empty; name the linear layers to adapt, e.g. [q_proj, k_proj, "
            "v_proj, o_proj] (module names or name suffixes, as peft accepts them)"
        )
    peft = _peft()
    config = peft.LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules)
    )
    try:
        peft.inject_adapter_in_model(config, model)
    except ValueError as e:
        raise ConfigError(f"training.lora.target_modules: {list(cfg.target_modules)!r}: {e}") from None
    adapted = [name for name, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    if not adapted:
        raise ConfigError(f"training.lora.target_modules: {list(cfg.target_modules)!r} matched no module")
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return adapted


def is_adapter_key(name: str) -> bool:
    """True for the state-dict keys of LoRA adapters."""
    return ".lora_" in name


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA adapter into its base weight and put the base layer back in its place, so the model
    has exactly the original module tree and parameter names (what plain transformers loads)."""
    peft = _peft()
    for name, module in list(model.named_modules()):
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
    return model
