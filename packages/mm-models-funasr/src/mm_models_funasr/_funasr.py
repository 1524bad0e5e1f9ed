"""Import the optional ``funasr`` package (``pip install 'mm-models-funasr[paraformer]'``) once, on demand,
without letting the import change this process.

``import funasr`` imports every module of the package (about 7 s, scikit-learn included), prints a notice
about ffmpeg to stdout, turns every Python warning off (``warnings.filterwarnings("ignore")`` in one of its
modules) and configures the root logger at INFO (``logging.basicConfig`` in another). mm keeps its own
warnings and logging: the import runs with stdout captured, inside ``warnings.catch_warnings()`` (which
restores the filters), and the root logger's handlers and level are put back afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import logging
import warnings
from typing import Any

from mm_core.errors import ConfigError

#: the release the wrapper is written and tested against
FUNASR_VERSION = "1.4.16"
EXTRA = "mm-models-funasr[paraformer]"


@functools.cache
def paraformer_class() -> Any:
    """funasr's ``Paraformer`` class; ConfigError naming the extra when funasr is not installed."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            module = importlib.import_module("funasr.models.paraformer.model")
    except ImportError as exc:
        raise ConfigError(
            f"model.model_id: paraformer wraps the funasr package, which is not importable here "
            f"({type(exc).__name__}: {exc}); install it with pip install '{EXTRA}' "
            f"(funasr=={FUNASR_VERSION})"
        ) from None
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return module.Paraformer
