"""mm's one path-pattern language (``{*}``, ``{a-b}``, ``*`` inside one component), for module paths and
parameter paths alike, including the Muon classifier's exclusions."""

from __future__ import annotations

import pytest
from torch import nn

from mm_parallel.optim import classify_muon_params
from mm_parallel.patterns import ModulePattern, PatternError, match_modules, match_paths


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(4, 4)
        self.k_proj = nn.Linear(4, 4)
        self.gate = nn.Linear(4, 2, bias=False)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(12))
        self.head = nn.Linear(4, 8, bias=False)


def test_the_language() -> None:
    assert ModulePattern("layers.{*}.q_proj").matches("layers.11.q_proj")
    assert not ModulePattern("layers.{*}.q_proj").matches("layers.x.q_proj")
    assert ModulePattern("layers.{2-10}").matches("layers.10")
    assert not ModulePattern("layers.{2-10}").matches("layers.11")
    assert ModulePattern("layers.{*}.*_proj.weight").matches("layers.3.k_proj.weight")
    assert not ModulePattern("layers.*").matches("layers.3.k_proj")  # * never crosses a dot
    assert not ModulePattern("*.weight").matches("layers.3.k_proj.weight")
    with pytest.raises(PatternError, match="braces"):
        ModulePattern("layers.{x}")


def test_match_paths_names_the_kind_and_near_misses() -> None:
    params = [n for n, _ in _Model().named_parameters()]
    hits = match_paths(["layers.{0-1}.*_proj.bias"], params, kind="parameter")
    assert hits == {"layers.{0-1}.*_proj.bias": [f"layers.{i}.{m}_proj.bias" for i in (0, 1) for m in "qk"]}
    with pytest.raises(PatternError, match=r"matches no parameter; did you mean layers.\{\*\}.gate.weight"):
        match_paths(["layers.{*}.gat.weight"], params, kind="parameter")
    assert match_paths(["nothing"], params, allow_empty=True) == {"nothing": []}
    assert match_modules(_Model(), ["layers.{10-11}"]) == {"layers.{10-11}": ["layers.10", "layers.11"]}


def test_muon_exclusions_use_the_language() -> None:
    model = _Model()
    plan = classify_muon_params(
        model, exclude=["layers.{*}.q_proj.weight"], exclude_modules=["layers.{0-5}.gate"]
    )
    use = {d.name: d.use_muon for d in plan.decisions}
    assert not any(use[f"layers.{i}.q_proj.weight"] for i in range(12))
    assert all(use[f"layers.{i}.k_proj.weight"] for i in range(12))
    assert not any(use[f"layers.{i}.gate.weight"] for i in range(6))
    assert all(use[f"layers.{i}.gate.weight"] for i in range(6, 12))
    # fnmatch's '*' crossed dots; this language's does not, so such a pattern matches nothing and says so
    with pytest.raises(ValueError, match=r"exclude pattern 'layers\.\*\.weight' matches no parameter"):
        classify_muon_params(model, exclude=["layers.*.weight"])
    with pytest.raises(ValueError, match=r"exclude_modules pattern 'layers.\{\*\}.gat' matches no module"):
        classify_muon_params(model, exclude_modules=["layers.{*}.gat"])
