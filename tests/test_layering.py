"""Layering (ARCHITECTURE §1): ``torch <- mm-parallel <- mm-core <- plugins``; nothing imports to its right.

The packages are read from ``packages/*/pyproject.toml`` (distribution name, import name under ``src/``,
declared dependencies), so a new package is covered without editing this file. Each package is imported in a
fresh interpreter (alone, then with every one of its submodules; two interpreters at a time) and the modules
it pulled in are checked: a plugin may load another plugin only through its declared dependencies (directly or
transitively). Every import statement of a package's source names only the standard library, the package
itself and distributions it declares (its own extras included), directly or through their dependencies.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as metadata
import json
import pathlib
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")

ROOT = pathlib.Path(__file__).resolve().parents[1]
LEAF, CORE = "mm-parallel", "mm-core"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Package:
    """One package of the monorepo, as its ``pyproject.toml`` and ``src/`` folder declare it."""

    dist: str
    module: str
    path: pathlib.Path
    requires: tuple[Requirement, ...]  # dependencies and every extra's
    extras: tuple[str, ...]

    @property
    def mm_deps(self) -> set[str]:
        """The monorepo distributions it declares (plain dependencies, not extras)."""
        return {
            _canonical(r.name) for r in self.requires if r.marker is None and _canonical(r.name) in PACKAGES
        }


def _read_package(pyproject: pathlib.Path) -> Package:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    src = pyproject.parent / "src"
    modules = [d.name for d in src.iterdir() if (d / "__init__.py").is_file()]
    assert len(modules) == 1, f"{src}: expected one import package, found {modules}"
    optional = project.get("optional-dependencies", {})
    requires = [Requirement(r) for r in project.get("dependencies", [])]
    for extra, reqs in optional.items():
        requires += [Requirement(f"{r}; extra == '{extra}'") for r in reqs if extra != "test"]
    return Package(
        _canonical(project["name"]), modules[0], src / modules[0], tuple(requires), tuple(optional)
    )


PACKAGES: dict[str, Package] = {}
for _file in sorted(ROOT.glob("packages/*/pyproject.toml")):
    _pkg = _read_package(_file)
    PACKAGES[_pkg.dist] = _pkg
MODULES = {p.module: p for p in PACKAGES.values()}
PLUGINS = sorted(p.module for p in PACKAGES.values() if p.dist not in (LEAF, CORE))


def closure(dist: str) -> set[str]:
    """``dist`` and every monorepo distribution it depends on, directly or transitively."""
    seen, todo = set(), [dist]
    while todo:
        cur = todo.pop()
        if cur not in seen:
            seen.add(cur)
            todo.extend(PACKAGES[cur].mm_deps)
    return seen


def forbidden_for(module: str) -> set[str]:
    """Top-level packages that ``module`` must never import: every monorepo package outside its declared
    dependencies (so nothing to its right), ``torch_npu`` (imported lazily), for mm-parallel transformers."""
    allowed = {PACKAGES[d].module for d in closure(MODULES[module].dist)}
    out = (set(MODULES) - allowed) | {"torch_npu"}
    if MODULES[module].dist == LEAF:
        out |= {"transformers"}
    return out


def test_the_package_list_is_read_from_packages() -> None:
    dirs = {p.parent.name for p in ROOT.glob("packages/*/pyproject.toml")}
    assert {p.path.parents[1].name for p in PACKAGES.values()} == dirs
    assert {"mm_parallel", "mm_core", "mm_models_minimax"} <= set(MODULES)
    assert PACKAGES[LEAF].mm_deps == set() and PACKAGES[CORE].mm_deps == {LEAF}
    for name in PLUGINS:
        assert CORE in closure(MODULES[name].dist), f"{name} does not depend on {CORE}"


def test_the_plugin_dependency_graph_has_no_cycle() -> None:
    for pkg in PACKAGES.values():
        for dep in pkg.mm_deps:
            assert pkg.dist not in closure(dep), f"{pkg.dist} and {dep} depend on each other"


_PROBE = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    name = sys.argv[1]
    pkg = importlib.import_module(name)
    alone = {"imported": [name], "modules": sorted({m.split(".")[0] for m in sys.modules})}
    imported = [name]
    for info in pkgutil.walk_packages(pkg.__path__, name + "."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue  # running it would start a program
        importlib.import_module(info.name)
        imported.append(info.name)
    walked = {"imported": imported, "modules": sorted({m.split(".")[0] for m in sys.modules})}
    print(json.dumps({"package": alone, "every-submodule": walked}))
    """
)


def _probe_process(package: str) -> dict:
    """One fresh interpreter: the modules loaded by importing ``package`` alone, then with all its
    submodules."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, package], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def _probes() -> dict[str, dict]:
    """Every package probed, two interpreters at a time (each is one core's work: imports)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(sorted(MODULES), pool.map(_probe_process, sorted(MODULES))))


def probe(package: str, walk: bool) -> dict:
    """Modules loaded by importing ``package`` (with ``walk``: all its submodules) in a fresh interpreter."""
    return _probes()[package]["every-submodule" if walk else "package"]


@pytest.mark.parametrize("walk", [False, True], ids=["package", "every-submodule"])
@pytest.mark.parametrize("package", sorted(MODULES))
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


def _imports(path: pathlib.Path) -> dict[str, str]:
    """The top-level names a package's source imports (absolute imports, function-level ones included),
    each with the first place it is imported (``file:line``)."""
    found: dict[str, str] = {}
    for f in sorted(path.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], f"{f.relative_to(ROOT)}:{node.lineno}")
    return found


@functools.cache
def _installed_requires(dist: str) -> tuple[str, ...]:
    """The plain (no extra) dependencies of an installed third-party distribution."""
    try:
        lines = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return ()
    reqs = [Requirement(line) for line in lines]
    return tuple(_canonical(r.name) for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""}))


def declared(pkg: Package) -> set[str]:
    """The distributions ``pkg`` may import: its own dependencies and extras, and theirs, transitively."""
    seen: set[str] = set()
    todo = [pkg.dist]
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        if cur == pkg.dist:
            todo += [_canonical(r.name) for r in pkg.requires]
        elif cur in PACKAGES:
            todo += [_canonical(r.name) for r in PACKAGES[cur].requires if r.marker is None]
        else:
            todo += _installed_requires(cur)
    return seen


@pytest.mark.parametrize("package", sorted(MODULES))
def test_imports_name_only_declared_packages(package: str) -> None:
    pkg = MODULES[package]
    allowed = declared(pkg)
    providers = metadata.packages_distributions()
    undeclared = []
    for name, where in sorted(_imports(pkg.path).items()):
        if name in sys.stdlib_module_names or name == package:
            continue
        dists = {PACKAGES[MODULES[name].dist].dist} if name in MODULES else set()
        dists |= {_canonical(d) for d in providers.get(name, [])} or {_canonical(name)}
        if not dists & allowed:
            undeclared.append(f"{name} ({where}; provided by {', '.join(sorted(dists))})")
    assert not undeclared, f"{pkg.dist} imports packages it does not declare: {undeclared}"


def test_declared_follows_dependencies_not_the_environment() -> None:
    # a sibling plugin installed beside it is not declared; one reached through a declared plugin is
    assert "mm-data-vlm" not in declared(MODULES["mm_models_qwen"])
    assert {"mm-data-vlm", "mm-core", "transformers", "torch"} <= declared(MODULES["mm_data_audio"])
    assert "diffusers" in declared(MODULES["mm_models_video"])  # a plain dependency, not an extra
    assert "mm_models_qwen" in forbidden_for("mm_data_audio")
    assert "mm_data_vlm" not in forbidden_for("mm_data_audio")
