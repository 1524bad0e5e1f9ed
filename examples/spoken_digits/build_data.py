"""Build the spoken-digits example's assets offline: digit strings spoken by espeak-ng, a tokenizer +
Qwen3-ASR feature extractor folder and a tiny Qwen3-ASR configuration (no network, no downloaded weights).

Writes, under ``--out`` (default: ``examples/spoken_digits/build``):

- ``data/audio/{train,test}/<i>.flac``: 3 to 5 random digits per clip, spoken as words ("three seven one")
  by espeak-ng with a random speed (:data:`SPEEDS` words per minute) and pitch (:data:`PITCHES`), resampled
  from espeak-ng's 22050 Hz to 16 kHz (``scipy.signal.resample_poly``), silence trimmed, 16-bit FLAC;
- ``data/train.jsonl`` / ``data/test.jsonl``: ``asr_manifest`` lines
  ``{"audio": "audio/train/0.flac", "text": "371", "language": "English", "voice": "en-gb+m3"}``. The
  transcript is the digit string, one character per spoken digit, so the character error rate is the
  fraction of digits wrong (words would make it depend on how long the digits' names are). The split is by
  voice: a test clip's accent (:data:`TEST_ACCENTS`) and voice variant (:data:`TEST_VARIANTS`) are both
  absent from training, so test CER measures speakers the model never heard;
- ``processor/``: :func:`mm_data_audio.processor_build.build_qwen3_asr_processor` over the transcripts'
  alphabet (the ten digits, each its own token: the tokenizer is trained on single digits, so it learns no
  multi-digit merges) and Qwen3-ASR's answer prefix ``language English<asr_text>``;
- ``model/config.json``: a tiny Qwen3-ASR (:func:`model_config`), random initialisation.

``--family fun_asr_nano`` writes Fun-ASR-Nano's ``processor/`` (ChatML with its audio token and the
``FunAsrNanoFeatureExtractor`` settings, :func:`mm_data_audio.processor_funasr.build_fun_asr_nano_processor`)
and a tiny Fun-ASR-Nano (:func:`fun_asr_nano_config`) instead; the clips are the same for every family, so
``--assets-only`` writes only ``processor/`` and ``model/`` (``examples/fun_asr_nano_digits`` trains on
``build/data``).

``--omni`` writes the omni variant instead (:mod:`omni`: Qwen3-Omni's thinker answers questions about a
spoken and a written digit). ``--sample`` writes the small committed set the tests use instead
(``examples/spoken_digits/sample/``: a dozen short clips of a few voices and ``manifest.jsonl``).
:func:`build_assets` writes only ``processor/`` and ``model/`` (no espeak-ng needed), for the tests and
``--assets-only``.

Needs the ``espeak-ng`` program (Debian/Ubuntu package ``espeak-ng``), ``soundfile`` and ``scipy``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import random
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
#: espeak-ng English accents (voice files under ``gmw/``); the test ones are never heard in training
TRAIN_ACCENTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-gb-x-gbcwmd")
TEST_ACCENTS = ("en-us-nyc", "en-gb-x-gbclan")
#: espeak-ng voice variants (formants, pitch range, roughness: ``+m1`` .. ``+f5``; "" the accent's own)
TRAIN_VARIANTS = ("", "m1", "m2", "m3", "m5", "m7", "m8", "f1", "f3", "f4")
TEST_VARIANTS = ("m4", "m6", "f2", "f5")
SPEEDS = (130, 190)  # words per minute, inclusive range
PITCHES = (25, 75)  # espeak-ng -p (0-99), inclusive range
DIGITS_PER_CLIP = (3, 5)
RATE = 16000
LANGUAGE = "English"
#: the committed test set (``--sample``): (digits, voice, speed, pitch), training and held-out voices mixed
SAMPLE = (
    ("371", "en-us", 170, 50),
    ("905", "en-gb+f3", 180, 60),
    ("428", "en-gb-scotland+m3", 175, 40),
    ("516", "en-029+f1", 185, 55),
    ("640", "en-gb-x-rp+m1", 170, 45),
    ("283", "en-gb-x-gbcwmd+f4", 180, 65),
    ("759", "en-us+m7", 175, 35),
    ("1062", "en-gb+m5", 185, 50),
    ("834", "en-us-nyc+m4", 175, 50),
    ("197", "en-gb-x-gbclan+f2", 180, 55),
    ("562", "en-us-nyc+f5", 185, 60),
    ("4013", "en-gb-x-gbclan+m6", 180, 40),
)


@dataclass(frozen=True)
class Clip:
    """One utterance to render: the digit string and how espeak-ng speaks it."""

    digits: str
    voice: str
    speed: int
    pitch: int

    @property
    def words(self) -> str:
        return " ".join(WORDS[int(d)] for d in self.digits)


def espeak_program() -> str:
    """The path of ``espeak-ng``, or exit with how to install it."""
    path = shutil.which("espeak-ng")
    if path is None:
        sys.exit(
            "build_data.py: the espeak-ng program is not on PATH; install the Debian/Ubuntu package "
            "`espeak-ng` (sudo apt-get install espeak-ng), or use the committed clips under "
            "examples/spoken_digits/sample/"
        )
    return path


def voices(accents: Sequence[str], variants: Sequence[str]) -> list[str]:
    """Every ``accent+variant`` espeak-ng voice name (``accent`` alone for the empty variant)."""
    return [f"{a}+{v}" if v else a for a in accents for v in variants]


def plan(
    n: int,
    voice_names: Sequence[str],
    rng: random.Random,
    digits_per_clip: tuple[int, int] = DIGITS_PER_CLIP,
) -> list[Clip]:
    """``n`` clips: ``digits_per_clip`` (an inclusive range) random digits, voices in turn (so each is used
    about equally), random speed and pitch."""
    clips = []
    for i in range(n):
        length = rng.randint(*digits_per_clip)
        digits = "".join(str(rng.randrange(10)) for _ in range(length))
        clips.append(
            Clip(digits, voice_names[i % len(voice_names)], rng.randint(*SPEEDS), rng.randint(*PITCHES))
        )
    return clips


def trim(wave: np.ndarray, threshold: float = 0.01, margin_s: float = 0.05) -> np.ndarray:
    """The clip without the silence espeak-ng leaves before and after the speech (keeping ``margin_s``)."""
    loud = np.flatnonzero(np.abs(wave) > threshold)
    if not len(loud):
        return wave
    margin = int(margin_s * RATE)
    return wave[max(0, int(loud[0]) - margin) : int(loud[-1]) + margin]


def render(clip: Clip, program: str) -> np.ndarray:
    """The clip's speech: mono float32 at :data:`RATE`, silence trimmed."""
    import soundfile as sf  # type: ignore[import-untyped]
    from scipy.signal import resample_poly  # type: ignore[import-untyped]

    cmd = [program, "-v", clip.voice, "-s", str(clip.speed), "-p", str(clip.pitch), "--stdout", clip.words]
    done = subprocess.run(cmd, capture_output=True, check=False)
    if done.returncode != 0 or not done.stdout:
        err = done.stderr.decode(errors="replace").strip()
        sys.exit(f"build_data.py: {' '.join(cmd)} failed (exit {done.returncode}): {err or 'no audio'}")
    wave, rate = sf.read(io.BytesIO(done.stdout), dtype="float32")
    if wave.ndim > 1:
        wave = wave.mean(axis=1)
    if rate != RATE:
        g = math.gcd(rate, RATE)
        wave = resample_poly(wave, RATE // g, rate // g).astype(np.float32)
    return trim(np.clip(wave, -1.0, 1.0))


def write_clips(clips: Sequence[Clip], data_dir: Path, audio_dir: str, program: str) -> list[dict[str, Any]]:
    """Render ``clips`` as FLAC under ``data_dir/audio_dir``; their manifest lines (paths relative to
    ``data_dir``, the config's ``dataset_dir``)."""
    import soundfile as sf

    (data_dir / audio_dir).mkdir(parents=True, exist_ok=True)
    lines = []
    for i, clip in enumerate(clips):
        rel = f"{audio_dir}/{i}.flac"
        sf.write(str(data_dir / rel), render(clip, program), RATE, format="FLAC", subtype="PCM_16")
        lines.append(
            {
                "audio": rel,
                "text": clip.digits,
                "language": LANGUAGE,
                "voice": clip.voice,
                "speed": clip.speed,
                "pitch": clip.pitch,
            }
        )
    return lines


def write_jsonl(path: Path, lines: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


#: the tiny model (:func:`model_config`): an audio encoder of 2 layers and a language model of 4, width 96.
#: Weights start with standard deviation 0.1 (about 1 / sqrt(width)) instead of transformers' 0.02, which
#: suits widths near 2000: at 0.02 the three stride-2 convolutions shrink the mel features about 4000-fold,
#: so the audio reaches the encoder 4000 times weaker than its position embeddings, and a decoder this narrow
#: starts with near-uniform attention; with either, the model only learns the digits' prior in the budget.
#: Two decoder layers learn single digits but not which digit comes where in a string; four do.
INIT_STD = 0.1
AUDIO = {
    "num_mel_bins": 128,
    "encoder_layers": 2,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 256,
    "d_model": 96,
    "downsample_hidden_size": 32,
    "n_window": 50,  # 100-frame (1 s) chunks: the feature extractor's default
    "n_window_infer": 400,
    "max_position_embeddings": 13,  # rows of one chunk after the three stride-2 convolutions
    "initializer_range": INIT_STD,
}
TEXT = {
    "hidden_size": 96,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": True,
    "initializer_range": INIT_STD,
}


def model_config(tokenizer: Any) -> Any:
    """A tiny ``Qwen3ASRConfig`` for ``tokenizer`` (its vocabulary and audio / end-of-turn token ids)."""
    from transformers.models.qwen3_asr import Qwen3ASRConfig

    ids = {
        t: int(tokenizer.convert_tokens_to_ids(t)) for t in ("<|audio_pad|>", "<|im_end|>", "<|endoftext|>")
    }
    return Qwen3ASRConfig(
        audio_config={**AUDIO, "output_dim": TEXT["hidden_size"]},
        text_config={"vocab_size": len(tokenizer), **TEXT},
        audio_token_id=ids["<|audio_pad|>"],
        # forced alignment (``<timestamp>`` markers) is not part of this recipe: no such token
        timestamp_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|endoftext|>"], ids["<|im_end|>"]],
        tie_word_embeddings=True,
        initializer_range=INIT_STD,
    )


#: the tiny Fun-ASR-Nano (:func:`fun_asr_nano_config`): a SAN-M audio encoder of 3 layers (the last one
#: Fun-ASR-Nano's "timestamp" layer) over the 560-value low-frame-rate rows (80 mel bins × 7 frames every
#: 60 ms: about 17 audio tokens a second, no further subsampling), an adaptor layer at the text width and the
#: Qwen3 decoder of :data:`TEXT` (width 96, 4 layers). Weights start at :data:`INIT_STD`, as Qwen3-ASR's do.
FUN_ASR_NANO_AUDIO = {
    "model_type": "fun_asr_nano_encoder",
    "hidden_size": 96,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_timestamp_prediction_layers": 1,
    "fsmn_kernel_size": 11,  # the published model's FSMN memory: 11 rows (660 ms)
    "max_position_embeddings": 513,  # rows of the longest clip + 1 (30 s; the clips here are 1-2.5 s)
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}
FUN_ASR_NANO_ADAPTOR = {
    "hidden_size": TEXT["hidden_size"],
    "intermediate_size": TEXT["hidden_size"] // 4,  # Fun-ASR-Nano's rule: a quarter of the text width
    "num_attention_heads": 4,
    "num_hidden_layers": 1,
    "projector_hidden_size": 192,
}
#: ``--family``: the model whose processor and tiny config ``processor/`` and ``model/`` hold
FAMILIES = ("qwen3_asr", "fun_asr_nano")


def fun_asr_nano_config(tokenizer: Any) -> Any:
    """A tiny ``FunAsrNanoConfig`` for ``tokenizer`` (its vocabulary and audio token id)."""
    from transformers import FunAsrNanoConfig

    from mm_data_audio.formats.fun_asr import AUDIO_TOKEN

    text = {k: v for k, v in TEXT.items() if k != "rope_parameters"}
    return FunAsrNanoConfig(
        audio_config=FUN_ASR_NANO_AUDIO,
        adaptor_config=FUN_ASR_NANO_ADAPTOR,
        text_config={"model_type": "qwen3", "vocab_size": len(tokenizer), **text},
        audio_token_id=int(tokenizer.convert_tokens_to_ids(AUDIO_TOKEN)),
        tie_word_embeddings=True,
        initializer_range=INIT_STD,
    )


def build_assets(out: Path, family: str = "qwen3_asr") -> Path:
    """``out/processor`` (tokenizer + ``family``'s feature extractor) and ``out/model/config.json``; needs no
    audio."""
    from transformers import AutoTokenizer

    from mm_data_audio.processor_build import build_qwen3_asr_processor
    from mm_data_audio.processor_funasr import build_fun_asr_nano_processor

    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: expected one of {', '.join(FAMILIES)}")
    # the transcripts' alphabet, one digit at a time (so no multi-digit merges), and the chat's fixed words
    texts = [*"0123456789", f"language {LANGUAGE}", "user", "assistant", "\n"] * 20
    if family == "fun_asr_nano":
        proc = build_fun_asr_nano_processor(texts, out / "processor", vocab_size=300)
        config = fun_asr_nano_config(AutoTokenizer.from_pretrained(proc))
    else:
        proc = build_qwen3_asr_processor(
            texts, out / "processor", vocab_size=300, feature_size=AUDIO["num_mel_bins"]
        )
        config = model_config(AutoTokenizer.from_pretrained(proc))
    (out / "model").mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out / "model")
    return out


def build(out: Path, num_train: int, num_test: int, seed: int, family: str = "qwen3_asr") -> Path:
    """The data (rendered with espeak-ng), processor and model config under ``out``."""
    program = espeak_program()
    rng = random.Random(seed)
    train = plan(num_train, voices(TRAIN_ACCENTS, TRAIN_VARIANTS), rng)
    test = plan(num_test, voices(TEST_ACCENTS, TEST_VARIANTS), rng)
    data = out / "data"
    for split, clips in (("train", train), ("test", test)):
        write_jsonl(data / f"{split}.jsonl", write_clips(clips, data, f"audio/{split}", program))
    return build_assets(out, family)


def build_sample(out: Path) -> Path:
    """The committed test set: :data:`SAMPLE`'s clips under ``out/audio`` and ``out/manifest.jsonl``."""
    program = espeak_program()
    clips = [Clip(*spec) for spec in SAMPLE]
    write_jsonl(out / "manifest.jsonl", write_clips(clips, out, "audio", program))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="default: build/ (sample/ with --sample)")
    parser.add_argument("--num-train", type=int, default=4000, help="training clips (training voices)")
    parser.add_argument("--num-test", type=int, default=400, help="held-out clips (held-out voices)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sample", action="store_true", help="write the small committed set for the tests instead"
    )
    parser.add_argument(
        "--family",
        choices=FAMILIES,
        default="qwen3_asr",
        help="the model whose processor and tiny config processor/ and model/ hold (default: qwen3_asr; "
        "fun_asr_nano: the recipe under examples/fun_asr_nano_digits/)",
    )
    parser.add_argument(
        "--assets-only",
        action="store_true",
        help="write only processor/ and model/ (no clips, no espeak-ng): the clips are the same for every "
        "family",
    )
    parser.add_argument(
        "--omni",
        action="store_true",
        help="write the omni variant instead (omni.py: a spoken and a written digit per sample, Qwen3-Omni's "
        "thinker; default --out build_omni/)",
    )
    args = parser.parse_args()
    if args.omni:
        from omni import build_omni  # beside this script

        out = build_omni(args.out or HERE / "build_omni", args.num_train, args.num_test, args.seed)
        print(f"wrote {out}/data (train.jsonl, test.jsonl, audio/, images/), {out}/processor, {out}/model")
        return
    if args.sample:
        out = build_sample(args.out or HERE / "sample")
        print(f"wrote {out}/manifest.jsonl and {len(SAMPLE)} clips under {out}/audio")
        return
    if args.assets_only:
        out = build_assets(args.out or HERE / "build", args.family)
        print(f"wrote {out}/processor and {out}/model/config.json ({args.family})")
        return
    if args.num_train < 1 or args.num_test < 1:
        parser.error("--num-train and --num-test must be at least 1")
    out = build(args.out or HERE / "build", args.num_train, args.num_test, args.seed, args.family)
    print(
        f"wrote {out}/data (train.jsonl: {args.num_train} clips, test.jsonl: {args.num_test} clips, audio/), "
        f"{out}/processor, {out}/model/config.json"
    )


if __name__ == "__main__":
    main()
