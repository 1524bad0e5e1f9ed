"""CosyVoice3's LM stage: the sequence assembly (uni- and bi-stream) against hand-written layouts, the loss
over speech targets only, the official state-dict names, loading (safetensors / official ``llm.pt``), meta
initialisation and sampling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _cosy_fixtures import TINY_LM, VOCAB, lm_args

from mm_core.errors import ConfigError
from mm_core.models import ModelArguments
from mm_core.train.loss import loss_sum, shift_labels
from mm_data_audio.cosyvoice.sequence import bistream_allowed, lm_sequence
from mm_models_cosyvoice.convert import convert_official
from mm_models_cosyvoice.lm import CosyVoice3LMForTraining

IGN = -100
SOS, EOS, TASK, FILL = VOCAB, VOCAB + 1, VOCAB + 2, VOCAB + 3


def official_lm_keys(layers: int) -> dict[str, tuple[str, ...]]:
    """The keys of the official ``llm.pt`` (spec §1.1) with their shapes in symbols (V text vocabulary, H
    hidden, I intermediate, KV key/value width, K speech rows = speech_vocab + 200)."""
    keys: dict[str, tuple[str, ...]] = {"llm.model.model.embed_tokens.weight": ("V", "H")}
    for i in range(layers):
        p = f"llm.model.model.layers.{i}."
        keys.update(
            {
                p + "self_attn.q_proj.weight": ("H", "H"),
                p + "self_attn.q_proj.bias": ("H",),
                p + "self_attn.k_proj.weight": ("KV", "H"),
                p + "self_attn.k_proj.bias": ("KV",),
                p + "self_attn.v_proj.weight": ("KV", "H"),
                p + "self_attn.v_proj.bias": ("KV",),
                p + "self_attn.o_proj.weight": ("H", "H"),
                p + "mlp.gate_proj.weight": ("I", "H"),
                p + "mlp.up_proj.weight": ("I", "H"),
                p + "mlp.down_proj.weight": ("H", "I"),
                p + "input_layernorm.weight": ("H",),
                p + "post_attention_layernorm.weight": ("H",),
            }
        )
    keys.update(
        {
            "llm.model.model.norm.weight": ("H",),
            "llm.model.lm_head.weight": ("V", "H"),
            "speech_embedding.weight": ("K", "H"),
            "llm_decoder.weight": ("K", "H"),
        }
    )
    return keys


def test_state_dict_has_the_official_names_and_shapes():
    model = CosyVoice3LMForTraining._from_config(lm_args())
    sizes = {
        "V": TINY_LM["vocab_size"],
        "H": TINY_LM["hidden_size"],
        "I": TINY_LM["intermediate_size"],
        "KV": TINY_LM["num_key_value_heads"] * TINY_LM["hidden_size"] // TINY_LM["num_attention_heads"],
        "K": VOCAB + 200,
    }
    want = {k: tuple(sizes[s] for s in shape) for k, shape in official_lm_keys(2).items()}
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == want
    # Qwen2's lm_head is the (tied) text embedding, as in CosyVoice-BlankEN; never used by the model
    assert model.llm.model.lm_head.weight is model.llm.model.model.embed_tokens.weight


def test_official_sizes_by_default():
    with torch.device("meta"):
        model = CosyVoice3LMForTraining._from_config(
            ModelArguments(model_id="cosyvoice3_lm", from_scratch=True)
        )
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (
        896,
        24,
        14,
        2,
    )
    assert (c.intermediate_size, c.vocab_size, c.rms_norm_eps) == (4864, 151936, 1e-6)
    assert c.rope_parameters["rope_theta"] == 1e6
    assert model.speech_embedding.weight.shape == (6761, 896) and model.llm_decoder.bias is None


def test_uni_stream_row():
    seq = lm_sequence([1, 2], [3, 4, 5], [7, 8, 9, 10], VOCAB)
    assert seq.input_ids.tolist() == [SOS, 1, 2, 3, 4, 5, TASK, 7, 8, 9, 10, EOS]
    assert seq.speech_mask.tolist() == [True] + [False] * 5 + [True] * 6
    # the label at p is what p - 1 predicts: task -> 7, 7 -> 8, ..., 10 -> eos
    assert seq.labels.tolist() == [IGN] * 7 + [7, 8, 9, 10, EOS]


def test_bi_stream_row():
    text, speech = [3, 4, 5, 6, 7, 8, 9], list(range(30))
    assert bistream_allowed(len(text), len(speech)) and not bistream_allowed(7, 21)
    seq = lm_sequence([1], text, speech, VOCAB, bistream=True)
    s = speech
    assert seq.input_ids.tolist() == [SOS, 1, 3, 4, 5, 6, 7, *s[:15], 8, 9, TASK, *s[15:], EOS]
    assert seq.speech_mask.tolist() == [True, False] + [False] * 5 + [True] * 15 + [False] * 2 + [True] * 17
    # upstream's targets per position: 7 -> s0, s0..s13 -> s1..s14, s14 -> fill, 9's successor task -> s15,
    # s15..s28 -> s16..s29, s29 -> eos; then shifted by one into mm's label convention
    targets = [IGN] * 6 + [s[0]] + s[1:15] + [FILL] + [IGN, IGN] + [s[15]] + s[16:] + [EOS, IGN]
    assert seq.labels.tolist() == [IGN] + targets[:-1]
    with pytest.raises(ValueError, match="bi-stream needs"):
        lm_sequence([1], text, speech[:20], VOCAB, bistream=True)


def test_loss_is_the_mean_cross_entropy_of_the_speech_targets():
    torch.manual_seed(0)
    model = CosyVoice3LMForTraining._from_config(lm_args())
    rows = [lm_sequence([1], [3, 4], [7, 8, 9], VOCAB), lm_sequence([1, 2], [5], [11, 12, 13, 14, 15], VOCAB)]
    n = max(len(r.input_ids) for r in rows)
    ids = torch.zeros(2, n, dtype=torch.long)
    mask = torch.zeros(2, n, dtype=torch.bool)
    labels = torch.full((2, n), IGN)
    attn = torch.zeros(2, n, dtype=torch.long)
    for b, r in enumerate(rows):
        k = len(r.input_ids)
        ids[b, :k], mask[b, :k], labels[b, :k], attn[b, :k] = r.input_ids, r.speech_mask, r.labels, 1
    out = model(input_ids=ids, speech_mask=mask, attention_mask=attn, labels=labels)
    logp = F.log_softmax(out.logits.float(), dim=-1)
    # by hand: row 0 = [sos 1 3 4 task 7 8 9 eos]: positions 4..7 predict 7, 8, 9, eos; row 1 = [sos 1 2 5
    # task 11 .. 15 eos]: positions 4..9 predict 11..15, eos
    terms = [logp[0, p, t] for p, t in zip(range(4, 8), [7, 8, 9, EOS])]
    terms += [logp[1, p, t] for p, t in zip(range(4, 10), [11, 12, 13, 14, 15, EOS])]
    want = -torch.stack(terms).mean()
    torch.testing.assert_close(out.loss, want)
    # mm's token loss from the logits and labels is the same number (loss_type: per_token_loss)
    torch.testing.assert_close(loss_sum(out.logits, shift_labels(labels), "per_token_loss") / 10, want)
    hits = [logp[0, p].argmax() == t for p, t in zip(range(4, 8), [7, 8, 9, EOS])]
    hits += [logp[1, p].argmax() == t for p, t in zip(range(4, 10), [11, 12, 13, 14, 15, EOS])]
    assert out.acc.item() == pytest.approx(sum(bool(h) for h in hits) / 10)
    # the padding of row 0 changes nothing: row 0 alone gives its own terms
    alone = model(
        input_ids=ids[:1, :9], speech_mask=mask[:1, :9], attention_mask=attn[:1, :9], labels=labels[:1, :9]
    )
    torch.testing.assert_close(alone.loss, -torch.stack(terms[:4]).mean(), rtol=1e-5, atol=1e-6)
    # text ids go through Qwen2's table, speech-side ids through speech_embedding
    out.loss.backward()
    assert model.speech_embedding.weight.grad is not None
    speech_rows = model.speech_embedding.weight.grad.abs().sum(-1).nonzero().flatten().tolist()
    assert speech_rows == sorted(
        {7, 8, 9, 11, 12, 13, 14, 15, SOS, TASK}
    )  # the appended eos's output is unused
    text_grad = model.llm.model.model.embed_tokens.weight.grad
    assert text_grad is not None
    text_rows = text_grad.abs().sum(-1).nonzero().flatten().tolist()
    assert set(text_rows) == {1, 2, 3, 4, 5}


def test_save_and_load_both_formats(tmp_path):
    torch.manual_seed(1)
    model = CosyVoice3LMForTraining._from_config(lm_args())
    model.save_pretrained(tmp_path / "ours")
    args = ModelArguments(model_id="cosyvoice3_lm", model_name_or_path=str(tmp_path / "ours"))
    loaded = CosyVoice3LMForTraining.from_pretrained(args)
    assert loaded.speech_vocab == VOCAB
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    # the official layout: llm.pt (a plain state dict) + CosyVoice-BlankEN/config.json
    official = tmp_path / "official"
    (official / "CosyVoice-BlankEN").mkdir(parents=True)
    (official / "CosyVoice-BlankEN" / "config.json").write_text(
        (tmp_path / "ours" / "config.json").read_text()
    )
    torch.save(model.state_dict(), official / "llm.pt")
    args = ModelArguments(model_id="cosyvoice3_lm", model_name_or_path=str(official))
    again = CosyVoice3LMForTraining.from_pretrained(args)
    assert torch.equal(again.llm_decoder.weight, model.llm_decoder.weight)
    with pytest.raises(ConfigError, match="holds llm.pt but no model.safetensors"):
        CosyVoice3LMForTraining._from_config(args)  # a meta-device build would not read llm.pt
    converted = convert_official("cosyvoice3_lm", official, tmp_path / "converted")
    assert sorted(p.name for p in converted.iterdir()) == ["config.json", "model.safetensors"]
    from_converted = ModelArguments(model_id="cosyvoice3_lm", model_name_or_path=str(converted))
    assert torch.equal(
        CosyVoice3LMForTraining.from_pretrained(from_converted).speech_embedding.weight,
        model.speech_embedding.weight,
    )
    state = model.state_dict()
    del state["llm_decoder.weight"]
    torch.save(state, official / "llm.pt")
    with pytest.raises(ConfigError, match=r"llm.pt does not match .*1 missing \(llm_decoder.weight\)"):
        CosyVoice3LMForTraining.from_pretrained(args)
    with pytest.raises(
        ConfigError, match="config_overrides.hidden_sizes: neither speech_vocab nor a Qwen2Config"
    ):
        CosyVoice3LMForTraining._from_config(lm_args(hidden_sizes=3))


def test_meta_build_initialises_every_tensor():
    with torch.device("meta"):
        model = CosyVoice3LMForTraining._from_config(lm_args())
    model.to_empty(device="cpu")
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point():
            t.data.fill_(float("nan"))
    model.init_weights()
    bad = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if torch.isnan(t).any()]
    assert bad == []
    rotary = model.llm.model.model.rotary_emb.inv_freq
    assert rotary[0].item() == 1.0 and rotary[-1].item() < 1.0


def test_generate_samples_speech_tokens_reproducibly():
    torch.manual_seed(2)
    model = CosyVoice3LMForTraining._from_config(lm_args()).eval()
    a = model.generate([1], [3, 4, 5], seed=5)
    assert a == model.generate([1], [3, 4, 5], seed=5)
    assert 6 <= len(a) <= 60 and all(0 <= t < VOCAB for t in a)  # min 2x, max 20x the text tokens
