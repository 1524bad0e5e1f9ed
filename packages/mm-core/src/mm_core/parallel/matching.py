"""Every module pattern of a build matched in one walk over the model's modules."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from mm_core.errors import ConfigError
from mm_parallel.patterns import match_modules, near_misses


class ModuleMatches:
    """The matches of ``patterns`` in ``model`` (one ``match_modules`` walk); :meth:`__call__` gives the
    matches of some of them with errors that name the YAML key."""

    def __init__(self, model: nn.Module, patterns: Sequence[str]) -> None:
        #: every module name of the model, in ``named_modules()`` order
        self.names = [n for n, _ in model.named_modules()]
        wanted = list(dict.fromkeys(patterns))
        self._hits = match_modules(model, wanted, allow_empty=True) if wanted else {}

    def __call__(self, patterns: Sequence[str], key: str) -> dict[str, list[str]]:
        """Pattern -> matched module names; a pattern that matches nothing is an error naming ``key``."""
        out: dict[str, list[str]] = {}
        for text in patterns:
            hits = self._hits[text]
            if not hits:
                close = near_misses(text, self.names)
                hint = f"; did you mean {' or '.join(close)}?" if close else ""
                raise ConfigError(f"{key}: pattern {text!r} matches no module{hint}")
            out[text] = hits
        return out

    def select(self, patterns: Sequence[str], key: str) -> tuple[str, ...]:
        """The modules any of ``patterns`` matches, each once, in model order."""
        wanted = {n for hits in self(patterns, key).values() for n in hits}
        return tuple(n for n in self.names if n in wanted)

    def every(self, patterns: Sequence[str]) -> tuple[str, ...]:
        """Every match of ``patterns``, pattern by pattern (a pattern that matches nothing adds none)."""
        return tuple(n for text in patterns for n in self._hits[text])
