"""``training.save_hf_interval``: a Hugging Face folder of the main model, written while training.

Every ``save_hf_interval`` steps and at the last step the trained weights go to ``<save>/hf/step_<N>/``
(``<output_dir>/hf/step_<N>/`` when ``training.save`` is not set): the folder ``mm convert dcp-to-hf`` would
write from the DCP checkpoint of that step (the same export code, :func:`mm_core.convert.write_hf_folder`):
``config.json`` naming the transformers class, safetensors (sharded with an index when large), and the
tokenizer / processor files of the run (with ``model.special_tokens`` added), loadable by plain
``transformers`` ``AutoModel*.from_pretrained``. A LoRA run's adapters are merged into the exported weights.

The weights are gathered one tensor at a time (each rank takes part in every tensor's all-gather, in the same
order): rank 0 holds the export model on the host and copies each full tensor into it, so no device holds
more than one gathered tensor beyond its shards. The folder is written as ``.step_<N>.partial`` and renamed
when complete.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from mm_core.checkpoint.dcp_io import tied_aliases
from mm_core.config.schema import MMConfig
from mm_core.errors import CheckpointError


def hf_dir(cfg: MMConfig, out_dir: Path, step: int) -> Path:
    """Where the Hugging Face folder of ``step`` goes (module docstring)."""
    root = Path(cfg.training.save) if cfg.training.save else out_dir
    return root / "hf" / f"step_{step}"


def gather_into(model: nn.Module, target: nn.Module | None, device: torch.device) -> set[str]:
    """Copy every tensor of the (sharded) ``model``'s state dict, gathered whole, into the tensor of the same
    name of ``target`` (rank 0; None on the other ranks, which only take part in the gathers). Returns the
    names copied."""
    dst = target.state_dict() if target is not None else {}
    copied: set[str] = set()
    with torch.no_grad():
        for name, tensor in get_model_state_dict(model).items():
            if isinstance(tensor, DTensor):
                # CPU-offloaded shards are gathered over the device's process group
                shards = tensor.to(device) if tensor.device.type != device.type else tensor
                full = cast(DTensor, shards).full_tensor()
            elif isinstance(tensor, torch.Tensor):
                full = tensor
            else:
                continue
            if name in dst:
                if dst[name].shape != full.shape:
                    raise CheckpointError(
                        f"training.save_hf_interval: {name} has shape {list(full.shape)} in the trained "
                        f"model but {list(dst[name].shape)} in the export model built from the run's config"
                    )
                dst[name].copy_(full)
                copied.add(name)
            del full
    return copied


def save_hf_folder(model: nn.Module, cfg: MMConfig, dst: Path, device: torch.device) -> Path:
    """Write the Hugging Face folder ``dst`` of the trained ``model`` (every rank calls it; module
    docstring)."""
    from mm_core.convert import empty_export_model, write_hf_folder

    main = dist.get_rank() == 0
    target = empty_export_model(cfg) if main else None
    copied = gather_into(model, target, device)
    if target is not None:
        aliases = {n for names in tied_aliases(target) for n in names[1:]}
        missing = sorted(k for k in target.state_dict() if k not in copied and k not in aliases)
        if missing:
            raise CheckpointError(
                f"training.save_hf_interval: the trained model has no {', '.join(missing[:5])} (of the "
                f"export model built from the run's config); the export would hold untrained values"
            )
        if cfg.training.lora.enable:
            from mm_core.lora import merge_lora

            merge_lora(target)
        partial = dst.with_name(f".{dst.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        write_hf_folder(target, cfg, partial)
        shutil.rmtree(dst, ignore_errors=True)
        partial.rename(dst)
    dist.barrier()
    return dst
