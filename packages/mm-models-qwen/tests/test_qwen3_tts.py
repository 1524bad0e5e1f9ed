"""``qwen3_tts``: the official tensor names map one to one onto the model's parameters (1.7B and 0.6B on the
meta device, a tiny config for real), weights load strictly by name and round-trip through safetensors, both
losses match a reference computed frame by frame, and meta-device init initialises everything."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mm_core.config.schema import ModelConfig, TrainingConfig
from mm_core.errors import ConfigError
from mm_core.models import ModelHub
from mm_core.models.plan import plan_of
from mm_core.optim.muon import muon_plan
from mm_core.parallel.apply import check_initialised, materialize_meta
from mm_parallel.patterns import match_modules

# --------------------------------------------------------------------------- the official tensor names
# Every tensor of the official Qwen3-TTS-12Hz model.safetensors (the spec's section 3), with its shape as a
# function of the config: c = dims() below. {n}: a layer, {j}: a codebook table/head (0..G-2).
Shape = Callable[[dict[str, int]], tuple[int, ...]]
LAYER: list[tuple[str, Shape]] = [
    ("input_layernorm.weight", lambda c: (c["H"],)),
    ("self_attn.q_proj.weight", lambda c: (c["nh"] * c["d"], c["H"])),
    ("self_attn.k_proj.weight", lambda c: (c["nkv"] * c["d"], c["H"])),
    ("self_attn.v_proj.weight", lambda c: (c["nkv"] * c["d"], c["H"])),
    ("self_attn.o_proj.weight", lambda c: (c["H"], c["nh"] * c["d"])),
    ("self_attn.q_norm.weight", lambda c: (c["d"],)),
    ("self_attn.k_norm.weight", lambda c: (c["d"],)),
    ("post_attention_layernorm.weight", lambda c: (c["H"],)),
    ("mlp.gate_proj.weight", lambda c: (c["I"], c["H"])),
    ("mlp.up_proj.weight", lambda c: (c["I"], c["H"])),
    ("mlp.down_proj.weight", lambda c: (c["H"], c["I"])),
]
TALKER: list[tuple[str, Shape]] = [
    ("talker.model.text_embedding.weight", lambda c: (c["Vt"], c["Th"])),
    ("talker.model.codec_embedding.weight", lambda c: (c["Vc"], c["H"])),
    *[(f"talker.model.layers.{{n}}.{name}", shape) for name, shape in LAYER],
    ("talker.model.norm.weight", lambda c: (c["H"],)),
    ("talker.text_projection.linear_fc1.weight", lambda c: (c["Th"], c["Th"])),
    ("talker.text_projection.linear_fc1.bias", lambda c: (c["Th"],)),
    ("talker.text_projection.linear_fc2.weight", lambda c: (c["H"], c["Th"])),
    ("talker.text_projection.linear_fc2.bias", lambda c: (c["H"],)),
    ("talker.codec_head.weight", lambda c: (c["Vc"], c["H"])),
]


def _predictor_dims(c: dict[str, int]) -> dict[str, int]:
    """The code predictor's layer dims under the names LAYER uses."""
    return {**c, "H": c["Hc"], "I": c["Ic"], "nh": c["nhc"], "nkv": c["nkvc"], "d": c["dc"]}


CODE_PREDICTOR: list[tuple[str, Shape]] = [
    # only when the talker and code predictor widths differ (1.7B); an Identity on 0.6B
    ("talker.code_predictor.small_to_mtp_projection.weight", lambda c: (c["Hc"], c["H"])),
    ("talker.code_predictor.small_to_mtp_projection.bias", lambda c: (c["Hc"],)),
    ("talker.code_predictor.model.codec_embedding.{j}.weight", lambda c: (c["Vcp"], c["H"])),
    *[
        (f"talker.code_predictor.model.layers.{{n}}.{name}", lambda c, s=shape: s(_predictor_dims(c)))
        for name, shape in LAYER
    ],
    ("talker.code_predictor.model.norm.weight", lambda c: (c["Hc"],)),
    ("talker.code_predictor.lm_head.{j}.weight", lambda c: (c["Vcp"], c["Hc"])),
]
# Official tensors that are intentionally not loaded: the speaker encoder of the Base checkpoints. Reason: it
# is never trained (the official fine-tuning detaches its output and drops its weights from the checkpoint
# it saves); mm takes speaker x-vectors as data (.npy computed once with it), so the model has no speaker
# encoder and qwen3_tts_weights skips these names.
SPEAKER_ENCODER: list[str] = [
    "speaker_encoder.blocks.0.conv.{p}",
    *[f"speaker_encoder.blocks.{b}.tdnn1.conv.{{p}}" for b in (1, 2, 3)],
    *[f"speaker_encoder.blocks.{b}.res2net_block.blocks.{k}.conv.{{p}}" for b in (1, 2, 3) for k in range(7)],
    *[f"speaker_encoder.blocks.{b}.tdnn2.conv.{{p}}" for b in (1, 2, 3)],
    *[f"speaker_encoder.blocks.{b}.se_block.conv{i}.{{p}}" for b in (1, 2, 3) for i in (1, 2)],
    "speaker_encoder.mfa.conv.{p}",
    "speaker_encoder.asp.tdnn.conv.{p}",
    "speaker_encoder.asp.conv.{p}",
    "speaker_encoder.fc.{p}",
]


def dims(config: dict[str, Any]) -> dict[str, int]:
    """The shape variables of a config.json (official layout)."""
    t, p = config["talker_config"], config["talker_config"]["code_predictor_config"]
    return {
        "H": t["hidden_size"],
        "I": t["intermediate_size"],
        "L": t["num_hidden_layers"],
        "nh": t["num_attention_heads"],
        "nkv": t["num_key_value_heads"],
        "d": t["head_dim"],
        "Vt": t["text_vocab_size"],
        "Th": t["text_hidden_size"],
        "Vc": t["vocab_size"],
        "G": t["num_code_groups"],
        "Hc": p["hidden_size"],
        "Ic": p["intermediate_size"],
        "Lc": p["num_hidden_layers"],
        "nhc": p["num_attention_heads"],
        "nkvc": p["num_key_value_heads"],
        "dc": p["head_dim"],
        "Vcp": p["vocab_size"],
    }


def official_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every official tensor name of a config (speaker encoder excluded) and its shape."""
    c = dims(config)
    out: dict[str, tuple[int, ...]] = {}
    for template, shape in TALKER + CODE_PREDICTOR:
        if "small_to_mtp_projection" in template and c["H"] == c["Hc"]:
            continue
        layers = c["Lc"] if "code_predictor" in template else c["L"]
        for n in range(layers) if "{n}" in template else [0]:
            for j in range(c["G"] - 1) if "{j}" in template else [0]:
                out[template.format(n=n, j=j)] = shape(c)
    return out


def speaker_encoder_names() -> list[str]:
    return [t.format(p=p) for t in SPEAKER_ENCODER for p in ("weight", "bias")]


# the published 1.7B config.json (the values the spec derives; key layout of the official file)
OFFICIAL_1B7: dict[str, Any] = {
    "model_type": "qwen3_tts",
    "tts_model_type": "base",
    "tts_model_size": "1b7",
    "tokenizer_type": "qwen3_tts_tokenizer_12hz",
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "tts_pad_token_id": 151671,
    "tts_bos_token_id": 151672,
    "tts_eos_token_id": 151673,
    "speaker_encoder_config": {"enc_dim": 2048, "sample_rate": 24000},
    "talker_config": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "interleaved": True},
        "max_position_embeddings": 32768,
        "attention_bias": False,
        "use_sliding_window": False,
        "vocab_size": 3072,
        "text_vocab_size": 151936,
        "text_hidden_size": 2048,
        "num_code_groups": 16,
        "codec_pad_id": 2148,
        "codec_bos_id": 2149,
        "codec_eos_token_id": 2150,
        "codec_think_id": 2154,
        "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156,
        "codec_think_eos_id": 2157,
        "codec_language_id": {"english": 2050, "chinese": 2055},
        "spk_id": {},
        "code_predictor_config": {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 5,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 2048,
            "num_code_groups": 16,
            "max_position_embeddings": 65536,
            "rope_theta": 1000000,
            "rope_scaling": None,
            "layer_types": ["full_attention"] * 5,
        },
    },
}


def _config(size: str) -> dict[str, Any]:
    config = copy.deepcopy(OFFICIAL_1B7)
    talker = config["talker_config"]
    if size == "0.6B":
        talker.update(hidden_size=1024, intermediate_size=3072)
        config["speaker_encoder_config"]["enc_dim"] = 1024
    elif size == "tiny":  # the same structure (widths differ: the projection exists), 4 codebooks
        talker.update(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=64,
            text_vocab_size=100,
            text_hidden_size=48,
            num_code_groups=4,
            max_position_embeddings=256,
            codec_pad_id=40,
            codec_bos_id=41,
            codec_eos_token_id=42,
            codec_think_id=43,
            codec_nothink_id=44,
            codec_think_bos_id=45,
            codec_think_eos_id=46,
            codec_language_id={"english": 50},
        )
        talker["code_predictor_config"].update(
            hidden_size=24,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=32,
            num_code_groups=4,
            max_position_embeddings=64,
            layer_types=["full_attention"] * 2,
        )
        config.update(im_start_token_id=1, im_end_token_id=2, tts_pad_token_id=3, tts_bos_token_id=4)
        config.update(tts_eos_token_id=5)
        config["speaker_encoder_config"]["enc_dim"] = 32
    return config


def _folder(tmp: Path, config: dict[str, Any]) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def _build(folder: Path, **kw: Any) -> Any:
    return ModelHub.build(ModelConfig(model_id="qwen3_tts", model_name_or_path=str(folder), **kw))


def _tiny(tmp_path: Path, seed: int = 0, **overrides: Any) -> Any:
    folder = _folder(tmp_path / "tiny_config", _config("tiny"))
    torch.manual_seed(seed)
    args = ModelConfig(
        model_id="qwen3_tts", model_name_or_path=str(folder), from_scratch=True, config_overrides=overrides
    )
    return ModelHub.build(args)


# --------------------------------------------------------------------------------------------- names
@pytest.mark.parametrize("size", ["1.7B", "0.6B", "tiny"])
def test_official_tensor_names_map_one_to_one(size, tmp_path):
    config = _config(size)
    args = ModelConfig(
        model_id="qwen3_tts", model_name_or_path=str(_folder(tmp_path, config)), from_scratch=True
    )
    model = ModelHub.build(args, meta=size != "tiny")
    got = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    expected = official_tensors(config)
    assert sorted(got) == sorted(expected)  # names exactly, nothing more (no persistent buffers)
    assert got == expected  # shapes by the formulas
    assert {n for n, _ in model.named_parameters()} == set(expected)
    assert not set(got) & set(speaker_encoder_names())
    total = sum(p.numel() for p in model.parameters())
    if size == "1.7B":  # 28 talker layers x 11, 5 predictor layers x 11, 15 tables + 15 heads, ...
        assert len(expected) == 28 * 11 + 5 * 11 + 2 * 15 + 11
        assert total == pytest.approx(1.92e9, rel=0.01)  # the spec's count of the 3.84 GB bf16 file
    elif size == "0.6B":
        assert "talker.code_predictor.small_to_mtp_projection.weight" not in got
        assert total == pytest.approx(0.905e9, rel=0.01)  # the published 1.83 GB bf16 file


def test_plan_names_real_modules(tmp_path):
    model = _tiny(tmp_path)
    plan = plan_of(model)
    units = match_modules(model, list(plan.fsdp_units))
    assert sum(len(v) for v in units.values()) == 2 + 2
    assert plan.recompute_units == plan.fsdp_units
    excluded = match_modules(model, list(plan.muon_exclude_modules))
    assert all(excluded.values())
    assert plan.loss_parts == ("talker_loss", "code_predictor_loss")
    muon = muon_plan(model, TrainingConfig(train_iters=1), plan)
    heads = {"talker.codec_head.weight", *(f"talker.code_predictor.lm_head.{j}.weight" for j in range(3))}
    tables = {f"talker.code_predictor.model.codec_embedding.{j}.weight" for j in range(3)}
    assert heads | tables | {"talker.model.codec_embedding.weight"} <= set(muon.adamw_names)
    assert "talker.model.layers.0.self_attn.q_proj.weight" in muon.muon_names
    assert "talker.code_predictor.model.layers.1.mlp.down_proj.weight" in muon.muon_names


# --------------------------------------------------------------------------------------------- loading
def test_save_load_round_trip_under_official_names(tmp_path):
    model = _tiny(tmp_path, seed=3)
    out = tmp_path / "export"
    model.save_pretrained(out)
    stored = load_file(str(out / "model.safetensors"))
    assert set(stored) == set(official_tensors(_config("tiny")))
    config = json.loads((out / "config.json").read_text())
    assert config["talker_config"]["code_predictor_config"]["hidden_size"] == 24
    assert config["talker_config"]["codec_eos_token_id"] == 42  # the ids travel unchanged
    loaded = _build(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    torch.testing.assert_close(
        loaded.talker.model.rotary_emb.inv_freq, model.talker.model.rotary_emb.inv_freq, rtol=0, atol=0
    )
    batch = _batch()
    assert torch.equal(loaded(**batch).loss, model(**batch).loss)


def test_loading_is_strict_and_skips_only_the_speaker_encoder(tmp_path):
    model = _tiny(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    base = _folder(tmp_path / "base", _config("tiny"))
    extra = {name: torch.zeros(2) for name in speaker_encoder_names()}
    save_file({**state, **extra}, str(base / "model.safetensors"))
    loaded = _build(base)  # a Base checkpoint: the speaker encoder is skipped
    assert torch.equal(loaded.talker.codec_head.weight, model.talker.codec_head.weight)

    bad = _folder(tmp_path / "unexpected", _config("tiny"))
    save_file({**state, "talker.mystery.weight": torch.zeros(1)}, str(bad / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"does not have \(talker\.mystery\.weight\)"):
        _build(bad)

    gone = _folder(tmp_path / "missing", _config("tiny"))
    save_file(
        {k: v for k, v in state.items() if k != "talker.codec_head.weight"}, str(gone / "model.safetensors")
    )
    with pytest.raises(ConfigError, match=r"lacks 1 tensors of the model \(talker\.codec_head\.weight\)"):
        _build(gone)

    shape = _folder(tmp_path / "shape", _config("tiny"))
    save_file({**state, "talker.codec_head.weight": torch.zeros(3, 3)}, str(shape / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"talker\.codec_head\.weight has shape \(3, 3\)"):
        _build(shape)


def test_sharded_index_loads(tmp_path):
    model = _tiny(tmp_path, seed=5)
    folder = _folder(tmp_path / "sharded", _config("tiny"))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: state[n] for n in part}, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = _build(folder)
    assert all(torch.equal(loaded.state_dict()[n], state[n]) for n in names)


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"config_overrides\.talker_config\.hiden_size: unknown key"):
        _tiny(tmp_path, talker_config={"hiden_size": 8})
    with pytest.raises(ConfigError, match=r"code_predictor_config\.num_code_groups"):
        _tiny(tmp_path, talker_config={"code_predictor_config": {"num_code_groups": 5}})
    with pytest.raises(ConfigError, match="rope_type"):
        _tiny(tmp_path, talker_config={"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    folder = _folder(tmp_path / "codec", {"model_type": "qwen3_tts_tokenizer_12hz"})
    with pytest.raises(ConfigError, match="speech_tokenizer"):
        _build(folder, from_scratch=True)


# --------------------------------------------------------------------------------------------- losses
PREFIX = [1, 7, 8]  # <|im_start|> assistant \n


def _sample(text: list[int], frames: int, seed: int, vector: bool) -> dict[str, torch.Tensor]:
    """The tracks of one sample (the layout of mm-data-audio's tts_codes: role, think slots, speaker slot,
    tts_bos, text, tts_eos, codec_bos, frames, codec_eos)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 32, (frames, 4), generator=g)
    control = [44, 45, 46] + ([40] if vector else [])
    text_track = [*PREFIX, *[3] * len(control), 4, *text, 5] + [3] * (frames + 2)
    codec = [0] * 3 + control + [40] * (len(text) + 2) + [41] + codes[:, 0].tolist() + [42]
    n, first = len(text_track), 3 + len(control) + len(text) + 3
    codec_mask = torch.tensor([0] * 3 + [1] * (n - 3))
    frame_mask = torch.zeros(n, dtype=torch.long)
    frame_mask[first : first + frames] = 1
    labels = torch.full((n,), -100)
    labels[first : first + frames] = codes[:, 0]
    labels[first + frames] = 42
    all_codes = torch.zeros(n, 4, dtype=torch.long)
    all_codes[first : first + frames] = codes
    slot = torch.zeros(n, dtype=torch.long)
    if vector:
        slot[3 + 3] = 1
        codec_mask[3 + 3] = 0
    return {
        "input_ids": torch.tensor(text_track),
        "codec_ids": torch.tensor(codec),
        "codec_mask": codec_mask,
        "frame_mask": frame_mask,
        "labels": labels,
        "codes": all_codes,
        "speaker_slot": slot,
    }


def _collate(samples: list[dict[str, torch.Tensor]], vectors: bool) -> dict[str, torch.Tensor]:
    """Right-pad samples into a batch (as the tts_codes collator does)."""
    width = max(len(s["input_ids"]) for s in samples)
    pads = {
        "input_ids": 3,
        "codec_ids": 0,
        "codec_mask": 0,
        "frame_mask": 0,
        "labels": -100,
        "speaker_slot": 0,
    }
    batch = {
        k: torch.stack([F.pad(s[k], (0, width - len(s[k])), value=v) for s in samples])
        for k, v in pads.items()
    }
    batch["codes"] = torch.stack([F.pad(s["codes"], (0, 0, 0, width - len(s["codes"]))) for s in samples])
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    batch["attention_mask"] = (torch.arange(width)[None] < lengths[:, None]).long()
    if vectors:
        batch["speaker_vectors"] = torch.randn(len(samples), 32, generator=torch.Generator().manual_seed(9))
    else:
        del batch["speaker_slot"]
    return batch


def _batch() -> dict[str, torch.Tensor]:
    return _collate(
        [_sample([20, 21, 22, 23], 5, 1, vector=True), _sample([30, 31], 3, 2, vector=False)], True
    )


def _reference(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both losses, one sample and one frame at a time, from the spec's definitions."""
    talker, predictor = model.talker, model.talker.code_predictor
    talker_losses, code_losses = [], []
    for b in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][b].sum())
        ids, codec = batch["input_ids"][b, :n], batch["codec_ids"][b, :n]
        frames = batch["frame_mask"][b, :n].bool()
        x = talker.text_projection(talker.model.text_embedding(ids))  # projected text track everywhere
        rows = []
        for p in range(n):
            row = x[p]
            if batch["speaker_slot"][b, p]:
                row = row + batch["speaker_vectors"][b]  # the x-vector replaces the codec track
            elif p >= len(PREFIX):
                row = row + talker.model.codec_embedding(codec[p])
            if frames[p]:
                for j in range(1, 4):
                    row = row + predictor.model.codec_embedding[j - 1](batch["codes"][b, p, j])
            rows.append(row)
        hidden = talker.model.decode(torch.stack(rows)[None], None, torch.arange(n)[None])[0]
        labels = batch["labels"][b, :n]
        targets = [p for p in range(1, n) if labels[p] != -100]
        logits = talker.codec_head(hidden[[p - 1 for p in targets]])  # the state before predicts
        talker_losses.append(F.cross_entropy(logits, labels[targets]))
        per_frame = []
        for p in frames.nonzero()[:, 0].tolist():
            c = batch["codes"][b, p]
            seq = [hidden[p - 1], talker.model.codec_embedding(c[0])]
            seq += [predictor.model.codec_embedding[j - 1](c[j]) for j in (1, 2)]
            y = predictor.model.decode(
                predictor.small_to_mtp_projection(torch.stack(seq))[None], None, torch.arange(4)[None]
            )[0]
            logits = torch.stack(
                [predictor.lm_head[j - 1](y[j]) for j in (1, 2, 3)]
            )  # position j -> codebook j
            per_frame.append(F.cross_entropy(logits, c[1:], reduction="none"))
        code_losses.append(torch.cat(per_frame).mean())
    return torch.stack(talker_losses).mean(), torch.stack(code_losses).mean()


def test_losses_match_the_frame_by_frame_reference(tmp_path):
    model = _tiny(tmp_path, seed=1).eval()
    batch = _batch()
    out = model(**batch)
    talker, code = _reference(model, batch)
    torch.testing.assert_close(out.talker_loss, talker, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.code_predictor_loss, code, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, talker + 0.3 * code, rtol=1e-5, atol=1e-6)
    weighted = _tiny(tmp_path, seed=1, code_predictor_loss_weight=0.5).eval()(**batch)
    torch.testing.assert_close(weighted.loss, weighted.talker_loss + 0.5 * weighted.code_predictor_loss)
    # a sample's loss does not depend on its batch mates (padding, the other sample's length)
    alone = _collate([_sample([30, 31], 3, 2, vector=False)], False)
    ref = _reference(model, {**alone, "speaker_slot": torch.zeros_like(alone["input_ids"])})
    torch.testing.assert_close(model(**alone).talker_loss, ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model(**alone).code_predictor_loss, ref[1], rtol=1e-5, atol=1e-6)


def test_losses_train_every_parameter(tmp_path):
    model = _tiny(tmp_path, seed=2)
    model(**_batch()).loss.backward()
    untouched = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()]
    assert untouched == []


# --------------------------------------------------------------------------------------------- meta init
def test_meta_init_initialises_everything(tmp_path):
    folder = _folder(tmp_path / "meta", _config("tiny"))
    args = ModelConfig(model_id="qwen3_tts", model_name_or_path=str(folder), from_scratch=True)
    model = ModelHub.build(args, meta=True)
    assert next(model.parameters()).is_meta
    materialize_meta(model, torch.device("cpu"), init=True)  # NaN-fills first: anything missed is caught
    check_initialised(model)
    fresh = _tiny(tmp_path)
    for stack in ("model", "code_predictor.model"):
        rotary = model.get_submodule(f"talker.{stack}.rotary_emb")
        assert torch.equal(rotary.inv_freq, fresh.get_submodule(f"talker.{stack}.rotary_emb").inv_freq)
    norm = model.talker.model.layers[0].self_attn.q_norm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    assert torch.isfinite(model(**_batch()).loss)
