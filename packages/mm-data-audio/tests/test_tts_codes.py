"""``tts_codes``: Qwen3-TTS samples from text + codec-code records (the official non-streaming layout, ids
from the model folder's config.json), the collator, and errors naming the record's file:line."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from mm_core.errors import ConfigError, DataError
from mm_data_audio.processor_build import build_tts_tokenizer
from mm_data_audio.tts_codes import TTSCodesCollator, TTSCodesDataset
from mm_data_audio.tts_layout import sequence_length

G, CODEBOOK, HIDDEN = 4, 32, 16
CODEC = {"codec_pad_id": 40, "codec_bos_id": 41, "codec_eos_token_id": 42, "codec_think_id": 43}
CODEC |= {"codec_nothink_id": 44, "codec_think_bos_id": 45, "codec_think_eos_id": 46}
CORPUS = ["<|im_start|>assistant\nhello world, a quick brown fox jumps over the lazy dog.<|im_end|>\n"] * 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-TTS model folder: tokenizer + config.json (the official key layout)."""
    out = tmp_path_factory.mktemp("tts_model")
    ids = build_tts_tokenizer(CORPUS, out, vocab_size=300)
    config = {
        "model_type": "qwen3_tts",
        "im_start_token_id": ids["<|im_start|>"],
        "im_end_token_id": ids["<|im_end|>"],
        "tts_pad_token_id": ids["<|tts_pad|>"],
        "tts_bos_token_id": ids["<|tts_bos|>"],
        "tts_eos_token_id": ids["<|tts_eos|>"],
        "talker_config": {
            **CODEC,
            "hidden_size": HIDDEN,
            "vocab_size": 64,
            "text_vocab_size": 320,
            "num_code_groups": G,
            "codec_language_id": {"english": 50, "chinese": 51},
            "spk_id": {"vivian": [60], "ryan": 61},
            "code_predictor_config": {"vocab_size": CODEBOOK, "num_code_groups": G},
        },
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def _codes(root: Path, name: str, frames: int, seed: int = 0, groups: int = G, high: int = CODEBOOK) -> str:
    (root / "codes").mkdir(exist_ok=True)
    codes = np.random.default_rng(seed).integers(0, high, (frames, groups), dtype=np.int64)
    np.save(root / "codes" / name, codes)
    return f"codes/{name}"


def _dataset(folder: Path, root: Path, records: list[dict[str, Any]], **kw: Any) -> TTSCodesDataset:
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    basic = {"dataset_dir": str(root), "dataset": "train.jsonl", **kw.pop("basic", {})}
    return TTSCodesDataset(
        basic, {"model_name_or_path": str(folder)}, SimpleNamespace(on_error=kw.pop("on_error", "raise"))
    )


def test_tracks_follow_the_official_layout(folder, tmp_path):
    np.save(tmp_path / "xvec.npy", np.linspace(-1, 1, HIDDEN, dtype=np.float32))
    records = [
        {"text": "hello world", "codes": _codes(tmp_path, "a.npy", 3)},
        {
            "text": "hello world",
            "codes": _codes(tmp_path, "a.npy", 3),
            "language": "English",
            "speaker": "Vivian",
        },
        {"text": "hello world", "codes": _codes(tmp_path, "a.npy", 3), "speaker": "xvec.npy"},
    ]
    ds = _dataset(folder, tmp_path, records)
    tok = ds.tokenizer
    prefix = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    text = tok("hello world", add_special_tokens=False)["input_ids"]
    codes = np.load(tmp_path / "codes" / "a.npy")
    pad, bos, eos = ds.specials.tts_pad, ds.specials.tts_bos, ds.specials.tts_eos
    p, n, f = len(prefix), len(text), 3

    plain = ds[0]
    assert plain["input_ids"].tolist() == [*prefix, pad, pad, pad, bos, *text, eos, pad, *[pad] * f, pad]
    assert plain["codec_ids"].tolist() == [0] * p + [44, 45, 46] + [40] * (n + 2) + [41, *codes[:, 0], 42]
    assert plain["codec_mask"].tolist() == [0] * p + [1] * (len(plain["input_ids"]) - p)
    first = p + 3 + n + 3
    assert plain["frame_mask"].nonzero()[:, 0].tolist() == list(range(first, first + f))
    assert torch.equal(plain["codes"][first : first + f], torch.from_numpy(codes))
    assert not plain["codes"][:first].any() and not plain["codes"][first + f :].any()
    labels = [-100] * first + [*codes[:, 0], 42]
    assert plain["labels"].tolist() == labels  # unshifted: the model trains position p on labels[p + 1]
    assert "speaker_vector" not in plain

    named = ds[1]  # language: think, think_bos, <lang>, think_eos; speaker: its codec row
    assert named["codec_ids"][p : p + 6].tolist() == [43, 45, 50, 46, 60, 40]
    assert named["input_ids"][p : p + 6].tolist() == [pad] * 5 + [bos]

    vector = ds[2]  # an x-vector slot: no codec row there, the vector goes in its place
    slot = p + 3
    assert vector["speaker_slot"].nonzero()[:, 0].tolist() == [slot]
    assert vector["codec_mask"][slot] == 0
    assert torch.equal(
        vector["speaker_vector"], torch.from_numpy(np.linspace(-1, 1, HIDDEN, dtype=np.float32))
    )

    lengths = ds.sample_lengths()
    assert lengths.tolist() == [len(ds[i]["input_ids"]) for i in range(3)]
    assert lengths[0] == sequence_length(p, n, f, False, False)


def test_collator_pads_every_track(folder, tmp_path):
    np.save(tmp_path / "xvec.npy", np.ones(HIDDEN, dtype=np.float32))
    records = [
        {"text": "hello", "codes": _codes(tmp_path, "a.npy", 2)},
        {"text": "a quick brown fox jumps", "codes": _codes(tmp_path, "b.npy", 5, 1), "speaker": "xvec.npy"},
    ]
    ds = _dataset(folder, tmp_path, records)
    collate = TTSCodesCollator({"collator_id": "tts_codes", "pad_to_multiple_of": 8}, ds)
    samples = [ds[0], ds[1]]
    batch = collate(samples)
    width = batch["input_ids"].shape[1]
    assert width % 8 == 0 and width >= max(len(s["input_ids"]) for s in samples)
    assert batch["codes"].shape == (2, width, G)
    n0 = len(samples[0]["input_ids"])
    assert batch["attention_mask"][0].tolist() == [1] * n0 + [0] * (width - n0)
    assert batch["input_ids"][0, n0:].eq(ds.specials.tts_pad).all()
    assert batch["labels"][0, n0:].eq(-100).all() and not batch["frame_mask"][0, n0:].any()
    assert batch["speaker_vectors"].tolist() == [[0.0] * HIDDEN, [1.0] * HIDDEN]
    assert batch["speaker_slot"][0].sum() == 0 and batch["speaker_slot"][1].sum() == 1
    assert batch["sample_id"].tolist() == [0, 1]
    assert "speaker_vectors" not in collate([ds[0]])
    with pytest.raises(ConfigError, match="tts_codes dataset"):
        TTSCodesCollator({}, [1, 2])


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"codes": "codes/a.npy"}, '"text" must be'),
        ({"text": "hi", "codes": "codes/none.npy"}, "no such codes file"),
        ({"text": "hi", "codes": "codes/a.npy", "language": "klingon"}, "not in codec_language_id"),
        ({"text": "hi", "codes": "codes/a.npy", "speaker": "nobody"}, "not in spk_id"),
        ({"text": "hi", "codes": "codes/a.npy", "speaker": "none.npy"}, "no such speaker x-vector"),
    ],
)
def test_bad_records_name_their_line_when_built(folder, tmp_path, record, message):
    _codes(tmp_path, "a.npy", 2)
    good = {"text": "hello", "codes": "codes/a.npy"}
    with pytest.raises(DataError, match=rf"train\.jsonl:2: .*{message}"):
        _dataset(folder, tmp_path, [good, record])
    ds = _dataset(folder, tmp_path, [good, record], on_error="skip")
    sample = ds[1]  # replaced by the next good record
    assert sample["sample_id"] == 0 and sample["skipped_samples"] == 1


def test_bad_codes_and_texts_name_their_line_when_fetched(folder, tmp_path):
    np.save(tmp_path / "short.npy", np.zeros(HIDDEN - 1, dtype=np.float32))
    (tmp_path / "codes").mkdir()
    np.save(tmp_path / "codes" / "float.npy", np.zeros((3, G), dtype=np.float32))
    records = [
        {"text": "hello", "codes": _codes(tmp_path, "g.npy", 3, groups=G + 1)},
        {"text": "hello", "codes": _codes(tmp_path, "r.npy", 3, high=CODEBOOK + 5, seed=3)},
        {"text": "hello", "codes": "codes/float.npy"},
        {"text": "hello <|tts_eos|> there", "codes": _codes(tmp_path, "ok.npy", 3)},
        {"text": "hello", "codes": "codes/ok.npy", "speaker": "short.npy"},
        {"text": "hello " * 40, "codes": "codes/ok.npy"},
    ]
    ds = _dataset(folder, tmp_path, records, basic={"cutoff_len": 64})
    expected = [
        r"expected integers \[frames, 4\]",
        r"every code must be in \[0, 32\)",
        r"codes of float32",
        "holds a special token",
        r"expected floats \[16\]",
        r"exceed data\.dataset_param\.basic_parameters\.cutoff_len = 64",
    ]
    for i, message in enumerate(expected):
        with pytest.raises(DataError, match=rf"train\.jsonl:{i + 1}: .*{message}"):
            ds[i]
    # token-budget batching leaves them out too, as far as the files' headers tell (not the code values)
    assert (ds.lengths() == -1).tolist() == [True, False, True, True, True, True]


def test_tokenizer_and_config_must_agree(folder, tmp_path):
    config = json.loads((folder / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "im_start_token_id": 3}))
    _codes(tmp_path, "a.npy", 2)
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "hi", "codes": "codes/a.npy"}) + "\n")
    with pytest.raises(ConfigError, match="im_start_token_id 3"):
        TTSCodesDataset(
            {"dataset": str(tmp_path / "t.jsonl")},
            {"model_name_or_path": str(folder), "model_config": str(other)},
        )
    del config["talker_config"]["codec_bos_id"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"talker_config\.codec_bos_id: got None"):
        TTSCodesDataset(
            {"dataset": str(tmp_path / "t.jsonl")},
            {"model_name_or_path": str(folder), "model_config": str(other / "config.json")},
        )
