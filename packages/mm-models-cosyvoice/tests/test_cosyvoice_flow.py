"""CosyVoice3's flow stage: the official state-dict names, the DiT's pieces (time features, the rotary quirk,
chunk masks, the look-ahead), the flow-matching loss against a hand computation, reproducibility from the
per-sample seeds, save / load, meta initialisation and sampling."""

from __future__ import annotations

import math

import pytest
import torch
from _cosy_fixtures import TINY_FLOW, VOCAB, flow_args

from mm_core.errors import ConfigError, DataError
from mm_core.models import ModelArguments
from mm_models_cosyvoice.convert import convert_official
from mm_models_cosyvoice.dit import apply_rotary, attention_mask, timestep_features
from mm_models_cosyvoice.flow import CosyVoice3FlowForTraining, FlowConfig, draw


def official_flow_keys(depth: int) -> dict[str, tuple[str, ...]]:
    """The keys of the official ``flow.pt`` (spec §2.1), shapes in symbols (D model width, M 80 mel bins,
    P pre-look-ahead channels, V speech vocabulary, G = D / conv groups)."""
    e = "decoder.estimator."
    keys = {
        "input_embedding.weight": ("V", "M"),
        "spk_embed_affine_layer.weight": ("M", "192"),
        "spk_embed_affine_layer.bias": ("M",),
        "pre_lookahead_layer.conv1.weight": ("P", "M", "4"),
        "pre_lookahead_layer.conv1.bias": ("P",),
        "pre_lookahead_layer.conv2.weight": ("M", "P", "3"),
        "pre_lookahead_layer.conv2.bias": ("M",),
        e + "time_embed.time_mlp.0.weight": ("D", "256"),
        e + "time_embed.time_mlp.0.bias": ("D",),
        e + "time_embed.time_mlp.2.weight": ("D", "D"),
        e + "time_embed.time_mlp.2.bias": ("D",),
        e + "input_embed.proj.weight": ("D", "4M"),
        e + "input_embed.proj.bias": ("D",),
        e + "input_embed.conv_pos_embed.conv1.0.weight": ("D", "G", "31"),
        e + "input_embed.conv_pos_embed.conv1.0.bias": ("D",),
        e + "input_embed.conv_pos_embed.conv2.0.weight": ("D", "G", "31"),
        e + "input_embed.conv_pos_embed.conv2.0.bias": ("D",),
        e + "rotary_embed.inv_freq": ("R",),
        e + "norm_out.linear.weight": ("2D", "D"),
        e + "norm_out.linear.bias": ("2D",),
        e + "proj_out.weight": ("M", "D"),
        e + "proj_out.bias": ("M",),
    }
    for i in range(depth):
        b = f"{e}transformer_blocks.{i}."
        keys.update({b + "attn_norm.linear.weight": ("6D", "D"), b + "attn_norm.linear.bias": ("6D",)})
        for proj in ("to_q", "to_k", "to_v", "to_out.0"):
            keys.update({b + f"attn.{proj}.weight": ("D", "D"), b + f"attn.{proj}.bias": ("D",)})
        keys.update(
            {
                b + "ff.ff.0.0.weight": ("2D", "D"),
                b + "ff.ff.0.0.bias": ("2D",),
                b + "ff.ff.2.weight": ("D", "2D"),
                b + "ff.ff.2.bias": ("D",),
            }
        )
    return keys


def _model(**overrides: object) -> CosyVoice3FlowForTraining:
    torch.manual_seed(0)
    return CosyVoice3FlowForTraining._from_config(flow_args(**overrides))


def _batch(lengths=(5, 7, 6), seeds=(11, 12, 13)):
    g = torch.Generator().manual_seed(0)
    s = max(lengths)
    return {
        "speech_tokens": torch.randint(0, VOCAB, (len(lengths), s), generator=g),
        "speech_lengths": torch.tensor(lengths),
        "mel": torch.randn(len(lengths), 2 * s, 80, generator=g),
        "mel_lengths": 2 * torch.tensor(lengths),
        "speaker": torch.randn(len(lengths), 192, generator=g),
        "noise_seed": list(seeds),
    }


def test_state_dict_has_the_official_names_and_shapes():
    d = TINY_FLOW["dim"]
    sizes = {
        "V": VOCAB, "M": 80, "P": TINY_FLOW["pre_lookahead_channels"], "D": d, "2D": 2 * d, "6D": 6 * d,
        "4M": 320, "G": d // TINY_FLOW["conv_pos_groups"], "R": TINY_FLOW["dim_head"] // 2,
        "192": 192, "256": 256, "31": 31, "4": 4, "3": 3,
    }  # fmt: skip
    want = {k: tuple(sizes[s] for s in shape) for k, shape in official_flow_keys(2).items()}
    got = {k: tuple(v.shape) for k, v in _model().state_dict().items()}
    assert got == want


def test_official_sizes_by_default():
    with torch.device("meta"):
        model = CosyVoice3FlowForTraining._from_config(
            ModelArguments(model_id="cosyvoice3_flow", from_scratch=True)
        )
    n = sum(p.numel() for p in model.parameters())
    assert 320e6 < n < 340e6  # ~332 M
    assert len(model.decoder.estimator.transformer_blocks) == 22


def test_time_features_rotary_quirk_and_masks():
    t = torch.tensor([0.0, 0.25, 1.0])
    feats = timestep_features(t)
    k = torch.arange(128)
    arg = 1000 * 0.25 * torch.exp(-math.log(10000) * k / 127)
    torch.testing.assert_close(feats[1], torch.cat([arg.sin(), arg.cos()]))
    # only the first `width` channels turn, in adjacent pairs
    x = torch.randn(1, 3, 8)
    angles = torch.tensor([[0.0] * 4, [0.5, 0.5, 1.0, 1.0], [1.0, 1.0, 2.0, 2.0]])
    out = apply_rotary(x, angles)
    torch.testing.assert_close(out[..., 4:], x[..., 4:])
    a, b = x[0, 1, 2], x[0, 1, 3]
    torch.testing.assert_close(
        out[0, 1, 2:4], torch.stack([a * math.cos(1) - b * math.sin(1), b * math.cos(1) + a * math.sin(1)])
    )
    # masks: sample 0 streaming in chunks of 2 over 5 frames, sample 1 offline with 3 frames
    frames = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    mask = attention_mask(frames, torch.tensor([True, False]), 2)
    assert mask[0, 0, 2].tolist() == [True, True, True, True, False]  # frame 2 sees chunks 0 and 1
    assert mask[0, 0, 4].tolist() == [True] * 5
    assert mask[1, 0, 0].tolist() == [True, True, True, False, False]


def test_each_mel_frame_sees_three_tokens_ahead():
    model = _model()
    tokens = torch.randint(0, VOCAB, (1, 10))
    lengths = torch.tensor([10])
    base = model.token_features(tokens, lengths)
    moved = tokens.clone()
    moved[0, 7] = (moved[0, 7] + 1) % VOCAB
    changed = (model.token_features(moved, lengths) - base).abs().sum(-1)[0] > 0
    # token 7 reaches the frames of tokens 4..7 (look-ahead 3) and the next two (conv2, causal, kernel 3)
    assert changed.nonzero().flatten().tolist() == list(range(8, 20))


def test_loss_by_hand():
    model = _model(training_cfg_rate=0.0, prompt_prob=1.0, streaming_prob=0.0)
    batch = _batch(lengths=(5,), seeds=(21,))
    out = model(**batch)
    d = draw(21, 10, model.config)
    assert 0 <= d.prompt_frames <= 3 and d.keep_condition and not d.streaming
    x1 = batch["mel"][:, :10]
    t = torch.tensor([d.t])
    y = (1 - (1 - 1e-6) * t) * d.noise[None] + t * x1
    u = x1 - (1 - 1e-6) * d.noise[None]
    cond = torch.zeros_like(x1)
    cond[:, : d.prompt_frames] = x1[:, : d.prompt_frames]
    mu = model.token_features(batch["speech_tokens"], batch["speech_lengths"])
    spk = model.spk_embed_affine_layer(batch["speaker"] / batch["speaker"].norm(dim=-1, keepdim=True))
    v = model.decoder.estimator(
        y, torch.ones(1, 10, dtype=torch.bool), mu, t, spk, cond, torch.tensor([False])
    )
    torch.testing.assert_close(out.loss, (v - u).square().mean())


def test_loss_is_reproducible_from_the_seeds_and_independent_of_the_batch():
    model = _model()
    batch = _batch()
    a, b = model(**batch), model(**batch)
    assert torch.equal(a.loss, b.loss)
    # sample 1 alone (no padding) trains exactly as inside the padded batch
    alone = {k: (v[1:2] if isinstance(v, torch.Tensor) else v[1:2]) for k, v in batch.items()}
    torch.testing.assert_close(model(**alone).loss, a.sample_loss[1], rtol=1e-6, atol=1e-6)
    other = model(**{**batch, "noise_seed": [11, 12, 99]})
    assert torch.equal(other.sample_loss[:2], a.sample_loss[:2]) and other.sample_loss[2] != a.sample_loss[2]
    # sample: the mean of the samples' losses; frame (upstream): frames of the micro-batch
    assert a.loss.item() == pytest.approx(a.sample_loss.mean().item(), rel=1e-6)
    frame = CosyVoice3FlowForTraining(FlowConfig.read({**TINY_FLOW, "loss_normalization": "frame"}, "test"))
    frame.load_state_dict(model.state_dict())
    weights = batch["mel_lengths"].float()
    torch.testing.assert_close(frame(**batch).loss, (a.sample_loss * weights).sum() / weights.sum())


def test_guidance_dropout_drops_tokens_speaker_and_prompt_together():
    model = _model(training_cfg_rate=1.0)
    batch = _batch()
    base = model(**batch).loss
    other = {**batch, "speech_tokens": (batch["speech_tokens"] + 1) % VOCAB, "speaker": -batch["speaker"]}
    assert torch.equal(model(**other).loss, base)
    kept = _model(training_cfg_rate=0.0)
    assert not torch.equal(kept(**other).loss, kept(**batch).loss)


def test_draws_follow_their_probabilities():
    config = FlowConfig()
    draws = [draw(s, 100, config) for s in range(400)]
    assert 0.15 < sum(not d.keep_condition for d in draws) / 400 < 0.25
    prompted = [d.prompt_frames for d in draws if d.prompt_frames]
    assert 0.4 < len(prompted) / 400 < 0.6 and max(prompted) <= 30
    assert 0.4 < sum(d.streaming for d in draws) / 400 < 0.6
    assert draws[3].noise.shape == (100, 80) and torch.equal(draws[3].noise, draw(3, 100, config).noise)


def test_bad_batches_and_configs_are_refused():
    model = _model()
    batch = _batch()
    with pytest.raises(DataError, match="2 noise seeds for a batch of 3"):
        model(**{**batch, "noise_seed": [1, 2]})
    with pytest.raises(DataError, match="13 mel frames for 7 speech tokens"):
        model(**{**batch, "mel": batch["mel"][:, :13]})
    with pytest.raises(ConfigError, match="config_overrides.heads_: unknown key"):
        CosyVoice3FlowForTraining._from_config(flow_args(heads_=3))
    with pytest.raises(ConfigError, match="loss_normalization: got 'token'"):
        CosyVoice3FlowForTraining._from_config(flow_args(loss_normalization="token"))


def test_save_load_and_meta_init(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path / "ours")
    loaded = CosyVoice3FlowForTraining.from_pretrained(
        ModelArguments(model_id="cosyvoice3_flow", model_name_or_path=str(tmp_path / "ours"))
    )
    assert loaded.config == model.config
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    official = tmp_path / "official"
    official.mkdir()
    torch.save(model.state_dict(), official / "flow.pt")
    args = ModelArguments(
        model_id="cosyvoice3_flow", model_name_or_path=str(official), config_overrides=TINY_FLOW
    )
    again = CosyVoice3FlowForTraining.from_pretrained(args)
    assert torch.equal(again.decoder.estimator.proj_out.weight, model.decoder.estimator.proj_out.weight)
    with pytest.raises(ConfigError, match="holds flow.pt but no model.safetensors"):
        CosyVoice3FlowForTraining._from_config(args)
    converted = convert_official("cosyvoice3_flow", official, tmp_path / "converted", **TINY_FLOW)
    args = ModelArguments(model_id="cosyvoice3_flow", model_name_or_path=str(converted))
    assert CosyVoice3FlowForTraining._from_config(args).config == model.config  # config.json written
    assert torch.equal(
        CosyVoice3FlowForTraining.from_pretrained(args).input_embedding.weight, model.input_embedding.weight
    )
    with torch.device("meta"):
        meta = CosyVoice3FlowForTraining._from_config(flow_args())
    meta.to_empty(device="cpu")
    for t in [*meta.parameters(), *meta.buffers()]:
        t.data.fill_(float("nan"))
    meta.init_weights()
    assert not any(torch.isnan(t).any() for t in [*meta.parameters(), *meta.buffers()])
    torch.testing.assert_close(
        meta.decoder.estimator.rotary_embed.inv_freq, model.decoder.estimator.rotary_embed.inv_freq
    )


def test_sample_is_seeded_and_keeps_the_shape():
    model = _model().eval()
    tokens = torch.randint(0, VOCAB, (1, 6))
    spk = torch.randn(1, 192)
    prompt = torch.randn(1, 4, 80)
    a = model.sample(tokens, spk, prompt, seed=3)
    assert a.shape == (1, 12, 80) and torch.isfinite(a).all()
    assert torch.equal(a, model.sample(tokens, spk, prompt, seed=3))
    assert not torch.equal(a, model.sample(tokens, spk, prompt, seed=4))
