"""Path patterns: ``model.layers.{*}``, ``model.layers.{0-3}.mlp``, ``visual.*.attn``, ``*.bias``.

The one pattern language of mm, for module paths (plans, ``model.freeze``) and parameter paths (Muon
exclusions) alike; a pattern matches a whole dotted path:

- ``{*}`` matches one integer path component,
- ``{a-b}`` matches one integer component in the inclusive range a..b,
- ``*`` matches any text inside one component (never a dot).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence

from torch import nn

_TOKEN = re.compile(r"\{\*\}|\{(\d+)-(\d+)\}|\*")


class PatternError(ValueError):
    """A module pattern is malformed or matches no module."""


class ModulePattern:
    """One compiled pattern; ``matches(name)`` tests a dotted module or parameter path."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._ranges: list[tuple[int, int]] = []
        parts: list[str] = []
        pos = 0
        for m in _TOKEN.finditer(text):
            parts.append(re.escape(text[pos : m.start()]))
            if m.group(0) == "{*}":
                parts.append(r"(?:\d+)")
            elif m.group(0) == "*":
                parts.append(r"[^.]*")
            else:
                lo, hi = int(m.group(1)), int(m.group(2))
                if lo > hi:
                    raise PatternError(f"pattern {text!r}: range {{{lo}-{hi}}} is empty (write {{low-high}})")
                self._ranges.append((lo, hi))
                parts.append(r"(\d+)")
            pos = m.end()
        parts.append(re.escape(text[pos:]))
        if "{" in text.replace("{*}", "") and not self._ranges:
            raise PatternError(f"pattern {text!r}: braces must be {{*}} or {{low-high}}")
        self._regex = re.compile("".join(parts) + r"\Z")

    def matches(self, name: str) -> bool:
        m = self._regex.match(name)
        if m is None:
            return False
        return all(lo <= int(v) <= hi for v, (lo, hi) in zip(m.groups(), self._ranges))

    def __repr__(self) -> str:
        return f"ModulePattern({self.text!r})"


def _generalise(name: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.{*}.mlp``: the shape of a path, for suggestions."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "{*}", name)


def near_misses(pattern: str, names: Iterable[str], n: int = 3) -> list[str]:
    """Module path shapes that look like ``pattern``, for error messages."""
    shapes = list(dict.fromkeys(_generalise(x) for x in names if x))
    return difflib.get_close_matches(pattern, shapes, n=n, cutoff=0.5)


def match_paths(
    patterns: Iterable[str], names: Sequence[str], *, kind: str = "module", allow_empty: bool = False
) -> dict[str, list[str]]:
    """Map each pattern to the ``names`` (dotted paths of ``kind``: module, parameter) it matches, in order.

    Raises :class:`PatternError` when a pattern matches nothing (unless ``allow_empty``), listing the
    closest path shapes.
    """
    result: dict[str, list[str]] = {}
    for text in patterns:
        pat = ModulePattern(text)
        hits = [name for name in names if pat.matches(name)]
        if not hits and not allow_empty:
            close = near_misses(text, names)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise PatternError(f"pattern {text!r} matches no {kind}{hint}")
        result[text] = hits
    return result


def match_modules(
    model: nn.Module, patterns: Iterable[str], *, allow_empty: bool = False
) -> dict[str, list[str]]:
    """Map each pattern to the names of the modules it matches, in ``named_modules()`` order.

    Raises :class:`PatternError` when a pattern matches nothing (unless ``allow_empty``), listing the
    closest module path shapes.
    """
    return match_paths(patterns, [name for name, _ in model.named_modules()], allow_empty=allow_empty)


def select_modules(model: nn.Module, patterns: Iterable[str]) -> list[tuple[str, nn.Module]]:
    """The modules matched by any pattern, each once, in execution-independent ``named_modules()`` order."""
    wanted = {name for hits in match_modules(model, patterns).values() for name in hits}
    return [(name, mod) for name, mod in model.named_modules() if name in wanted]
