"""Fun-ASR-Nano builds from a tiny config (on the meta device too), its default plans match real modules (FSMN
convolutions never take Muon), a forward with audio returns a finite loss with one audio row per audio token
and calls its output head once, and the idle-audio-tower rule changes no loss and gives every audio parameter
a (zero) gradient."""

from __future__ import annotations

import torch
from torch import nn

from mm_core.config.schema import ModelConfig, TrainingConfig
from mm_core.models import ModelHub, plan_of
from mm_core.optim.muon import muon_plan
from mm_core.parallel.apply import materialize_meta
from mm_models_funasr.fun_asr_nano import FunAsrNanoForTraining
from mm_parallel.patterns import match_modules

AUDIO = 5
#: encoder d_model 32, 2 layers (the last a "timestamp" layer); adaptor at the text width 64 (intermediate
#: 64 // 4); Qwen3 text 2 layers
OVERRIDES = {
    "audio_config": {
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_timestamp_prediction_layers": 1,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "max_position_embeddings": 129,
        "fsmn_kernel_size": 5,
    },
    "adaptor_config": {
        "hidden_size": 64,
        "intermediate_size": 16,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "projector_hidden_size": 48,
    },
    "text_config": {
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
    "audio_token_id": AUDIO,
}
ARGS = ModelConfig(model_id="fun_asr_nano", from_scratch=True, config_overrides=OVERRIDES)


def batch(rows: tuple[int, ...] = (7, 4)) -> dict[str, torch.Tensor]:
    """Two samples, one clip each (``rows`` LFR rows), text around the audio tokens."""
    g = torch.Generator().manual_seed(0)
    width = max(rows)
    feats = torch.randn(len(rows), width, 560, generator=g)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    ids = []
    for i, r in enumerate(rows):
        mask[i, :r] = 1
        ids.append(
            torch.cat(
                [torch.tensor([10, 11]), torch.full((r,), AUDIO), torch.randint(12, 90, (6,), generator=g)]
            )
        )
    length = max(len(x) for x in ids)
    input_ids = torch.stack([torch.nn.functional.pad(x, (0, length - len(x))) for x in ids])
    labels = input_ids.masked_fill(input_ids == AUDIO, -100)
    return {"input_ids": input_ids, "labels": labels, "input_features": feats, "input_features_mask": mask}


def test_default_plans_match_modules() -> None:
    model = ModelHub.build(ARGS)
    assert type(model) is FunAsrNanoForTraining
    plan = plan_of(model)
    units = match_modules(model, list(plan.fsdp_units))
    assert units == {
        "model.audio_tower.layers.{*}": ["model.audio_tower.layers.0", "model.audio_tower.layers.1"],
        "model.language_model.layers.{*}": ["model.language_model.layers.0", "model.language_model.layers.1"],
    }
    assert plan.recompute_units == plan.fsdp_units
    assert plan.cp_split_module == "model.language_model"
    fsmn = match_modules(model, list(plan.muon_exclude_modules))[
        "model.audio_tower.layers.{*}.self_attn.fsmn"
    ]
    assert len(fsmn) == 2
    split = muon_plan(model, TrainingConfig(train_iters=1), plan)
    decided = {d.name: d for d in split.decisions}
    conv = decided["model.audio_tower.layers.0.self_attn.fsmn.conv.weight"]
    assert conv.shape == (32, 1, 5) and not conv.use_muon
    assert decided["model.audio_tower.layers.0.self_attn.q_proj.weight"].use_muon
    assert not decided["model.language_model.embed_tokens.weight"].use_muon
    head = dict(model.named_modules())[plan.output_head]
    assert isinstance(head, nn.Linear) and head is model.get_output_embeddings()


def test_meta_init_initialises_every_tensor() -> None:
    model = ModelHub.build(ARGS, meta=True)
    assert next(model.parameters()).device.type == "meta"
    materialize_meta(model, torch.device("cpu"), init=True)  # raises on any NaN left
    table = model.model.audio_tower.position_embeddings
    assert torch.equal(table.positional_embedding, table.compute_default_singular_positional_embedding())


def test_forward_with_audio_uses_one_row_per_audio_token_and_the_head_once() -> None:
    model = ModelHub.build(ARGS)
    calls = []
    model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    out = model(**batch())
    assert torch.isfinite(out.loss) and len(calls) == 1
    assert out.audio_hidden_states.shape == (11, 64)  # 7 + 4 valid rows
    short = batch()
    short["input_features_mask"][0, 6] = 0  # one audio row fewer than audio tokens
    try:
        model(**short)
    except ValueError as exc:  # transformers' placeholder check
        assert "do not match" in str(exc)
    else:
        raise AssertionError("a token/row mismatch was accepted")


def test_idle_audio_tower_changes_no_loss_and_reaches_every_audio_parameter() -> None:
    model = ModelHub.build(ARGS)
    text = {k: v for k, v in batch().items() if not k.startswith("input_features")}
    text["input_ids"] = text["input_ids"].masked_fill(text["input_ids"] == AUDIO, 20)
    text["labels"] = text["input_ids"]
    model.eval()
    with torch.no_grad():
        plain = model(**text).loss
    model.train()
    out = model(**text)
    assert torch.allclose(out.loss, plain)
    out.loss.backward()
    for prefix in ("model.audio_tower.", "model.multi_modal_projector."):
        for name, p in model.named_parameters():
            if name.startswith(prefix):
                assert p.grad is not None and not p.grad.any(), name
