"""What the moving-digits example's scripts share: rendering a clip of one of scikit-learn's 8×8 digits
moving across a canvas, the caption of a clip, the held-out split, and the judge of generated clips (a
digit classifier applied where the digit is, and the direction of its motion).

A clip is ``FRAMES`` frames of ``CANVAS × CANVAS`` RGB pixels: black, with one handwritten digit scaled
``SCALE`` times (``DIGIT`` pixels square, white) that travels ``STEP`` pixels a frame from one edge to the
other, left, right, up or down; its position across the motion is random. 9 frames (``T − 1`` a multiple of
the VAE's temporal factor 4) of 32 × 32 pixels (a multiple of the example VAE's spatial factor 4 × the
transformer's patch 2) become latents of 3 × 8 × 8, i.e. 48 video tokens of the transformer.

**Held out.** For every digit one direction is never seen in training (:data:`HELD_OUT_PAIRS`: digit ``d``
moving ``DIRECTIONS[d % 4]``), so a held-out caption ("a 3 moving left") asks for a digit and a direction
that were each trained, but never together; the digit images are split too (a seeded 20 %).

**Judge.** :func:`locate` finds the digit in a frame as the brightest ``DIGIT × DIGIT`` window,
:func:`digit_features` shrinks that window back to 8×8 on scikit-learn's 0–16 scale, and a logistic
regression trained on the training digit images (:func:`train_classifier`) names it; the motion's direction
is read from where the window is in the first and the last frame (:func:`direction_of`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CANVAS = 32
FRAMES = 9
SCALE = 2
DIGIT = 8 * SCALE
STEP = (CANVAS - DIGIT) // (FRAMES - 1)  # 2 pixels a frame: edge to edge over the clip
DIRECTIONS = ("left", "right", "up", "down")
#: (digit, direction) pairs never seen in training: each digit misses one direction
HELD_OUT_PAIRS = tuple((d, DIRECTIONS[d % 4]) for d in range(10))
TEST_FRACTION = 0.2


def caption(digit: int, direction: str) -> str:
    return f"a {digit} moving {direction}"


def parse_caption(text: str) -> tuple[int, str]:
    """``"a 3 moving left"`` -> ``(3, "left")``; anything else is a ValueError."""
    words = text.split()
    if len(words) != 4 or words[0] != "a" or not words[1].isdigit() or words[2] != "moving":
        raise ValueError(f"caption {text!r}: expected 'a <digit> moving <direction>'")
    if words[3] not in DIRECTIONS:
        raise ValueError(f"caption {text!r}: direction must be one of {', '.join(DIRECTIONS)}")
    return int(words[1]), words[3]


@dataclass(frozen=True)
class ClipSpec:
    """One clip to render: which digit image, where it goes, and across-the-motion offset."""

    image: int
    digit: int
    direction: str
    offset: int

    @property
    def caption(self) -> str:
        return caption(self.digit, self.direction)


def load_digit_images() -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """scikit-learn's bundled digits: images float [1797, 8, 8] in 0..16 and their labels."""
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]

    data = load_digits()
    return np.asarray(data.images, dtype=np.float32), np.asarray(data.target, dtype=np.int64)


def split_images(count: int, seed: int) -> tuple[list[int], list[int]]:
    """A seeded split of the image indices: (train, held out)."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    cut = int(round(count * TEST_FRACTION))
    return sorted(order[cut:]), sorted(order[:cut])


def train_directions(digit: int) -> list[str]:
    return [d for d in DIRECTIONS if (digit, d) not in HELD_OUT_PAIRS]


def positions(direction: str, offset: int) -> list[tuple[int, int]]:
    """The digit's top-left corner (y, x) in every frame."""
    travel = [STEP * t for t in range(FRAMES)]
    if direction == "right":
        return [(offset, x) for x in travel]
    if direction == "left":
        return [(offset, CANVAS - DIGIT - x) for x in travel]
    if direction == "down":
        return [(y, offset) for y in travel]
    if direction == "up":
        return [(CANVAS - DIGIT - y, offset) for y in travel]
    raise ValueError(f"direction {direction!r}: expected one of {', '.join(DIRECTIONS)}")


def render(image: np.ndarray[Any, Any], direction: str, offset: int) -> np.ndarray[Any, Any]:
    """uint8 ``[FRAMES, CANVAS, CANVAS, 3]``: ``image`` (8×8, 0..16) scaled up and moving ``direction``."""
    big = np.kron(image / 16.0 * 255.0, np.ones((SCALE, SCALE))).clip(0, 255).astype(np.uint8)
    frames = np.zeros((FRAMES, CANVAS, CANVAS, 3), dtype=np.uint8)
    for t, (y, x) in enumerate(positions(direction, offset)):
        frames[t, y : y + DIGIT, x : x + DIGIT] = big[..., None]
    return frames


def clip_specs(
    images: Sequence[int], labels: np.ndarray[Any, Any], per_image: int, seed: int, held_out: bool
) -> list[ClipSpec]:
    """``per_image`` clips of every image: training pairs (random direction among the digit's training
    ones) or, with ``held_out``, the digit's held-out direction; random offsets."""
    rng = random.Random(seed)
    specs = []
    for i in images:
        digit = int(labels[i])
        for _ in range(per_image):
            direction = DIRECTIONS[digit % 4] if held_out else rng.choice(train_directions(digit))
            specs.append(ClipSpec(i, digit, direction, rng.randint(0, CANVAS - DIGIT)))
    return specs


# ------------------------------------------------------------------------------------------------ judge
def gray(frames: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """float ``[T, H, W]`` in 0..255 from uint8 ``[T, H, W, 3]``."""
    return np.asarray(frames, dtype=np.float32).mean(axis=-1)


def locate(frame: np.ndarray[Any, Any]) -> tuple[int, int]:
    """Top-left corner (y, x) of the brightest ``DIGIT × DIGIT`` window of a gray frame ``[H, W]``."""
    integral = np.pad(frame, ((1, 0), (1, 0))).cumsum(0).cumsum(1)
    sums = (
        integral[DIGIT:, DIGIT:]
        - integral[:-DIGIT, DIGIT:]
        - integral[DIGIT:, :-DIGIT]
        + integral[:-DIGIT, :-DIGIT]
    )
    y, x = np.unravel_index(int(np.argmax(sums)), sums.shape)
    return int(y), int(x)


def digit_features(frame: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The located digit of a gray frame, averaged back to 8×8 on scikit-learn's 0..16 scale, flattened."""
    y, x = locate(frame)
    window = frame[y : y + DIGIT, x : x + DIGIT]
    small = window.reshape(8, SCALE, 8, SCALE).mean(axis=(1, 3))
    return np.asarray(small / 255.0 * 16.0, dtype=np.float32).reshape(-1)


def direction_of(frames: np.ndarray[Any, Any]) -> str:
    """The direction in which the located digit moved from the first frame to the last."""
    g = gray(frames)
    (y0, x0), (y1, x1) = locate(g[0]), locate(g[-1])
    dy, dx = y1 - y0, x1 - x0
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


def train_classifier(images: np.ndarray[Any, Any], labels: np.ndarray[Any, Any], seed: int = 0) -> Any:
    """A logistic regression on the 8×8 features :func:`digit_features` extracts from frames of clips of
    ``images`` (every image in a random clip, its first, middle and last frame): trained on what the judge
    sees, so the window's ambiguity (a digit narrower than the window can be framed at several places) is
    part of its training, not an error."""
    from sklearn.linear_model import LogisticRegression  # type: ignore[import-untyped]

    rng = random.Random(seed)
    features, targets = [], []
    for image, label in zip(images, labels):
        frames = gray(render(image, rng.choice(DIRECTIONS), rng.randint(0, CANVAS - DIGIT)))
        for t in (0, FRAMES // 2, FRAMES - 1):
            features.append(digit_features(frames[t]))
            targets.append(int(label))
    model = LogisticRegression(max_iter=3000)
    model.fit(np.stack(features), np.asarray(targets))
    return model


def judge(
    classifier: Any, clips: Sequence[np.ndarray[Any, Any]], captions: Sequence[str]
) -> dict[str, float]:
    """Frame accuracy of the digit (every frame of every clip classified against its caption's digit) and
    clip accuracy of the direction."""
    right_frames = total_frames = right_dirs = 0
    for frames, text in zip(clips, captions):
        digit, direction = parse_caption(text)
        g = gray(frames)
        predicted = classifier.predict(np.stack([digit_features(f) for f in g]))
        right_frames += int((predicted == digit).sum())
        total_frames += len(g)
        right_dirs += int(direction_of(frames) == direction)
    return {
        "digit_frame_accuracy": right_frames / max(total_frames, 1),
        "direction_accuracy": right_dirs / max(len(clips), 1),
    }


# ------------------------------------------------------------------------------------------------ pictures
def strip(clips: Sequence[np.ndarray[Any, Any]], gap: int = 2) -> np.ndarray[Any, Any]:
    """One uint8 RGB image: a row per clip, its frames side by side, ``gap`` gray pixels between."""
    rows = []
    for frames in clips:
        t, h, w, _ = frames.shape
        row = np.full((h, t * w + (t - 1) * gap, 3), 96, dtype=np.uint8)
        for i in range(t):
            row[:, i * (w + gap) : i * (w + gap) + w] = frames[i]
        rows.append(row)
    width = rows[0].shape[1]
    out = np.full((len(rows) * (rows[0].shape[0] + gap) - gap, width, 3), 96, dtype=np.uint8)
    for i, row in enumerate(rows):
        out[i * (row.shape[0] + gap) : i * (row.shape[0] + gap) + row.shape[0]] = row
    return out


def save_png(image: np.ndarray[Any, Any], path: Path, zoom: int = 1) -> None:
    from PIL import Image

    picture = Image.fromarray(image)
    if zoom > 1:
        picture = picture.resize((picture.width * zoom, picture.height * zoom), Image.Resampling.NEAREST)
    path.parent.mkdir(parents=True, exist_ok=True)
    picture.save(path, optimize=True)


def save_gif(clips: Sequence[np.ndarray[Any, Any]], path: Path, zoom: int = 4, ms: int = 150) -> None:
    """The clips side by side, animated (``zoom``× nearest-neighbour)."""
    from PIL import Image

    gap = 2
    t, h, w, _ = clips[0].shape
    pictures = []
    for i in range(t):
        canvas = np.full((h, len(clips) * (w + gap) - gap, 3), 96, dtype=np.uint8)
        for j, frames in enumerate(clips):
            canvas[:, j * (w + gap) : j * (w + gap) + w] = frames[i]
        picture = Image.fromarray(canvas)
        size = (picture.width * zoom, picture.height * zoom)
        pictures.append(picture.resize(size, Image.Resampling.NEAREST))
    path.parent.mkdir(parents=True, exist_ok=True)
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=ms, loop=0)


# ------------------------------------------------------------------------------------------------ models
#: text tokens per caption, zero-padded by the dataset ("a 3 moving left" is 4 words + the end token)
TEXT_LENGTH = 8


def load_text_encoder(build: Path) -> Any:
    """``encode_text`` of the example: the local word-level tokenizer and the frozen random UMT5 encoder
    under ``build/`` (written by build_data.py), as Wan's pipeline encodes prompts."""
    from transformers import AutoTokenizer
    from transformers.models.umt5 import UMT5EncoderModel

    from mm_data_video import t5_text_encoder

    tokenizer = AutoTokenizer.from_pretrained(build / "tokenizer")
    encoder = UMT5EncoderModel.from_pretrained(build / "text_encoder").eval()
    return t5_text_encoder(tokenizer, encoder, max_length=TEXT_LENGTH)


def load_vae(build: Path) -> Any:
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(build / "vae").eval()


def decode(vae: Any, latents: Any) -> list[np.ndarray[Any, Any]]:
    """uint8 ``[T, H, W, 3]`` clips from normalised latents ``[B, C, F, h, w]`` (the store's scale: the
    VAE's ``latents_mean`` / ``latents_std`` are undone first, as Wan's pipeline does)."""
    import torch

    config = vae.config
    view = (1, -1, 1, 1, 1)
    mean = torch.tensor(config.latents_mean, dtype=torch.float32).view(view)
    std = torch.tensor(config.latents_std, dtype=torch.float32).view(view)
    with torch.no_grad():
        video = vae.decode(latents.float() * std + mean).sample
    pixels = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return [p.permute(1, 2, 3, 0).numpy() for p in pixels]
