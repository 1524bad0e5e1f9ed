"""Every model id mm ships loads a checkpoint saved by its transformers base class (the hub's weight names)
completely, and saves under the same names: transformers renames some families' checkpoint weights
(fused experts, Step's and Kimi's vision towers) and skips classes defined outside it, which mm's
registration undoes (``mm_core.models.hub.share_weight_conversions``).

The same folders, and Qwen3.5's, load into a model built on the meta device and sharded on 2 gloo ranks (FSDP
over both ranks; expert parallel 2 for the MoE models) equal to a load without meta: the per-rank reader
applies transformers' renamings and fuses each rank's experts (``mm_core.checkpoint.hf_reader``).

Which renamings apply is transformers' choice, by class name and ``model_type``; ``fully_shard`` gives a
sharded module a class of its own, and the reader makes transformers choose for it as for the class it
replaced: the mapping of each of these models (mm's classes, and transformers' own classes registered as they
are), with every transformers model in it sharded, equals the mapping of the model unsharded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _audio import AUDIO_CONFIG, MOE_TEXT, TEXT_CONFIG, VISION_CONFIG
from _launch import Call, run_in_one_launch
from _mm import QUICKSTART
from _tiny import qwen3_5_overrides
from _vlm import FAMILIES
from safetensors.torch import load_file

from mm_core.config.schema import ModelConfig
from mm_core.models import ModelHub

QWEN_TEXT = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
QWEN_VL_TEXT = {
    **QWEN_TEXT,
    **MOE,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e4,
        "mrope_section": [1, 1, 2],
        "mrope_interleaved": True,
    },
}
QWEN_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32}
IDS = {"vocab": 128} | {t: 100 + i for i, t in enumerate(t for f in FAMILIES.values() for t in f[1])}
OVERRIDES = {
    "qwen3_moe": {k: v for k, v in {**QWEN_TEXT, **MOE}.items() if k != "head_dim"},
    "qwen3_vl_moe": {"text_config": QWEN_VL_TEXT, "vision_config": QWEN_VISION},
    **{family: make(IDS) for family, (_, _, make) in FAMILIES.items()},
}


def _base(cls: type) -> type:
    return next(c for c in cls.__mro__ if c.__module__.startswith("transformers."))


@pytest.mark.parametrize("model_id", sorted(OVERRIDES))
def test_hub_names_load_completely_and_export_unchanged(model_id, tmp_path):
    args = ModelConfig(model_id=model_id, from_scratch=True, config_overrides=OVERRIDES[model_id])
    torch.manual_seed(0)
    reference = ModelHub.build(args)  # mm's class, random weights
    official = _base(type(reference))._from_config(reference.config)
    official.load_state_dict(reference.state_dict())
    official.save_pretrained(tmp_path / "official")  # what transformers writes: the checkpoint's names
    loaded = ModelHub.build(
        ModelConfig(model_id=model_id, model_name_or_path=str(tmp_path / "official"), config_overrides={})
    )  # raises if any weight is missing
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    loaded.save_pretrained(tmp_path / "exported")
    names = {k for f in (tmp_path / "exported").glob("*.safetensors") for k in load_file(f)}
    assert names == {k for f in (tmp_path / "official").glob("*.safetensors") for k in load_file(f)}


META_IDS = {**OVERRIDES, **{m: qwen3_5_overrides(m) for m in ("qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text")}}


def save_official(model_id: str, folder: Path) -> None:
    """A tiny ``model_id`` with random weights, saved by its transformers base class in ``folder``."""
    args = ModelConfig(model_id=model_id, from_scratch=True, config_overrides=META_IDS[model_id])
    torch.manual_seed(0)
    reference = ModelHub.build(args)
    official = _base(type(reference))._from_config(reference.config)
    official.load_state_dict(reference.state_dict())
    official.save_pretrained(folder)


def load_on_meta(root: str) -> None:
    """On every rank of a 2-process launch: each folder of ``root`` (named by model id) loaded into a model
    built on meta and sharded (FSDP 2; then expert parallel 2 where the model has experts); rank 0 writes the
    weights that differ from a load without meta, per model and layout, to ``root/report.json``."""
    from mm_core.config import load_config
    from mm_core.convert import load_hf_weights
    from mm_core.models import plan_of
    from mm_core.parallel.apply import check_initialised, materialize_meta, shard_model
    from mm_core.parallel.state import init_parallel_state
    from mm_core.tasks.building import build_settings, prepare_and_plan

    report = {}
    for model_id in sorted(META_IDS):
        folder = Path(root, model_id)
        args = ModelConfig(model_id=model_id, model_name_or_path=str(folder), config_overrides={})
        reference = ModelHub.build(args).state_dict()
        layouts = [1] + ([2] if plan_of(ModelHub.build(args, meta=True)).expert_modules else [])
        for ep in layouts:
            cfg = load_config(
                QUICKSTART, ["parallel.fsdp_plan.apply_modules=[]", f"parallel.expert_parallel_size={ep}"]
            )
            cfg.model = args
            state = init_parallel_state(cfg.parallel, "cpu")
            model = ModelHub.build(args, meta=True)
            shard_model(model, prepare_and_plan(model, cfg, build_settings(cfg), state.sizes), state)
            materialize_meta(model, state.device, init=False)
            load_hf_weights(model, folder)
            check_initialised(model)
            differ = []
            for name, tensor in model.state_dict().items():
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                if not torch.equal(full, reference[name]):
                    differ.append(name)
            report[f"{model_id} ep={ep}"] = differ
    if os.environ["RANK"] == "0":
        Path(root, "report.json").write_text(json.dumps(report), encoding="utf-8")


def test_meta_built_sharded_models_load_hub_folders_as_without_meta(tmp_path):
    for model_id in META_IDS:
        save_official(model_id, tmp_path / model_id)
    run_in_one_launch(2, [Call("load on meta", f"{__name__}:load_on_meta", (str(tmp_path),))], tmp_path, 600)
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert {key.split()[0] for key in report} == set(META_IDS)
    assert sum(key.endswith("ep=2") for key in report) >= 5, sorted(report)  # the MoE models
    assert {key: names for key, names in report.items() if names} == {}


def _mapping(model: torch.nn.Module) -> list[tuple]:
    """transformers' conversion mapping of ``model`` (how it loads checkpoints), as comparable values."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return [
        (type(t).__name__, t.source_patterns, t.target_patterns, t.scope_prefix, t.base_model_prefix,
         [type(op).__name__ for op in getattr(t, "operations", [])])
        for t in get_model_conversion_mapping(model)
    ]  # fmt: skip


def test_sharded_models_map_weights_as_unsharded(group):
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from transformers import PreTrainedModel, Qwen3MoeForCausalLM
    from transformers.models.qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

    from mm_core.checkpoint.hf_reader import map_sharded_as_unsharded

    omni = {
        "audio_config": AUDIO_CONFIG,
        "vision_config": VISION_CONFIG,
        "text_config": {"vocab_size": 128, **TEXT_CONFIG, **MOE_TEXT},
    }
    models = {m: ModelHub.build(ModelConfig(model_id=m, from_scratch=True, config_overrides=o), meta=True)
              for m, o in {**META_IDS, "qwen3_omni_moe": omni}.items()}  # fmt: skip
    with torch.device("meta"):  # transformers' classes as they are (a plugin may register one)
        for cls, model_id in ((Qwen3MoeForCausalLM, "qwen3_moe"),
                              (Qwen3OmniMoeThinkerForConditionalGeneration, "qwen3_omni_moe")):  # fmt: skip
            models[cls.__name__] = cls._from_config(models[model_id].config)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    differ = {}
    for name, model in models.items():
        unsharded = _mapping(model)
        for module in reversed(list(model.modules())):  # each transformers model of it, innermost first
            if isinstance(module, PreTrainedModel):
                fully_shard(module)
        assert isinstance(model, FSDPModule)
        map_sharded_as_unsharded(model)
        if _mapping(model) != unsharded:
            differ[name] = (unsharded, _mapping(model))
    assert differ == {}
