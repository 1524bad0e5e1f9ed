"""Sample clips for captions with a trained (or untrained) tiny Wan2.2 or LTX-2 and judge them.

Sampling integrates the learned flow from noise to data with Euler steps: σ goes from 1 to 0 over
``--steps`` steps (``σ_i = 1 − i/N``, then Wan's shift ``s·σ / (1 + (s − 1)·σ)``; ``--shift 1``: none); at
each step the transformer's velocity ``v ≈ noise − latents`` (``Wan22ForTraining.velocity`` at timestep
``1000·σ``, or ``LTX2ForTraining.velocity`` at ``timestep_scale_multiplier·σ``: video only, the caption's
padding masked as the ``video_latents`` dataset masks it) moves the latents ``x ← x + (σ_{i+1} − σ_i)·v``. The
family is the ``_class_name`` of the transformer's ``config.json``. With ``--guidance s`` (classifier-free
guidance, for a model trained with ``flow_matching.text_dropout``) the velocity is
``v(∅) + s·(v(text) − v(∅))``, ``∅`` being all-zero text embeddings as training drops them; ``--guidance 1``
uses ``v(text)`` alone. The start noise of every clip comes from
``--seed`` and its index. The latents are decoded by the example's VAE (``build/vae``), and the judge of
:mod:`moving_digits` scores every frame: the digit classifier's accuracy against the caption's digit and,
per clip, whether the digit moved in the caption's direction.

    python examples/moving_digits_t2v/sample.py --untrained            # random init (model/config.json)
    python examples/moving_digits_t2v/sample.py --model outputs/moving_digits_t2v/hf
    python examples/moving_digits_t2v/sample.py --untrained --model-config examples/ltx2_moving_digits/model
    python examples/moving_digits_t2v/sample.py --model outputs/ltx2_moving_digits/hf     # LTX-2's export

Captions: the held-out ones by default (every digit in the direction it never moved in during training), or
``--captions "a 3 moving left" ...``. Writes under ``--out`` (default ``outputs/moving_digits_t2v/samples_
<trained|untrained>``; ``outputs/ltx2_moving_digits/...`` for LTX-2): ``strip.png`` (a row per clip, frames
side by side), ``samples.gif`` (the first clip of every caption, animated) and ``results.json`` (the scores,
overall and per caption), and prints the scores as one JSON line. ``--readme-strip PATH`` also writes a
small strip (the first clip of every caption) to ``PATH``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import moving_digits as md
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TIMESTEP_SCALE = 1000.0
#: the diffusers class a transformer folder's ``config.json`` names -> (mm's model id, the run's folder)
FAMILIES = {
    "WanTransformer3DModel": ("wan2_2", "moving_digits_t2v"),
    "LTX2VideoTransformer3DModel": ("ltx2", "ltx2_moving_digits"),
}


def family_of(folder: Path) -> str:
    """The mm model id of the transformer folder ``folder`` (from its ``config.json``'s ``_class_name``)."""
    name = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("_class_name")
    if name not in FAMILIES:
        raise SystemExit(
            f"{folder / 'config.json'}: _class_name {name!r}; sample.py knows {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[name][0]


def load_transformer(folder: Path, trained: bool, seed: int) -> Any:
    """The exported transformer folder (``trained``), or a random one from ``folder/config.json`` built as
    ``model.from_scratch`` builds it, seeded; ``wan2_2`` or ``ltx2`` by the folder's class."""
    from mm_core.config.schema import ModelConfig
    from mm_core.models import ModelHub

    args = ModelConfig(model_id=family_of(folder), model_name_or_path=str(folder), from_scratch=not trained)
    cls: Any = ModelHub.model_class(args)
    if trained:
        return cls.from_pretrained(args).eval()
    torch.manual_seed(seed)
    return cls._from_config(args).eval()


def text_batch(encode_text: Any, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, TEXT_LENGTH, D]``: each caption's embeddings, zero-padded as the ``video_latents`` dataset
    pads them, and the mask ``[B, TEXT_LENGTH]`` it gives with them (1 for the caption's tokens)."""
    embeddings = encode_text(captions)
    out = torch.zeros(len(captions), md.TEXT_LENGTH, embeddings[0].shape[-1])
    mask = torch.zeros(len(captions), md.TEXT_LENGTH, dtype=torch.long)
    for i, e in enumerate(embeddings):
        out[i, : e.shape[0]] = e
        mask[i, : e.shape[0]] = 1
    return out, mask


def predict(
    transformer: Any, x: torch.Tensor, sigma: float, text: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The transformer's velocity for latents ``x`` at noise level ``sigma`` (Wan: zero-padded text, no
    mask; LTX-2: the video stream alone, the padding masked)."""
    scale = float(getattr(transformer.config, "timestep_scale_multiplier", TIMESTEP_SCALE))
    timestep = torch.full((len(x),), sigma * scale)
    if "timestep_scale_multiplier" in transformer.config:  # LTX-2
        video, _ = transformer.velocity(x, None, timestep, text, None, mask)
        return video
    return transformer.velocity(x, timestep, text)


def sigma_schedule(steps: int, shift: float) -> torch.Tensor:
    """``steps + 1`` noise levels from 1 to 0, shifted as Wan's scheduler shifts them."""
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * sigmas / (1 + (shift - 1) * sigmas)).float()


@torch.no_grad()
def euler_sample(
    transformer: Any,
    text: torch.Tensor,
    mask: torch.Tensor,
    latent_shape: tuple[int, ...],
    steps: int,
    shift: float,
    seed: int,
    guidance: float = 1.0,
) -> torch.Tensor:
    """Latents ``[B, *latent_shape]`` integrated from seeded noise (module docstring); the unconditional
    velocity of guidance takes all-zero text with the same mask, as training drops the text."""
    noise = [
        torch.randn(latent_shape, generator=torch.Generator().manual_seed(seed + i)) for i in range(len(text))
    ]
    x = torch.stack(noise)
    sigmas = sigma_schedule(steps, shift)
    for i in range(steps):
        velocity = predict(transformer, x, float(sigmas[i]), text, mask)
        if guidance != 1.0:
            unconditional = predict(transformer, x, float(sigmas[i]), torch.zeros_like(text), mask)
            velocity = unconditional + guidance * (velocity - unconditional)
        x = x + (sigmas[i + 1] - sigmas[i]) * velocity
    return x


def latent_shape(vae: Any) -> tuple[int, int, int, int]:
    """``[C, F, h, w]`` of a clip: the VAE's channels and its temporal and spatial compression of
    ``FRAMES × CANVAS²``."""
    temporal, spatial = int(vae.config.scale_factor_temporal), int(vae.config.scale_factor_spatial)
    side = md.CANVAS // spatial
    return (int(vae.config.z_dim), 1 + (md.FRAMES - 1) // temporal, side, side)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--build", type=Path, default=HERE / "build")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", type=Path, help="a folder written by mm convert dcp-to-hf")
    which.add_argument("--untrained", action="store_true", help="random init from build/model/config.json")
    parser.add_argument(
        "--model-config",
        type=Path,
        help="with --untrained: the folder whose config.json is the transformer (default: <build>/model, "
        "Wan; examples/ltx2_moving_digits/model for LTX-2)",
    )
    parser.add_argument("--captions", nargs="+", help="default: the held-out captions")
    parser.add_argument("--per-caption", type=int, default=4, help="clips per caption")
    parser.add_argument("--steps", type=int, default=30, help="Euler steps")
    parser.add_argument("--shift", type=float, default=1.0, help="σ schedule shift (1: none)")
    parser.add_argument(
        "--guidance", type=float, default=1.0, help="classifier-free guidance scale (1: the text alone)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--readme-strip", type=Path, help="also write the first clip of every caption here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.time()

    captions = args.captions or [md.caption(d, w) for d, w in md.HELD_OUT_PAIRS]
    for text in captions:
        md.parse_caption(text)
    if args.model_config is not None and not args.untrained:
        parser.error("--model-config goes with --untrained (an export's folder holds its own config.json)")
    name = "untrained" if args.untrained else "trained"
    folder = args.model if not args.untrained else args.model_config or args.build / "model"
    run = next(run for model_id, run in FAMILIES.values() if model_id == family_of(folder))
    out = args.out or REPO / "outputs" / run / f"samples_{name}"
    transformer = load_transformer(folder, not args.untrained, args.seed)
    vae = md.load_vae(args.build)
    encode_text = md.load_text_encoder(args.build)

    per_clip = [c for c in captions for _ in range(args.per_caption)]
    text, mask = text_batch(encode_text, per_clip)
    latents = euler_sample(
        transformer,
        text,
        mask,
        latent_shape(vae),
        args.steps,
        args.shift,
        args.seed,
        args.guidance,
    )
    clips = md.decode(vae, latents)
    images, labels = md.load_digit_images()
    info = json.loads((args.build / "build_info.json").read_text(encoding="utf-8"))
    train_ids, _ = md.split_images(len(images), int(info["seed"]))
    classifier = md.train_classifier(images[train_ids], labels[train_ids])
    scores = md.judge(classifier, clips, per_clip)
    per_caption = {
        c: md.judge(
            classifier, clips[i * args.per_caption : (i + 1) * args.per_caption], [c] * args.per_caption
        )
        for i, c in enumerate(captions)
    }
    firsts = clips[:: args.per_caption]
    md.save_png(md.strip(clips), out / "strip.png", zoom=2)
    md.save_gif(firsts, out / "samples.gif")
    if args.readme_strip is not None:
        md.save_png(md.strip(firsts), args.readme_strip, zoom=2)
    results = {
        "model": "untrained" if args.untrained else str(args.model),
        "captions": len(captions),
        "clips": len(clips),
        "steps": args.steps,
        "guidance": args.guidance,
        **scores,
        "per_caption": per_caption,
        "seconds": round(time.time() - start, 1),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in results.items() if k != "per_caption"}), flush=True)
    return results


if __name__ == "__main__":
    main()
