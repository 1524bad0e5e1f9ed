"""Every registered model id (the ``mm.models`` entry points of ``packages/*/pyproject.toml``; a test fails
when an id is added there and not here) on the meta device:

- it builds on meta, shards over 2 gloo ranks, is initialised there (``training.init_model_with_meta_device:
  true``: every tensor NaN-filled first, and any tensor the initialisation leaves NaN stops the run naming it)
  and trains 2 steps with a finite loss and gradient norm: the 19 ids of ``test_grouping.FAMILIES``, and
  CosyVoice3's vocoder (``cosyvoice3_hift``), whose ``cosyvoice_vocoder`` task builds and trains its
  discriminator (``cosyvoice3_hift_disc``) the same way. All runs share one launch of 2 processes
  (:mod:`_launch`);
- its weights, saved as ``mm convert dcp-to-hf`` saves them, load into the model built on meta and sharded
  (1 gloo rank, in this process) equal to a load without meta (every weight and buffer), with no tensor left
  NaN (uninitialised): the 13 ids that ``test_family_weight_names`` does not load on meta on 2 ranks (with
  expert parallelism). Among them ``qwen3_omni_moe``, whose export keeps the thinker's text weights under
  ``model.``: only its class's own renaming maps them to ``model.language_model.``, which the per-rank reader
  finds for the sharded class too (``mm_core.checkpoint.hf_reader.map_sharded_as_unsharded``)."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from _cosyvoice import make_vocoder_config
from _launch import run_in_one_launch
from _mm import REPO, read_metrics, registered_model_ids
from test_family_weight_names import META_IDS
from test_grouping import FAMILIES, TASK_MODELS

COMMON = [
    "training.train_iters=2",
    "training.log_interval=1",
    "training.save=null",
    "training.progress_bar=false",
    "training.micro_batch_size=1",
    "training.gradient_accumulation_steps=1",
    "training.init_model_with_meta_device=true",
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
    "tools.tensorboard.enable=false",
]
#: model id -> a function writing its tiny assets under a folder and returning the YAML of its run
RUNS: dict[str, Callable[[Path], Path]] = {**FAMILIES, "cosyvoice3_hift": make_vocoder_config}
#: the ids whose weights load on meta here; the others load on 2 ranks in test_family_weight_names
LOADED_HERE = sorted((set(RUNS) | set(TASK_MODELS)) - set(META_IDS))


def test_every_registered_model_id_is_covered():
    registered = registered_model_ids()
    assert len(registered) >= 21, sorted(registered)
    trained = set(RUNS) | set(TASK_MODELS)
    assert registered - trained == set(), "registered ids no run here trains on meta: add them to RUNS"
    loaded = set(LOADED_HERE) | set(META_IDS)
    assert registered - loaded == set(), "registered ids whose weights no test loads on meta"
    assert (trained | loaded) - registered == set(), "ids covered here that no package registers"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    items, outs = [], {}
    for family, make in RUNS.items():
        cfg = make(tmp_path_factory.mktemp(family))
        outs[family] = tmp_path_factory.mktemp(f"{family}_meta")
        items.append((family, str(cfg), [*COMMON, f"training.output_dir={outs[family]}"]))
    run_in_one_launch(2, items, REPO, timeout=90 * len(items))
    for family, out in outs.items():  # the resolved config the run wrote: it did build on meta
        resolved = yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8"))
        assert resolved["training"]["init_model_with_meta_device"] is True, family
    return {family: read_metrics(out) for family, out in outs.items()}


@pytest.mark.parametrize("family", sorted(RUNS))
def test_family_initialises_on_meta_and_trains_on_two_ranks(family, runs):
    records = runs[family]
    assert [r["step"] for r in records] == [1, 2]
    norms = ["grad_norm"] + (["grad_norm_discriminator"] if family in TASK_MODELS.values() else [])
    for key in ("loss", *norms):
        assert all(math.isfinite(r[key]) for r in records), (key, records)


def _save_weights(model: torch.nn.Module, source: str | None, folder: Path) -> None:
    """``model``'s weights in ``folder`` as mm convert dcp-to-hf writes them, beside its config folder."""
    from mm_core.convert import save_hf_weights

    if source and Path(source).is_dir():
        shutil.copytree(source, folder, dirs_exist_ok=True)
    save_hf_weights(model, folder)


def _config(model_id: str, root: Path):
    """The run config of ``model_id``: its own run's, or that of the run whose task builds it, with
    ``model:`` that model."""
    from mm_core.config import load_config
    from mm_core.config.schema import ModelConfig

    if model_id not in TASK_MODELS:
        return load_config(str(RUNS[model_id](root)))
    cfg = load_config(str(RUNS[TASK_MODELS[model_id]](root)))
    overrides = cfg.training.task_param["discriminator"]
    cfg.model = ModelConfig(model_id=model_id, from_scratch=True, config_overrides=overrides)
    return cfg


@pytest.mark.parametrize("model_id", LOADED_HERE)
def test_family_loads_its_weights_on_meta_as_without(model_id, group, tmp_path):
    from mm_core.convert import load_hf_weights
    from mm_core.models import ModelHub
    from mm_core.parallel.apply import check_initialised, materialize_meta, shard_model
    from mm_core.parallel.state import init_parallel_state
    from mm_core.tasks.building import build_settings, prepare_and_plan

    cfg = _config(model_id, tmp_path)
    torch.manual_seed(0)
    _save_weights(ModelHub.build(cfg.model), cfg.model.model_name_or_path, tmp_path / "weights")
    cfg.model = cfg.model.model_copy(
        update={"model_name_or_path": str(tmp_path / "weights"), "from_scratch": False}
    )
    unsharded = ModelHub.build(cfg.model)  # a load without meta
    reference = {**dict(unsharded.named_buffers()), **unsharded.state_dict()}
    state = init_parallel_state(cfg.parallel, "cpu")
    model = ModelHub.build(cfg.model, meta=True)
    shard_model(model, prepare_and_plan(model, cfg, build_settings(cfg), state.sizes), state)
    materialize_meta(model, state.device, init=False)  # NaN until loaded
    load_hf_weights(model, tmp_path / "weights")
    check_initialised(model)
    loaded = {**dict(model.named_buffers()), **model.state_dict()}  # non-persistent buffers too
    assert set(loaded) == set(reference)
    for name, tensor in loaded.items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        assert torch.equal(full, reference[name]), name
