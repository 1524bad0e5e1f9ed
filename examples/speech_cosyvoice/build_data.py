"""Build the CosyVoice3 speech example's data offline: spoken digit strings, a k-means speech tokenizer, a
text tokenizer, the speech stores and the model configs (no network, no downloaded codec or weights).

Writes, under ``--out`` (default: ``examples/speech_cosyvoice/build``):

- ``store/`` and ``heldout/``: speech stores (:func:`mm_data_audio.cosyvoice.store.write_store`) of the
  training utterances and of the held-out ones (:data:`HELD_OUT_FRACTION`, never trained on, never seen by the
  k-means). An utterance is a string of :data:`DIGITS_PER_UTTERANCE` random digits spoken as words ("three
  one four") by espeak-ng in one voice at a fixed speed and pitch (:data:`VOICE`), resampled from
  espeak-ng's 22050 Hz to 24 kHz, silence trimmed, zero-padded to a multiple of 960 samples (two mel frames
  per 25 Hz token), 16-bit. Every digit string occurs once: a held-out text was never spoken in training;
- ``speech_tokenizer.npy``: the k-means centroids (:mod:`kmeans_tokenizer`: ``K`` points in the space of
  pairs of log-mel frames, fitted on the training utterances only) that make the stores' speech tokens. It
  stands in for CosyVoice3's ``speech_tokenizer_v3``, which real runs use (its tokens go into the same
  store format);
- ``tokenizer/``: a byte-level BPE text tokenizer trained on the training texts
  (:func:`mm_core.data.bpe.write_bytelevel_bpe`), with ``<|endoftext|>`` and ``<|endofprompt|>``;
- ``models/lm/config.json`` and ``models/flow/config.json``: what the data decides about the models (the
  text vocabulary and ``speech_vocab = K``); the sizes are in the stage YAMLs' ``model.config_overrides``;
- ``utterances.jsonl`` (id, text, split, seconds) and ``build_info.json`` (sizes, the k-means fit, the
  tokenizer's quantisation error on the held-out utterances: the mean L1 distance between the true log-mel
  and the one its tokens' centroids give back).

``--sample`` (needs espeak-ng) writes the small committed set instead (``sample/``: :data:`SAMPLE`'s
utterances as 24 kHz FLAC and ``manifest.jsonl``); ``--from-sample`` builds everything above from that set
alone (no espeak-ng; used by the tests).

Needs the ``espeak-ng`` program (Debian/Ubuntu package ``espeak-ng``) unless ``--from-sample``, scikit-learn,
``soundfile`` and ``scipy``.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from kmeans_tokenizer import KMeansSpeechTokenizer

from mm_data_audio.cosyvoice.audio import SAMPLE_RATE, TOKEN_SAMPLES, log_mel, resample
from mm_data_audio.cosyvoice.store import Utterance, write_store

HERE = Path(__file__).resolve().parent
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
#: espeak-ng voice, speed (words per minute) and pitch (0-99): one speaker, so the text decides the speech
VOICE, SPEED, PITCH = "en-us", 160, 50
DIGITS_PER_UTTERANCE = (3, 4)  # inclusive range
NUM_UTTERANCES = 480
HELD_OUT_FRACTION = 0.05
SPEECH_VOCAB = 128
TEXT_VOCAB = 300
SPECIAL_TOKENS = ("<|endoftext|>", "<|endofprompt|>")
#: the committed sample (``--sample``): (id, digits, split)
SAMPLE = (
    ("s00", "371", "train"),
    ("s01", "9058", "train"),
    ("s02", "428", "train"),
    ("s03", "5162", "train"),
    ("s04", "640", "train"),
    ("s05", "2831", "train"),
    ("s06", "759", "train"),
    ("s07", "1062", "train"),
    ("s08", "834", "train"),
    ("s09", "197", "test"),
    ("s10", "5620", "test"),
    ("s11", "413", "test"),
)


@dataclass(frozen=True)
class Spoken:
    """One utterance: its id, digit string, split and 24 kHz wave (whole 960-sample tokens, PCM16 values)."""

    id: str
    digits: str
    split: str
    wave: npt.NDArray[np.float32]

    @property
    def text(self) -> str:
        return words(self.digits)


def words(digits: str) -> str:
    """``"314"`` -> ``"three one four"``."""
    return " ".join(WORDS[int(d)] for d in digits)


def espeak_program() -> str:
    """The path of ``espeak-ng``, or exit with how to install it."""
    path = shutil.which("espeak-ng")
    if path is None:
        sys.exit(
            "build_data.py: the espeak-ng program is not on PATH; install the Debian/Ubuntu package "
            "`espeak-ng` (apt-get install espeak-ng), or build from the committed utterances with "
            "--from-sample"
        )
    return path


def pcm16(wave: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
    """``wave`` as it reads back from a 16-bit file (the store's wavs are PCM16, and its mels are computed
    from what is read back: the tokens must be too)."""
    import soundfile as sf  # type: ignore[import-untyped]

    buffer = io.BytesIO()
    sf.write(buffer, np.clip(wave, -1.0, 1.0), SAMPLE_RATE, format="WAV", subtype="PCM_16")
    buffer.seek(0)
    out, _ = sf.read(buffer, dtype="float32")
    return np.asarray(out, dtype=np.float32)


def trim(
    wave: npt.NDArray[np.float32], threshold: float = 0.01, margin_s: float = 0.04
) -> npt.NDArray[np.float32]:
    """The wave without the silence espeak-ng leaves before and after the speech (keeping ``margin_s``)."""
    loud = np.flatnonzero(np.abs(wave) > threshold)
    if not len(loud):
        return wave
    margin = int(margin_s * SAMPLE_RATE)
    return wave[max(0, int(loud[0]) - margin) : int(loud[-1]) + margin]


def pad_to_tokens(wave: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Zero-pad at the end to the next multiple of 960 samples (whole 25 Hz tokens)."""
    samples = -(-len(wave) // TOKEN_SAMPLES) * TOKEN_SAMPLES
    return np.pad(wave, (0, samples - len(wave))).astype(np.float32)


def render(digits: str, program: str) -> npt.NDArray[np.float32]:
    """The digit string spoken by :data:`VOICE`: 24 kHz, trimmed, padded to whole tokens, PCM16 values."""
    import soundfile as sf

    cmd = [program, "-v", VOICE, "-s", str(SPEED), "-p", str(PITCH), "--stdout", words(digits)]
    done = subprocess.run(cmd, capture_output=True, check=False)
    if done.returncode != 0 or not done.stdout:
        err = done.stderr.decode(errors="replace").strip()
        sys.exit(f"build_data.py: {' '.join(cmd)} failed (exit {done.returncode}): {err or 'no audio'}")
    wave, rate = sf.read(io.BytesIO(done.stdout), dtype="float32", always_2d=True)
    return pcm16(pad_to_tokens(trim(resample(wave.mean(axis=1), int(rate), SAMPLE_RATE))))


def plan(n: int, held_out: int, seed: int) -> list[tuple[str, str, str]]:
    """``n`` distinct digit strings as ``(id, digits, split)``; the last ``held_out`` are the test split."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[tuple[str, str, str]] = []
    while len(out) < n:
        digits = "".join(str(rng.randrange(10)) for _ in range(rng.randint(*DIGITS_PER_UTTERANCE)))
        if digits in seen:
            continue
        seen.add(digits)
        split = "test" if len(out) >= n - held_out else "train"
        out.append((f"u{len(out):04d}", digits, split))
    return out


def synthesise(specs: Sequence[tuple[str, str, str]]) -> list[Spoken]:
    program = espeak_program()
    return [Spoken(uid, digits, split, render(digits, program)) for uid, digits, split in specs]


# ------------------------------------------------------------------------------------------------ sample
def write_sample(out: Path) -> Path:
    """The committed set: :data:`SAMPLE` as 24 kHz 16-bit FLAC under ``out/audio`` and ``manifest.jsonl``."""
    import soundfile as sf

    (out / "audio").mkdir(parents=True, exist_ok=True)
    lines = []
    for utt in synthesise(SAMPLE):
        rel = f"audio/{utt.id}.flac"
        sf.write(str(out / rel), utt.wave, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
        lines.append({"id": utt.id, "text": utt.text, "digits": utt.digits, "split": utt.split, "audio": rel})
    (out / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return out


def read_sample(folder: Path) -> list[Spoken]:
    """The utterances of a folder written by :func:`write_sample`."""
    from mm_data_audio.cosyvoice.audio import read_wav

    manifest = folder / "manifest.jsonl"
    out: list[Spoken] = []
    for n, line in enumerate(manifest.read_text(encoding="utf-8").splitlines(), start=1):
        obj = json.loads(line)
        wave = read_wav(folder / obj["audio"], SAMPLE_RATE)
        if len(wave) % TOKEN_SAMPLES or obj["split"] not in ("train", "test"):
            raise ValueError(f"{manifest}:{n}: {obj['audio']} is not a whole number of tokens, or bad split")
        out.append(Spoken(obj["id"], obj["digits"], obj["split"], wave))
    return out


# ------------------------------------------------------------------------------------------------ build
def write_text_tokenizer(texts: Sequence[str], out: Path) -> Any:
    from transformers import AutoTokenizer

    from mm_core.data.bpe import write_bytelevel_bpe

    folder = write_bytelevel_bpe(
        texts, TEXT_VOCAB, out, special_tokens=list(SPECIAL_TOKENS), chat_template=""
    )
    return AutoTokenizer.from_pretrained(folder)


def write_model_configs(out: Path, text_vocab: int, speech_vocab: int) -> None:
    """What the data decides about the models; sizes come from the stage YAMLs' ``config_overrides``."""
    configs = {
        "lm": {"model_type": "qwen2", "vocab_size": text_vocab, "speech_vocab": speech_vocab},
        "flow": {"vocab_size": speech_vocab},
    }
    for stage, config in configs.items():
        (out / stage).mkdir(parents=True, exist_ok=True)
        (out / stage / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def build(
    utterances: Sequence[Spoken], out: Path, speech_vocab: int, seed: int, synthesis_seconds: float = 0.0
) -> dict[str, Any]:
    """Tokenizers, stores and model configs under ``out`` from ``utterances`` (module docstring);
    ``synthesis_seconds`` (how long making the utterances took) goes into ``build_info.json``."""
    start = time.time()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"build_data.py: {out} exists and is not empty; remove it or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    train = [u for u in utterances if u.split == "train"]
    test = [u for u in utterances if u.split == "test"]
    if not train or not test:
        raise SystemExit("build_data.py: need at least one training and one held-out utterance")
    mels = {u.id: log_mel(torch.from_numpy(u.wave)).numpy() for u in utterances}
    speech_tok, mse = KMeansSpeechTokenizer.fit([mels[u.id] for u in train], speech_vocab, seed)
    speech_tok.save(out / "speech_tokenizer.npy")
    tokens = {u.id: speech_tok.encode(mels[u.id]) for u in utterances}
    for name, split in (("store", train), ("heldout", test)):
        write_store(
            out / name, [Utterance(u.id, u.text, u.wave, tokens[u.id]) for u in split], speech_tok.vocab_size
        )
    text_tok = write_text_tokenizer([u.text for u in train], out / "tokenizer")
    write_model_configs(out / "models", len(text_tok), speech_tok.vocab_size)
    (out / "utterances.jsonl").write_text(
        "".join(
            json.dumps({"id": u.id, "text": u.text, "split": u.split, "seconds": len(u.wave) / SAMPLE_RATE})
            + "\n"
            for u in utterances
        ),
        encoding="utf-8",
    )
    floor = [float(np.abs(speech_tok.decode(tokens[u.id]) - mels[u.id]).mean()) for u in test]
    used = np.unique(np.concatenate([tokens[u.id] for u in train]))
    info = {
        "voice": {"name": VOICE, "speed_wpm": SPEED, "pitch": PITCH},
        "utterances": {"train": len(train), "test": len(test)},
        "seconds": {
            "train": round(sum(len(u.wave) for u in train) / SAMPLE_RATE, 1),
            "test": round(sum(len(u.wave) for u in test) / SAMPLE_RATE, 1),
        },
        "speech_tokens": {"train": int(sum(len(tokens[u.id]) for u in train))},
        "speech_vocab": speech_tok.vocab_size,
        "codes_used_in_training": int(len(used)),
        "kmeans_mse_per_dim": round(mse, 4),
        "quantisation_mel_l1_heldout": round(float(np.mean(floor)), 4),
        "text_vocab": len(text_tok),
        "seed": seed,
        "synthesis_seconds": round(synthesis_seconds, 1),
        "build_seconds": round(time.time() - start, 1),
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="default: build/ (sample/ with --sample)")
    parser.add_argument("--num-utterances", type=int, default=NUM_UTTERANCES)
    parser.add_argument(
        "--held-out", type=float, default=HELD_OUT_FRACTION, help="fraction of utterances in the test split"
    )
    parser.add_argument("--speech-vocab", type=int, default=SPEECH_VOCAB, help="k-means centroids (K)")
    parser.add_argument("--seed", type=int, default=0)
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--sample", action="store_true", help="write the small committed set (needs espeak-ng)"
    )
    which.add_argument(
        "--from-sample", action="store_true", help="build from the committed set only (no espeak-ng)"
    )
    args = parser.parse_args()
    if args.sample:
        out = write_sample(args.out or HERE / "sample")
        print(f"wrote {out}/manifest.jsonl and {len(SAMPLE)} utterances under {out}/audio")
        return
    start = time.time()
    if args.from_sample:
        utterances = read_sample(HERE / "sample")
    else:
        if args.num_utterances < 2 or not 0 < args.held_out < 1:
            parser.error("--num-utterances must be at least 2 and --held-out in (0, 1)")
        held_out = max(1, round(args.held_out * args.num_utterances))
        utterances = synthesise(plan(args.num_utterances, held_out, args.seed))
    info = build(utterances, args.out or HERE / "build", args.speech_vocab, args.seed, time.time() - start)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
