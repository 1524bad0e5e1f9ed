"""``ltx2`` in one process: building (meta device, from a diffusers folder, from scratch), the joint
audio+video training forward against diffusers' own transformer fed as the LTX-2 pipeline feeds it, the
text-to-video mode, the packing, the default plan and the export."""

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

#: 2 video heads of 8 (in: 8 channels), 2 audio heads of 4 (in: 2 channels × 4 mel bins), 2 blocks
TINY: dict[str, Any] = {
    "in_channels": 8,
    "out_channels": 8,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "cross_attention_dim": 16,
    "audio_in_channels": 8,
    "audio_out_channels": 8,
    "audio_num_attention_heads": 2,
    "audio_attention_head_dim": 4,
    "audio_cross_attention_dim": 8,
    "caption_channels": 12,
    "num_layers": 2,
}


def _args(**kw: Any) -> ModelConfig:
    return ModelConfig(model_id="ltx2", **kw)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ltx2_pipeline")
    torch.manual_seed(0)
    diffusers.LTX2VideoTransformer3DModel(**TINY).save_pretrained(root / "transformer")
    return root / "transformer"


def _batch(b: int = 2, audio: bool = True) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(b, 6, dtype=torch.long)
    mask[0, 4:] = 0  # the first caption has 4 real tokens, padded to 6
    batch: dict[str, Any] = {
        "latents": torch.randn(b, 8, 3, 4, 4, generator=g),
        "encoder_hidden_states": torch.randn(b, 6, 12, generator=g),
        "encoder_attention_mask": mask,
        "noise_seed": [11 * (i + 1) for i in range(b)],
    }
    if audio:
        batch["audio_latents"] = torch.randn(b, 2, 5, 4, generator=g)
        batch["audio_encoder_hidden_states"] = torch.randn(b, 6, 12, generator=g)
    return batch


def test_meta_build_initialises_every_parameter() -> None:
    args = _args(from_scratch=True, config_overrides={**TINY, "gated_attn": True, "cross_attn_mod": True})
    model = ModelHub.build(args, meta=True)
    assert next(model.parameters()).is_meta
    materialize_meta(model, torch.device("cpu"), init=True)  # NaN-fills first: a forgotten tensor is caught
    check_initialised(model)
    std = float(model.transformer_blocks[0].scale_shift_table.detach().std())
    assert 0.5 * 16**-0.5 < std < 2 * 16**-0.5  # diffusers' randn / sqrt(dim)
    a2v = model.transformer_blocks[0].video_a2v_cross_attn_scale_shift_table
    assert 0.5 < float(a2v.detach().std()) < 2  # diffusers' randn
    assert torch.isfinite(model(**_batch()).loss)


def _pipeline_loss(reference: Any, flow: Any, batch: dict[str, Any], b: int, audio: bool) -> tuple[Any, ...]:
    """Sample ``b``'s video and audio losses, with the packing, coordinates and timesteps of diffusers'
    LTX-2 pipeline and its transformer."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    seed = batch["noise_seed"][b]
    x0 = batch["latents"][b : b + 1]
    shapes = [x0.shape[1:]] + ([batch["audio_latents"].shape[1:]] if audio else [])
    sigma, noises = flow.draw_all(seed, shapes)
    x_t = sigma * noises[0][None] + (1 - sigma) * x0
    _, _, f, h, w = x0.shape
    t = torch.tensor([sigma * 1000.0])
    kwargs: dict[str, Any] = {
        "encoder_hidden_states": batch["encoder_hidden_states"][b : b + 1],
        "encoder_attention_mask": batch["encoder_attention_mask"][b : b + 1],
        "audio_encoder_attention_mask": batch["encoder_attention_mask"][b : b + 1],
        "timestep": t,
        "sigma": t,
        "video_coords": reference.rope.prepare_video_coords(1, f, h, w, x0.device, fps=24.0),
        "use_cross_timestep": True,
        "return_dict": False,
    }
    if audio:
        a0 = batch["audio_latents"][b : b + 1]
        a_t = sigma * noises[1][None] + (1 - sigma) * a0
        kwargs["audio_hidden_states"] = LTX2Pipeline._pack_audio_latents(a_t)
        kwargs["audio_encoder_hidden_states"] = batch["audio_encoder_hidden_states"][b : b + 1]
        kwargs["audio_coords"] = reference.audio_rope.prepare_audio_coords(1, a0.shape[2], x0.device)
    else:
        kwargs["audio_hidden_states"] = torch.zeros(1, 0, 8)
        kwargs["audio_encoder_hidden_states"] = kwargs["encoder_hidden_states"]
        kwargs["audio_coords"] = reference.audio_rope.prepare_audio_coords(1, 0, x0.device)
        kwargs["isolate_modalities"] = True
    video, audio_out = reference(LTX2Pipeline._pack_latents(x_t), **kwargs)
    video = LTX2Pipeline._unpack_latents(video, f, h, w)
    video_loss = (video - (noises[0][None] - x0)).square().mean()
    if not audio:
        return sigma, video_loss, None
    a_pred = LTX2Pipeline._unpack_audio_latents(audio_out, a0.shape[2], a0.shape[3])
    return sigma, video_loss, (a_pred - (noises[1][None] - a0)).square().mean()


@pytest.mark.parametrize("audio", [True, False], ids=["audio_video", "video_only"])
def test_joint_loss_is_flow_matching_around_the_diffusers_transformer(folder: Path, audio: bool) -> None:
    overrides = {"flow_matching": {"timestep_sampling": "uniform", "shift": 2.0}, "audio_loss_weight": 0.5}
    model = ModelHub.build(_args(model_name_or_path=str(folder), config_overrides=overrides))
    reference = diffusers.LTX2VideoTransformer3DModel.from_pretrained(folder)
    batch = _batch(audio=audio)
    out = model(**batch, use_cache=False, sample_id=torch.tensor([0, 1]))
    flow = model.mm_training.flow
    video_losses, audio_losses = [], []
    for b in range(2):
        sigma, video_loss, audio_loss = _pipeline_loss(reference, flow, batch, b, audio)
        assert out.sigmas[b].item() == pytest.approx(sigma)
        video_losses.append(video_loss)
        audio_losses.append(audio_loss)
    expected_video = torch.stack(video_losses).mean()
    assert torch.allclose(out.video_loss, expected_video, rtol=1e-5)
    if audio:
        expected_audio = torch.stack(audio_losses).mean()
        assert torch.allclose(out.audio_loss, expected_audio, rtol=1e-5)
        assert torch.allclose(out.loss, expected_video + 0.5 * expected_audio, rtol=1e-5)
    else:
        assert out.audio_loss is None and torch.equal(out.loss, out.video_loss)


def test_audio_and_video_share_the_noise_level_and_the_mask_matters(folder: Path) -> None:
    model = ModelHub.build(_args(model_name_or_path=str(folder)))
    batch = _batch()
    sigma, (video_noise,) = model.mm_training.flow.draw_all(11, [batch["latents"].shape[1:]])
    assert model(**batch).sigmas[0].item() == pytest.approx(sigma)
    # the video noise does not depend on whether audio is drawn after it (Wan's draw is the first noise)
    assert torch.equal(model.mm_training.flow.draw(11, batch["latents"].shape[1:])[1], video_noise)
    unmasked = {**batch, "encoder_attention_mask": torch.ones(2, 6, dtype=torch.long)}
    assert not torch.allclose(model(**batch).loss, model(**unmasked).loss)


def test_packing_matches_the_pipeline() -> None:
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    from mm_models_video.ltx2 import pack_audio, pack_video, unpack_audio, unpack_video

    x = torch.randn(2, 3, 4, 6, 8)
    for p, pt in [(1, 1), (2, 2)]:
        tokens = pack_video(x, p, pt)
        assert torch.equal(tokens, LTX2Pipeline._pack_latents(x, p, pt))
        assert torch.equal(unpack_video(tokens, x.shape, p, pt), x)
    a = torch.randn(2, 3, 5, 4)
    assert torch.equal(pack_audio(a), LTX2Pipeline._pack_audio_latents(a))
    assert torch.equal(unpack_audio(pack_audio(a), a.shape), a)


def test_batch_and_config_errors(folder: Path) -> None:
    model = ModelHub.build(_args(model_name_or_path=str(folder)))
    batch = _batch()
    with pytest.raises(DataError, match="2 channels × 3 mel bins do not give the transformer's audio_in"):
        model(**{**batch, "audio_latents": torch.randn(2, 2, 5, 3)})
    with pytest.raises(DataError, match="audio_encoder_hidden_states: the batch has audio_latents"):
        model(**{**batch, "audio_encoder_hidden_states": None})
    with pytest.raises(DataError, match="do not give the transformer's in_channels 8"):
        model(**{**batch, "latents": torch.randn(2, 4, 3, 4, 4)})
    with pytest.raises(ConfigError, match="config_overrides.audio_loss_weight: got -1"):
        ModelHub.build(_args(from_scratch=True, config_overrides={**TINY, "audio_loss_weight": -1}))
    with pytest.raises(ConfigError, match="config_overrides.frame_rate: got 0"):
        ModelHub.build(_args(from_scratch=True, config_overrides={**TINY, "frame_rate": 0}))
    with pytest.raises(ConfigError, match="num_layer: not a LTX2VideoTransformer3DModel config key"):
        ModelHub.build(_args(from_scratch=True, config_overrides={"num_layer": 2}))
    with pytest.raises(ConfigError, match="lacks .* weights of LTX2VideoTransformer3DModel"):
        ModelHub.build(_args(model_name_or_path=str(folder), config_overrides={"num_layers": 3}))


def test_default_plan_and_muon_exclusions() -> None:
    model = ModelHub.build(_args(from_scratch=True, config_overrides=TINY))
    plan = plan_of(model)
    assert plan.fsdp_units == ("transformer_blocks.{*}",) == plan.recompute_units
    assert plan.count_tokens is not None and plan.context_parallel is not None
    assert float(plan.count_tokens(model, _batch(3))) == 3 * 3 * 4 * 4 + 3 * 5  # video + audio tokens
    assert float(plan.count_tokens(model, _batch(3, audio=False))) == 3 * 3 * 4 * 4
    split = muon_plan(model, TrainingConfig(train_iters=1, optimizer="muon"), plan)
    adamw, muon = set(split.adamw_names), set(split.muon_names)
    tables = {n for n, _ in model.named_parameters() if n.endswith("scale_shift_table")}
    assert len(tables) == 2 + 4 * 2 and tables <= adamw
    stems = ("proj_in", "audio_proj_in", "proj_out", "audio_proj_out", "time_embed", "audio_time_embed")
    stems += ("caption_projection", "audio_caption_projection", "av_cross_attn_")
    embedders = {n for n, _ in model.named_parameters() if n.startswith(stems)}
    assert len(embedders) > 20 and embedders <= adamw
    assert {
        "transformer_blocks.0.attn1.to_q.weight",
        "transformer_blocks.1.video_to_audio_attn.to_k.weight",
        "transformer_blocks.0.audio_ff.net.2.weight",
    } <= muon


def test_save_pretrained_writes_a_folder_diffusers_loads(tmp_path: Path) -> None:
    model = ModelHub.build(_args(from_scratch=True, config_overrides=TINY))
    model.save_pretrained(tmp_path / "transformer")
    config = json.loads((tmp_path / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "LTX2VideoTransformer3DModel"
    loaded = diffusers.AutoModel.from_pretrained(str(tmp_path / "transformer"))
    assert type(loaded) is diffusers.LTX2VideoTransformer3DModel
    expected = model.state_dict()
    assert sorted(loaded.state_dict()) == sorted(expected)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected[name]), name
