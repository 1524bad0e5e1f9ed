"""The speech store, the log-mel and the ``cosyvoice_speech`` dataset / collators of every stage."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _speech_fixtures import VOCAB, sine, store, tokenizer, utterances

from mm_core.errors import ConfigError, DataError
from mm_data_audio.cosyvoice.audio import log_mel, mel_filterbank, read_wav
from mm_data_audio.cosyvoice.data import (
    CosyVoiceFlowCollator,
    CosyVoiceLMCollator,
    CosyVoiceSpeechDataset,
    CosyVoiceVocoderCollator,
    noise_seed,
)
from mm_data_audio.cosyvoice.sequence import lm_sequence
from mm_data_audio.cosyvoice.store import Utterance, read_index, read_meta, write_store


# ------------------------------------------------------------------------------------------------ log-mel
def _numpy_log_mel(wave: np.ndarray) -> np.ndarray:
    """The Matcha-style log-mel written out frame by frame (numpy FFT, periodic Hann)."""
    padded = np.pad(wave.astype(np.float64), (720, 720), mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(1920) / 1920)
    n = (len(padded) - 1920) // 480 + 1
    frames = np.stack([padded[i * 480 : i * 480 + 1920] * window for i in range(n)])
    spec = np.fft.rfft(frames, axis=-1)
    mag = np.sqrt(spec.real**2 + spec.imag**2 + 1e-9)
    return np.log(np.clip(mag @ mel_filterbank().astype(np.float64).T, 1e-5, None))


def test_log_mel_shapes_and_values():
    wave = torch.from_numpy(sine(5).astype(np.float32)) + 0.01 * torch.randn(4800)
    mel = log_mel(wave)
    assert mel.shape == (10, 80) and mel.dtype == torch.float32  # T = samples / 480
    np.testing.assert_allclose(mel.numpy(), _numpy_log_mel(wave.numpy()), atol=2e-4)
    batch = log_mel(torch.stack([wave, wave.flip(0)]))
    assert batch.shape == (2, 10, 80)
    torch.testing.assert_close(batch[0], mel)
    with pytest.raises(ValueError, match="reflect padding"):
        log_mel(torch.zeros(500))


def test_mel_filterbank_is_librosas():
    librosa = pytest.importorskip("librosa")
    ref = librosa.filters.mel(sr=24000, n_fft=1920, n_mels=80, fmin=0, fmax=None)
    np.testing.assert_allclose(mel_filterbank(), ref, atol=1e-7)


# ------------------------------------------------------------------------------------------------- store
def test_write_store_and_read_it_back(tmp_path):
    root = store(tmp_path / "s")
    meta = read_meta(root)
    assert meta.speech_vocab == VOCAB and meta.to_json()["hop"] == 480
    records = read_index(root)
    assert [r.id for r in records] == ["u0", "u1", "u2", "u3"]
    assert records[0].speaker is None and records[1].speaker is not None
    for r, utt in zip(records, utterances()):
        tokens = np.load(r.speech_tokens)
        mel = np.load(r.mel)
        wave = read_wav(r.audio)
        assert tokens.dtype == np.int64 and np.array_equal(tokens, utt.speech_tokens)
        assert len(wave) == 960 * len(tokens) and mel.shape == (2 * len(tokens), 80)
        np.testing.assert_allclose(mel, log_mel(torch.from_numpy(wave)).numpy(), atol=1e-6)
    line = json.loads((root / "index.jsonl").read_text().splitlines()[1])
    assert line == {
        "id": "u1",
        "text": "hello world 1",
        "audio": "wavs/u1.wav",
        "speech_tokens": "tokens/u1.npy",
        "mel": "mels/u1.npy",
        "speaker": "spk/u1.npy",
    }


def test_write_store_fits_the_wave_to_the_tokens_and_refuses_mismatches(tmp_path):
    tokens = np.arange(5)
    root = write_store(tmp_path / "a", [Utterance("a", "x", sine(5)[:-100], tokens)], VOCAB)
    assert len(read_wav(root / "wavs/a.wav")) == 4800  # zero-padded to 960 per token
    with pytest.raises(ValueError, match="do not belong to this wave"):
        write_store(tmp_path / "b", [Utterance("a", "x", sine(9), tokens)], VOCAB)
    with pytest.raises(ValueError, match=r"must be in \[0, 40\)"):
        write_store(tmp_path / "c", [Utterance("a", "x", sine(5), tokens + 38)], VOCAB)
    with pytest.raises(ValueError, match="used twice"):
        write_store(tmp_path / "d", [Utterance("a", "x", sine(5), tokens)] * 2, VOCAB)
    with pytest.raises(ValueError, match="names the files"):
        write_store(tmp_path / "e", [Utterance("a/b", "x", sine(5), tokens)], VOCAB)


def _rewrite(root, line_no, **changes):
    lines = (root / "index.jsonl").read_text().splitlines()
    obj = json.loads(lines[line_no - 1])
    obj.update(changes)
    lines[line_no - 1] = json.dumps(obj)
    (root / "index.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mel": "../x.npy"}, r"index.jsonl:2 \(u1\): mel must be a path inside the store"),
        ({"id": "u0"}, r"index.jsonl:2 \(u0\): id 'u0' is also at .*index.jsonl:1"),
        ({"text": 3}, r"index.jsonl:2 \(u1\): text must be a string"),
    ],
)
def test_read_index_names_the_bad_line(tmp_path, change, message):
    root = store(tmp_path / "s")
    _rewrite(root, 2, **change)
    with pytest.raises(DataError, match=message):
        read_index(root)


def test_read_meta_refuses_another_layout(tmp_path):
    root = store(tmp_path / "s")
    (root / "meta.json").write_text(json.dumps({"speech_vocab": VOCAB, "hop": 256}))
    with pytest.raises(DataError, match="hop is 256; CosyVoice3 stores hold hop 480"):
        read_meta(root)


# ----------------------------------------------------------------------------------------------- dataset
def _dataset(root, stage, tok=None, **basic):
    pre = {"model_name_or_path": str(tok)} if tok else {}
    return CosyVoiceSpeechDataset({"dataset": str(root), "stage": stage, **basic}, pre, None, seed=3)


def test_lm_samples_are_the_assembled_rows(tmp_path):
    root, tok = store(tmp_path / "s"), tokenizer(tmp_path / "tok")
    ds = _dataset(root, "lm", tok)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok)
    instruct = hf.encode("You are a helpful assistant.<|endofprompt|>", add_special_tokens=False)
    assert instruct[-1] == hf.convert_tokens_to_ids("<|endofprompt|>")  # the special token stays one id
    sample = ds[2]
    want = lm_sequence(
        instruct,
        hf.encode("hello world 2", add_special_tokens=False),
        utterances()[2].speech_tokens.tolist(),
        VOCAB,
    )
    assert torch.equal(sample["input_ids"], want.input_ids) and torch.equal(sample["labels"], want.labels)
    assert torch.equal(sample["speech_mask"], want.speech_mask)
    assert sample["noise_seed"] == noise_seed(3, 0, 2) and sample["sample_id"] == 2
    assert ds.sample_lengths().tolist() == [len(ds[i]["input_ids"]) for i in range(len(ds))]
    batch = CosyVoiceLMCollator({"collator_id": "cosyvoice_lm"}, ds)([ds[0], ds[3]])
    n0, n3 = len(ds[0]["input_ids"]), len(ds[3]["input_ids"])
    assert batch["input_ids"].shape == (2, n3) and batch["speech_mask"].dtype == torch.bool
    assert batch["attention_mask"].sum(1).tolist() == [n0, n3]
    assert (batch["labels"][0, n0:] == -100).all() and not batch["speech_mask"][0, n0:].any()
    with pytest.raises(ConfigError, match="preprocess_parameters.model_name_or_path: missing"):
        _dataset(root, "lm")


def test_lm_bistream_coin_comes_from_the_seed(tmp_path):
    root, tok = store(tmp_path / "s"), tokenizer(tmp_path / "tok")
    # a text of few tokens and many speech tokens: eligible for bi-stream
    write_store(
        tmp_path / "long",
        [Utterance(f"l{i}", "hello", sine(40), np.arange(40) % VOCAB) for i in range(16)],
        VOCAB,
    )
    ds = _dataset(tmp_path / "long", "lm", tok, bistream_prob=0.5, mix_ratio=[1, 3])
    fill = VOCAB + 3
    mixed = [bool((ds[i]["labels"] == fill).any()) for i in range(len(ds))]
    assert 0 < sum(mixed) < len(ds)  # about half, and the same again
    assert mixed == [bool((ds[i]["labels"] == fill).any()) for i in range(len(ds))]
    ds.set_epoch(1)
    assert mixed != [bool((ds[i]["labels"] == fill).any()) for i in range(len(ds))]
    assert not any((_dataset(root, "lm", tok)[i]["labels"] == fill).any() for i in range(4))  # off by default


def test_flow_samples_and_collator(tmp_path):
    ds = _dataset(store(tmp_path / "s"), "flow")
    s1 = ds[1]
    assert s1["speech_tokens"].tolist() == utterances()[1].speech_tokens.tolist()
    assert s1["mel"].shape == (18, 80) and s1["speaker"].shape == (192,)
    assert torch.equal(ds[0]["speaker"], torch.zeros(192))  # no embedding: zeros
    assert ds.sample_lengths().tolist() == [12, 18, 24, 30]
    batch = CosyVoiceFlowCollator({}, ds)([ds[0], ds[2]])
    assert batch["speech_tokens"].shape == (2, 12) and batch["mel"].shape == (2, 24, 80)
    assert batch["speech_lengths"].tolist() == [6, 12] and batch["mel_lengths"].tolist() == [12, 24]
    assert (batch["mel"][0, 12:] == 0).all() and batch["noise_seed"] == [
        ds[0]["noise_seed"],
        ds[2]["noise_seed"],
    ]
    with pytest.raises(DataError, match="lacks speech_tokens, mel, speaker.*stage of this collator"):
        CosyVoiceFlowCollator({}, ds)([{"sample_id": 0}])


def test_vocoder_crops_are_seeded_slices(tmp_path):
    root = store(tmp_path / "s")
    ds = _dataset(root, "vocoder", segment_samples=4800)
    wave = torch.from_numpy(read_wav(root / "wavs/u3.wav"))  # 15 tokens = 14400 samples
    crop = ds[3]["audio"]
    assert crop.shape == (4800,) and ds[3]["mel"].shape == (10, 80)
    start = next(i for i in range(len(wave) - 4799) if torch.equal(wave[i : i + 4800], crop))
    torch.testing.assert_close(ds[3]["mel"], log_mel(crop))
    assert torch.equal(ds[3]["audio"], crop)  # the same sample, epoch and seed: the same crop
    starts = set()
    for epoch in range(1, 6):
        ds.set_epoch(epoch)
        c = ds[3]["audio"]
        starts.add(next(i for i in range(len(wave) - 4799) if torch.equal(wave[i : i + 4800], c)))
    assert len(starts | {start}) > 1
    short = _dataset(root, "vocoder", segment_samples=9600)[0]["audio"]  # 5760 samples, zero-padded
    assert short.shape == (9600,) and (short[5760:] == 0).all()
    whole = _dataset(root, "vocoder", segment_samples=None)
    batch = CosyVoiceVocoderCollator({}, whole)([whole[0], whole[1]])
    assert batch["audio"].shape == (2, 8640) and batch["audio_lengths"].tolist() == [5760, 8640]
    assert batch["mel_lengths"].tolist() == [12, 18]
    with pytest.raises(ConfigError, match="segment_samples: got 1000; expected a multiple of 480"):
        _dataset(root, "vocoder", segment_samples=1000)


def test_bad_records_are_named_and_skippable(tmp_path):
    root = store(tmp_path / "s")
    np.save(root / "mels/u1.npy", np.zeros((5, 80), dtype=np.float32))
    (root / "tokens/u2.npy").unlink()
    ds = _dataset(root, "flow")
    with pytest.raises(
        DataError, match=r"index.jsonl:2 \(u1\): .*mels/u1.npy holds an array of shape \[5, 80\]"
    ):
        ds[1]
    with pytest.raises(
        DataError, match=r"index.jsonl:3 \(u2\): the speech tokens file .*tokens/u2.npy does not exist"
    ):
        ds[2]

    class Param:
        on_error = "skip"

    skipping = CosyVoiceSpeechDataset({"dataset": str(root), "stage": "flow"}, {}, Param(), seed=3)
    sample = skipping[1]
    assert sample["sample_id"] == 3 and sample["skipped_samples"] == 2
    assert skipping.sample_lengths().tolist() == [12, 30, 30, 30]  # u3 stands in for u1 and u2


def test_stores_of_different_vocabularies_do_not_mix(tmp_path):
    a = store(tmp_path / "a")
    b = write_store(tmp_path / "b", [Utterance("x", "y", sine(5), np.arange(5))], 10)
    with pytest.raises(DataError, match="different speech_vocab"):
        CosyVoiceSpeechDataset({"dataset": [str(a), str(b)], "stage": "flow"}, {}, None)
