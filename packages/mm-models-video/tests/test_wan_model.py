"""``wan2_2`` in one process: building (meta device, from a diffusers folder, from scratch), the training
forward against diffusers' own transformer, the A14B expert settings, the default plan and the export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mm_core.config.schema import ModelConfig, TrainingConfig
from mm_core.errors import ConfigError, DataError
from mm_core.models import ModelHub, plan_of
from mm_core.optim.muon import muon_plan
from mm_core.parallel.apply import check_initialised, materialize_meta

diffusers = pytest.importorskip("diffusers")

TINY: dict[str, Any] = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 256,
    "ffn_dim": 32,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}


def _args(**kw: Any) -> ModelConfig:
    return ModelConfig(model_id="wan2_2", **kw)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A diffusers pipeline folder with two tiny experts and ``boundary_ratio`` in model_index.json."""
    root = tmp_path_factory.mktemp("wan_pipeline")
    for seed, sub in enumerate(("transformer", "transformer_2")):
        torch.manual_seed(seed)
        diffusers.WanTransformer3DModel(**TINY).save_pretrained(root / sub)
    (root / "model_index.json").write_text(
        json.dumps({"_class_name": "WanPipeline", "boundary_ratio": 0.875})
    )
    return root


def _batch(b: int = 2) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "latents": torch.randn(b, 16, 3, 4, 4, generator=g),
        "encoder_hidden_states": torch.randn(b, 5, 32, generator=g),
        "noise_seed": [11 * (i + 1) for i in range(b)],
    }


def test_meta_build_initialises_every_tensor_and_the_rotary_tables() -> None:
    args = _args(from_scratch=True, config_overrides=TINY)
    model = ModelHub.build(args, meta=True)
    assert next(model.parameters()).is_meta
    materialize_meta(model, torch.device("cpu"), init=True)  # NaN-fills first: a forgotten tensor is caught
    check_initialised(model)
    fresh = ModelHub.build(args)
    assert torch.equal(model.rope.freqs_cos, fresh.rope.freqs_cos)
    assert torch.equal(model.rope.freqs_sin, fresh.rope.freqs_sin)
    std = float(model.blocks[0].scale_shift_table.detach().std())
    assert 0.5 * 24**-0.5 < std < 2 * 24**-0.5  # diffusers' randn / sqrt(dim)
    assert torch.isfinite(model(**_batch()).loss)


def test_training_forward_is_flow_matching_around_the_diffusers_transformer(pipeline: Path) -> None:
    overrides = {"flow_matching": {"timestep_sampling": "uniform", "shift": 2.0}, "expert": "high_noise"}
    model = ModelHub.build(
        _args(model_name_or_path=str(pipeline / "transformer"), config_overrides=overrides)
    )
    reference = diffusers.WanTransformer3DModel.from_pretrained(pipeline / "transformer")
    batch = _batch()
    out = model(**batch, use_cache=False)
    flow = model.mm_training.flow
    losses = []
    for b, seed in enumerate(batch["noise_seed"]):
        sigma, noise = flow.draw(seed, batch["latents"].shape[1:])
        assert 0.875 <= sigma <= 1.0 and out.sigmas[b].item() == pytest.approx(sigma)
        x0 = batch["latents"][b : b + 1]
        x_t = sigma * noise[None] + (1 - sigma) * x0
        t = torch.tensor([sigma * 1000.0], dtype=torch.float32)
        pred = reference(x_t, t, batch["encoder_hidden_states"][b : b + 1], return_dict=False)[0]
        losses.append((pred - (noise[None] - x0)).square().mean())
    assert torch.allclose(out.loss, torch.stack(losses).mean(), rtol=1e-5)
    with pytest.raises(DataError, match="multiples of the patch size"):
        model(**{**batch, "latents": torch.randn(2, 16, 3, 5, 4)})


def test_text_dropout_trains_the_dropped_samples_on_zero_text(pipeline: Path) -> None:
    overrides = {"flow_matching": {"text_dropout": 0.5}}
    model = ModelHub.build(
        _args(model_name_or_path=str(pipeline / "transformer"), config_overrides=overrides)
    )
    batch = _batch(8)
    kept = model.mm_training.flow.text_kept(batch["noise_seed"])
    assert 0 < int(kept.sum()) < 8  # these seeds drop some samples' text and keep others'
    text = batch["encoder_hidden_states"] * kept.view(-1, 1, 1)
    plain = ModelHub.build(_args(model_name_or_path=str(pipeline / "transformer")))
    assert torch.allclose(model(**batch).loss, plain(**{**batch, "encoder_hidden_states": text}).loss)


def test_the_expert_and_its_boundary_come_from_the_pipeline_folder(pipeline: Path) -> None:
    low = ModelHub.build(_args(model_name_or_path=str(pipeline / "transformer_2")))
    assert low.mm_training.expert == "low_noise" and low.mm_training.boundary_ratio == 0.875
    assert (low.mm_training.flow.low, low.mm_training.flow.high) == (0.0, 0.875)
    high = ModelHub.build(_args(model_name_or_path=str(pipeline / "transformer")))
    assert (high.mm_training.flow.low, high.mm_training.flow.high) == (0.875, 1.0)
    # a single-transformer model (no boundary) trains on every noise level
    alone = ModelHub.build(_args(from_scratch=True, config_overrides=TINY))
    assert alone.mm_training.expert is None and (alone.mm_training.flow.low, alone.mm_training.flow.high) == (
        0,
        1,
    )
    with pytest.raises(ConfigError, match="config_overrides.expert: 'low_noise' needs the boundary"):
        ModelHub.build(_args(from_scratch=True, config_overrides={**TINY, "expert": "low_noise"}))
    with pytest.raises(ConfigError, match="config_overrides.expert: got 'middle'"):
        ModelHub.build(_args(from_scratch=True, config_overrides={**TINY, "expert": "middle"}))
    with pytest.raises(ConfigError, match=r"boundary_ratio: got 1.5; expected a number in \(0, 1\)"):
        ModelHub.build(_args(from_scratch=True, config_overrides={**TINY, "boundary_ratio": 1.5}))


def test_folder_and_override_errors(pipeline: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="a pipeline folder: point at its transformer/"):
        ModelHub.build(_args(model_name_or_path=str(pipeline)))
    with pytest.raises(
        ConfigError, match="config_overrides.num_layer: not a WanTransformer3DModel config key"
    ):
        ModelHub.build(_args(from_scratch=True, config_overrides={"num_layer": 2}))
    with pytest.raises(ConfigError, match="model_name_or_path: not set"):
        ModelHub.build(_args())
    deeper = {"num_layers": 3}  # the folder has 2 blocks: the third would start from random weights
    with pytest.raises(ConfigError, match="lacks 27 weights of WanTransformer3DModel"):
        ModelHub.build(_args(model_name_or_path=str(pipeline / "transformer"), config_overrides=deeper))


def test_default_plan_and_muon_exclusions() -> None:
    model = ModelHub.build(_args(from_scratch=True, config_overrides=TINY))
    plan = plan_of(model)
    assert plan.fsdp_units == ("blocks.{*}",) and plan.recompute_units == ("blocks.{*}",)
    assert plan.count_tokens is not None and plan.context_parallel is not None
    assert float(plan.count_tokens(model, _batch(3))) == 3 * 3 * 2 * 2
    split = muon_plan(model, TrainingConfig(train_iters=1, optimizer="muon"), plan)
    adamw = set(split.adamw_names)
    assert {"scale_shift_table", "blocks.0.scale_shift_table", "proj_out.weight"} <= adamw
    assert {n for n in adamw if n.startswith("condition_embedder")} == {
        n for n, _ in model.named_parameters() if n.startswith("condition_embedder")
    }
    assert (
        "blocks.0.attn1.to_q.weight" in split.muon_names and "blocks.1.ffn.net.2.weight" in split.muon_names
    )


def test_save_pretrained_writes_a_folder_diffusers_loads(tmp_path: Path) -> None:
    model = ModelHub.build(_args(from_scratch=True, config_overrides=TINY))
    model.save_pretrained(tmp_path / "transformer")
    assert json.loads((tmp_path / "transformer" / "config.json").read_text())["_class_name"] == (
        "WanTransformer3DModel"
    )
    loaded = diffusers.AutoModel.from_pretrained(str(tmp_path / "transformer"))
    assert type(loaded) is diffusers.WanTransformer3DModel
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
