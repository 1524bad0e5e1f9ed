"""Layering (ARCHITECTURE §1): ``torch <- mm-parallel <- mm-core <- plugins``; nothing imports to its right.

Each package is imported in a fresh interpreter (alone, and with every one of its submodules) and the
modules it pulled in are checked. Plugins are siblings: none may import another plugin either.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap

import pytest

ORDER = [
    "mm_parallel",
    "mm_core",
    "mm_models_qwen",
    "mm_models_kimi",
    "mm_models_step",
    "mm_data_text",
    "mm_data_vlm",
    "mm_data_audio",
    "mm_models_funasr",
    "mm_models_video",
    "mm_data_video",
    "mm_models_cosyvoice",
]
PLUGINS = {
    "mm_models_qwen",
    "mm_models_kimi",
    "mm_models_minimax",
    "mm_models_step",
    "mm_data_text",
    "mm_data_vlm",
    "mm_data_audio",
    "mm_models_funasr",
    "mm_models_video",
    "mm_data_video",
    "mm_models_cosyvoice",
}


def forbidden_for(package: str) -> set[str]:
    """Top-level packages that ``package`` must never import."""
    right = set(ORDER[ORDER.index(package) + 1 :]) | PLUGINS
    right.discard(package)
    out = right | {"torch_npu"}
    if package == "mm_parallel":
        out |= {"transformers", "mm_core"}
    return out


_PROBE = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    name, walk = sys.argv[1], sys.argv[2] == "1"
    pkg = importlib.import_module(name)
    imported = [name]
    if walk:
        for info in pkgutil.walk_packages(pkg.__path__, name + "."):
            if info.name.rsplit(".", 1)[-1] == "__main__":
                continue  # running it would start a program
            importlib.import_module(info.name)
            imported.append(info.name)
    print(json.dumps({"imported": imported, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
    """
)


@functools.cache
def probe(package: str, walk: bool) -> dict:
    """Modules loaded by importing ``package`` (with ``walk``: all its submodules) in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, package, "1" if walk else "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("walk", [False, True], ids=["package", "every-submodule"])
@pytest.mark.parametrize("package", ORDER)
def test_no_import_to_the_right(package: str, walk: bool) -> None:
    result = probe(package, walk)
    loaded = set(result["modules"])
    assert package in loaded
    bad = sorted(loaded & forbidden_for(package))
    assert not bad, f"importing {package} ({len(result['imported'])} modules) imported {bad}"
    if walk:
        assert len(result["imported"]) > 1, f"{package} has no submodules? {result['imported']}"


def test_the_probe_detects_a_violation() -> None:
    # guard against a probe that can never fail: the same check on mm_core's modules would flag them
    loaded = set(probe("mm_core", walk=True)["modules"])
    assert {"mm_core", "transformers"} <= loaded & forbidden_for("mm_parallel")


def test_mm_parallel_submodules_are_covered() -> None:
    imported = set(probe("mm_parallel", walk=True)["imported"])
    for name in ("mm_parallel.fsdp", "mm_parallel.patterns", "mm_parallel.device", "mm_parallel.grad"):
        assert name in imported


def test_mm_core_imports_run_one_way() -> None:
    """cli -> launch -> train entry -> Trainer: the entry never imports the CLI or the launcher, and no module
    of any package imports another that imports it back (function-level imports included)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    modules: dict[str, pathlib.Path] = {}
    for f in root.glob("packages/*/src/**/*.py"):
        src = next(p for p in f.parents if p.name == "src")
        modules[".".join(f.relative_to(src).with_suffix("").parts).removesuffix(".__init__")] = f
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, f in modules.items():
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for n in names:
                while n and n not in modules:
                    n = n.rpartition(".")[0]
                if n and n != m and not m.startswith(n + "."):
                    graph[m].add(n)

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            cur = todo.pop()
            if cur == b:
                return True
            if cur not in seen:
                seen.add(cur)
                todo.extend(graph[cur])
        return False

    chain = ["mm_core.cli", "mm_core.launch", "mm_core.train.entry", "mm_core.train.trainer"]
    for upper, lower in zip(chain, chain[1:]):
        assert lower in graph[upper] or reaches(upper, lower), f"{upper} should import {lower}"
        assert not reaches(lower, upper), f"{lower} imports {upper} (imports must run one way)"
    cycles = [(a, b) for a in graph for b in graph[a] if reaches(b, a)]
    assert not cycles, f"import cycles: {cycles[:5]}"
