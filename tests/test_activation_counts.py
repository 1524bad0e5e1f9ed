"""``mm check``'s activation counts for the real-size cases that are not plain decoder language models
(LTX-2's audio-video diffusion transformer, Qwen3-TTS's talker and code predictor, CosyVoice3's LM with its
speech head) and for decoders whose MoE layers sit beside a dense ``intermediate_size``: a tiny instance of
each runs one forward and its loss in bf16, and the bytes of the tensors autograd's saved-tensor hooks see are
compared with the count (:mod:`mm_core.parallel.layer_bytes`, the models' ``ModelPlan.activations``), within
1%. The count leaves out only small per-row or per-sample tensors it does not model (token ids, a sample's
loss weight); each test also checks how the recompute plan applies to the count's layers."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from _cosyvoice import TINY_LM
from _tiny import QWEN3_MOE
from _video import TINY_LTX2
from test_memory_estimate import _cfg, _measure, _plan

from mm_core.models.hub import ModelHub
from mm_core.parallel.estimate import activation_count, estimate_activations
from mm_core.parallel.layer_bytes import ActivationCount
from mm_core.parallel.memory import apply_chunked_loss
from mm_core.train.loss import loss_sum, shift_labels

#: the count against autograd's saved tensors, both ways
TOLERANCE = 0.01


def _bf16_cfg(model_id: str, overrides: dict, tokens: int, *more: str):
    """The quickstart with ``model_id`` at tiny ``overrides``, ``tokens`` per micro-batch, bf16 compute."""
    return _cfg(
        f"data.dataset_param.basic_parameters.seq_len={tokens}",
        "training.micro_batch_size=1",
        f"model.model_id={model_id}",
        "model.model_name_or_path=null",
        f"model.config_overrides={json.dumps(overrides)}",
        "parallel.fsdp_plan.apply_modules=[]",
        "parallel.fsdp_plan.param_dtype=bf16",
        *more,
    )


def _build(cfg, meta: bool = False):
    torch.manual_seed(0)
    model = ModelHub.build(cfg.model.model_copy(update={"from_scratch": True}), meta=meta)
    return model if meta else model.to(torch.bfloat16)


def _total(count: ActivationCount) -> float:
    """Every byte of a count without recompute."""
    return count.outside + sum(layer.saved for layer in count.layers.values())


def _close(estimated: float, measured: int) -> None:
    assert abs(estimated - measured) <= TOLERANCE * measured, (estimated, measured, estimated / measured - 1)


def _check_recompute(cfg_of, tokens: int) -> None:
    """Under full recompute (the model plan's units) every layer of the count keeps its inputs, and one layer
    and its gradients come back in backward."""
    meta = _build(cfg_of(), meta=True)
    recompute = cfg_of("model.recompute=true")
    plan = _plan(meta, recompute)
    count = activation_count(meta, plan, tokens)
    assert count is not None and set(plan.memory.recompute) == set(count.layers)
    acts, transient = estimate_activations(meta, plan, tokens)
    assert acts == count.outside + sum(layer.inputs for layer in count.layers.values())
    biggest = max(layer.saved for layer in count.layers.values())
    assert transient == max(count.forward_peak, count.backward_start + 2 * biggest)


def test_moe_layers_are_counted_with_their_experts():
    """Qwen3-MoE whose configuration also has a dense ``intermediate_size`` (as Qwen3-VL-MoE's, Omni's and
    Kimi's do; here ten times the MoE width): each MoE layer is counted with its top-k experts' copies and
    router, not as a dense MLP of that width (which would count 2.7 times the MLP's bytes)."""
    tokens = 100
    overrides = {**QWEN3_MOE, "vocab_size": 256, "intermediate_size": 256, "moe_intermediate_size": 24}
    cfg = _bf16_cfg("qwen3_moe", overrides, tokens)
    model = _build(cfg)
    plan = _plan(model, cfg)
    estimated, _ = estimate_activations(model, plan, tokens)
    head = apply_chunked_loss(model, plan.chunked)
    assert head is not None
    ids = torch.randint(0, 256, (1, tokens))

    def forward_loss(ids):
        with head.computing_loss(shift_labels(ids)):
            return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits

    _close(estimated, _measure(model, ids, forward_loss))


@pytest.mark.parametrize("chunked", [False, True])
def test_cosyvoice3_lm_count_equals_saved_tensors(chunked):
    """CosyVoice3's LM: Qwen2 layers without q/k norms, two embedding lookups, and the loss over
    ``llm_decoder``'s speech rows (Qwen2's 320-row ``lm_head`` is unused), with full logits and chunked."""
    tokens = 100

    def cfg_of(*more: str):
        flag = f"model.loss_cfg.chunked_loss={str(chunked).lower()}"
        return _bf16_cfg("cosyvoice3_lm", TINY_LM, tokens, flag, *more)

    cfg = cfg_of()
    model = _build(cfg)
    plan = _plan(model, cfg)
    estimated, _ = estimate_activations(model, plan, tokens)
    head = apply_chunked_loss(model, plan.chunked)
    assert (head is not None) == chunked
    ids = torch.randint(0, TINY_LM["speech_vocab"], (2, tokens // 2))
    speech = torch.zeros_like(ids, dtype=torch.bool)
    speech[:, 20:] = True  # text, then speech tokens

    def forward_loss(ids):
        batch = {"input_ids": ids, "speech_mask": speech, "attention_mask": torch.ones_like(ids)}
        if head is None:
            return loss_sum(model(**batch).logits, shift_labels(ids), "per_token_loss")
        with head.computing_loss(shift_labels(ids)):
            return model(**batch).logits

    _close(estimated, _measure(model, ids, forward_loss))
    _check_recompute(cfg_of, tokens)


#: a tiny Qwen3-TTS: talker and code predictor of different widths (so the projection between them exists, as
#: in the 1.7B model), 4 codebooks
TTS = {
    "talker_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 64,
        "text_vocab_size": 320,
        "text_hidden_size": 48,
        "num_code_groups": 4,
        "code_predictor_config": {
            "hidden_size": 24,
            "intermediate_size": 40,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "vocab_size": 32,
        },
    }
}


def test_qwen3_tts_count_equals_saved_tensors():
    """Qwen3-TTS: 2 samples of 40 positions, 29 frames each (58 code-predictor sequences of 4 positions) and a
    ``codec_eos`` label each: the count for those frames and labels equals what autograd keeps; the estimate
    of ``mm check`` takes every position for a frame and a label (an upper bound)."""
    from mm_models_qwen.qwen3_tts_activations import tts_activations

    batch, positions, groups = 2, 40, 4
    cfg = _bf16_cfg("qwen3_tts", TTS, batch * positions, "model.loss_cfg.loss_type=raw")
    model = _build(cfg)
    ids = torch.randint(0, 320, (batch, positions))
    codec_mask = torch.ones_like(ids)
    codec_mask[:, :3] = 0  # the role tokens have no codec track
    frames = torch.zeros_like(ids)
    frames[:, 10:39] = 1
    codes = torch.randint(0, 32, (batch, positions, groups)) * frames[..., None]
    labels = torch.full_like(ids, -100)
    labels[:, 10:39] = codes[:, 10:39, 0]
    labels[:, 39] = 42  # codec_eos
    inputs = {"attention_mask": torch.ones_like(ids), "codec_ids": torch.randint(0, 40, ids.shape)}
    inputs.update(codec_mask=codec_mask, codes=codes, frame_mask=frames, labels=labels)
    measured = _measure(model, ids, lambda ids: model(ids, **inputs).loss)
    n_frames = int(frames.sum())
    exact = tts_activations(model.config, batch * positions, n_frames, n_frames + batch, 2)
    _close(_total(exact), measured)
    estimated, _ = estimate_activations(model, _plan(model, cfg), batch * positions)
    assert estimated > measured  # every position a frame
    _check_recompute(
        lambda *more: _bf16_cfg("qwen3_tts", TTS, batch * positions, "model.loss_cfg.loss_type=raw", *more),
        batch * positions,
    )


def _ltx2_batch(audio: bool) -> dict:
    """One sample: 3 latent frames of 4 x 4 (48 video tokens), 5 audio latent frames, 6 text tokens (2 of
    them padding)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[:, 4:] = 0
    batch = {
        "latents": torch.randn(1, 8, 3, 4, 4, generator=g).to(torch.bfloat16),
        "encoder_hidden_states": torch.randn(1, 6, 12, generator=g),
        "noise_seed": [1],
        "encoder_attention_mask": mask,
    }
    if audio:
        batch["audio_latents"] = torch.randn(1, 2, 5, 4, generator=g).to(torch.bfloat16)
        batch["audio_encoder_hidden_states"] = torch.randn(1, 6, 12, generator=g)
    return batch


@pytest.mark.parametrize("audio", [True, False], ids=["audio_video", "text_to_video"])
def test_ltx2_count_equals_saved_tensors(audio):
    """LTX-2's blocks (video and audio self-attention, text cross-attention, audio-video attention both ways,
    feed-forwards, modulation) and what runs around them, with audio and text-to-video (one placeholder audio
    token, no audio-video attention); and under Ulysses 2, run on torch's fake process group (its collectives
    return at once: the bytes kept are those of a real rank)."""
    from mm_models_video.ltx2_activations import ltx2_activations

    tokens = 48

    def cfg_of(*more: str):
        return _bf16_cfg("ltx2", TINY_LTX2, tokens, "model.loss_cfg.loss_type=raw", *more)

    cfg = cfg_of()
    model = _build(cfg)
    batch = _ltx2_batch(audio)
    measured = _measure(model, None, lambda _: model(**batch).loss)
    count = ltx2_activations(model.config, 48, 5 if audio else 1, 6, 2, "cpu", cross_modal=audio)
    _close(_total(count), measured)
    _check_recompute(cfg_of, tokens)
    if not audio:
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model.use_context_parallel(init_device_mesh("cpu", (1, 2), mesh_dim_names=("ring", "ulysses")))
        measured = _measure(model, None, lambda _: model(**batch).loss)
    finally:
        dist.destroy_process_group()
    _close(_total(ltx2_activations(model.config, 48, 5, 6, 2, "cpu", ulysses=2)), measured)
