"""Opening training images safely: a pixel limit checked from the file header, and reduced-size decoding.

A 45-byte PNG can claim 30000 × 30000 pixels, and a real 9400 × 9400 photo costs over a gigabyte and
seconds to decode at full size, only for the image processor to shrink it to about a megapixel. So:

1. The size is read from the header (``Image.open`` reads no pixels) and an image over the limit is
   refused before anything is decoded. Pillow's own decompression-bomb error (and its warning, when warnings
   are errors) is reported the same way. Pillow's process-wide ``MAX_IMAGE_PIXELS`` is never changed.
2. When the processor's target is much smaller than the source, the image is decoded at a reduced size:
   JPEG through ``draft`` (the decoder produces 1/2, 1/4 or 1/8 scale directly, so the full image never
   exists in memory), other formats by ``reduce`` (a fast box filter) right after decoding. The reduced
   image keeps at least twice the target's width and height, so the processor's own resize still decides
   the final size and the result matches a full decode up to resampling detail.

:func:`loaded_size` gives the size :func:`load_image` would return from the header alone (same limit, same
draft scale, no pixel decoded): preparation uses it to count an image's tokens without decoding it.

Every failure is an ``OSError`` naming the file; the dataset turns it into a ``DataError`` naming the record
(which ``data.dataset_param.on_error: skip`` counts and skips).
"""

from __future__ import annotations

import contextlib
import math
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: default of ``preprocess_parameters.image_max_source_pixels``: Pillow's own ``MAX_IMAGE_PIXELS`` (the size
#: at which it warns of a possible decompression bomb), about 9459 × 9459; 256 MiB decoded as RGB
DEFAULT_MAX_SOURCE_PIXELS = 1024 * 1024 * 1024 // 4 // 3

LIMIT_KEY = "data.dataset_param.preprocess_parameters.image_max_source_pixels"

#: the decoded image keeps at least this many times the target's width and height before the final resize
KEEP_FACTOR = 2


def reduce_factor(pixels: int, target_pixels: int | None) -> int:
    """By how much each side of an image of ``pixels`` may shrink while keeping ``KEEP_FACTOR`` × the
    target's width and height (1: not at all)."""
    if not target_pixels or pixels <= 0:
        return 1
    return max(1, math.isqrt(pixels // (KEEP_FACTOR * KEEP_FACTOR * target_pixels)))


class ImageTooLarge(OSError):
    """The header says the image has more pixels than the limit; nothing was decoded."""


#: what Pillow raises on broken files (besides OSError and ValueError: truncated chunks, bad streams)
_DECODE_ERRORS = (OSError, ValueError, EOFError, SyntaxError, struct.error, zlib.error)


@contextlib.contextmanager
def _opened(path: Path, max_source_pixels: int | None) -> Iterator[Any]:
    """``path`` opened (header read, no pixel decoded) and checked against ``max_source_pixels``; Pillow's
    failures inside the block become an ``OSError`` naming the file."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            width, height = im.size
            pixels = width * height
            if max_source_pixels is not None and pixels > max_source_pixels:
                raise ImageTooLarge(
                    f"image {path} is {width}x{height} = {pixels:,} pixels (read from its header), over "
                    f"{LIMIT_KEY} = {max_source_pixels:,}; refused before decoding. Shrink the image, or "
                    "raise the limit if it is a genuine image"
                )
            yield im
    except ImageTooLarge:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise OSError(
            f"image {path} refused before decoding by Pillow's decompression-bomb check "
            f"(PIL.Image.MAX_IMAGE_PIXELS): {e}"
        ) from None
    except _DECODE_ERRORS as e:
        raise OSError(f"cannot read image {path}: {type(e).__name__}: {e}") from None


def _draft(im: Any, target_pixels: int | None) -> int:
    """Set up a JPEG's reduced-scale decoding (``draft``: no pixel is decoded yet); returns the factor left
    for ``reduce`` after decoding (1: none)."""
    factor = reduce_factor(im.size[0] * im.size[1], target_pixels)
    if factor > 1 and im.format == "JPEG":
        # the decoder picks the largest of 1/1, 1/2, 1/4, 1/8 that is still at least this size
        width, height = im.size
        im.draft("RGB", (-(-width // factor), -(-height // factor)))
        factor = reduce_factor(im.size[0] * im.size[1], target_pixels)
    return factor


def load_image(
    path: Path, *, max_source_pixels: int | None = DEFAULT_MAX_SOURCE_PIXELS, target_pixels: int | None = None
) -> Any:
    """Open ``path`` as an RGB ``PIL.Image``, refusing more than ``max_source_pixels`` (None: no limit of
    mm's own) before decoding, and decoding at a reduced size when ``target_pixels`` (the processor's
    largest output, in pixels) is much smaller than the source. Raises ``OSError`` naming the file."""
    with _opened(path, max_source_pixels) as im:
        factor = _draft(im, target_pixels)
        im.load()
        if factor > 1:
            # RGB and L reduce directly; other modes (P, RGBA, CMYK, ...) become RGB first, as always
            out = (im if im.mode in ("RGB", "L") else im.convert("RGB")).reduce(factor)
        else:
            out = im
        # always a new image: the opened one is released when the with-block closes it
        return out.convert("RGB")


def loaded_size(
    path: Path, *, max_source_pixels: int | None = DEFAULT_MAX_SOURCE_PIXELS, target_pixels: int | None = None
) -> tuple[int, int]:
    """The ``(width, height)`` of the image :func:`load_image` returns for the same arguments, from the file
    header alone (no pixel decoded): the header's size, after the JPEG decoder's draft scale and ``reduce``
    (which rounds up). Refuses and raises exactly as :func:`load_image` does before decoding."""
    with _opened(path, max_source_pixels) as im:
        factor = _draft(im, target_pixels)
        width, height = im.size
        return -(-width // factor), -(-height // factor)
