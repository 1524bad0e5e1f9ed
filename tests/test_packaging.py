"""Each package builds alone from its own folder into a wheel that holds only its own import package,
with the dependencies and entry points the architecture fixes."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
import tomllib
from _mm import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PACKAGES = {
    "mm-parallel": ("mm_parallel", set()),
    "mm-core": ("mm_core", {"mm-parallel"}),
    "mm-models-qwen": ("mm_models_qwen", {"mm-core"}),
    "mm-models-kimi": ("mm_models_kimi", {"mm-core"}),
    "mm-models-minimax": ("mm_models_minimax", {"mm-core"}),
    "mm-models-step": ("mm_models_step", {"mm-core"}),
    "mm-data-text": ("mm_data_text", {"mm-core"}),
    "mm-data-vlm": ("mm_data_vlm", {"mm-core"}),
    "mm-data-audio": ("mm_data_audio", {"mm-core", "mm-data-vlm"}),
    "mm-models-funasr": ("mm_models_funasr", {"mm-core"}),
    "mm-models-video": ("mm_models_video", {"mm-core"}),
    "mm-data-video": ("mm_data_video", {"mm-core"}),
    "mm-models-cosyvoice": ("mm_models_cosyvoice", {"mm-core", "mm-data-audio"}),
}
#: the library a package exists for: a plain dependency, not an extra
LIBRARY = {"mm-models-video": "diffusers"}


def test_every_package_folder_is_listed():
    assert set(PACKAGES) == {p.parent.name for p in (REPO / "packages").glob("*/pyproject.toml")}


@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_package_builds_alone(dist, tmp_path):
    import_name, mm_deps = PACKAGES[dist]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO / "packages" / dist),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/", 1)[0] for name in zf.namelist()}
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [
            line.split(":", 1)[1].strip()
            for line in zf.read(meta).decode().splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line
        ]
    assert tops - {import_name} == {n for n in tops if n.endswith(".dist-info")}
    names = {
        r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip() for r in requires
    }
    assert {n for n in names if n.startswith("mm-")} == mm_deps
    if dist in LIBRARY:
        assert LIBRARY[dist] in names
    assert "torch_npu" not in names  # optional extra only


#: libraries whose internals mm uses (subclassed modules, private layouts): a package names the releases its
#: tests passed with, never an open-ended range
INTERNALS_USED = {"transformers", "diffusers", "funasr"}


def _declared() -> list[tuple[str, Requirement]]:
    """Every (package folder, requirement) of every package's dependencies and optional extras."""
    out = []
    for pyproject in sorted((REPO / "packages").glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        reqs = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            reqs += extra
        out += [(pyproject.parent.name, Requirement(r)) for r in reqs]
    return out


def test_libraries_whose_internals_are_used_have_tested_bounds() -> None:
    for folder, req in _declared():
        if req.name in INTERNALS_USED:
            ops = {spec.operator for spec in req.specifier}
            assert ops == {"=="} or ("<" in ops and ">=" in ops), f"{folder}: {req} is open-ended"


#: extras that build only against an accelerator's toolkit (never installed on CI's CPU machine)
ACCELERATOR_ONLY = {"torch-npu", "flash-attn"}


def test_constraints_pin_every_third_party_dependency() -> None:
    """CI installs through constraints.txt: each third-party requirement is pinned there, satisfying it."""
    pins = {}
    for line in (REPO / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = next(iter(req.specifier)).version
    for folder, req in _declared():
        name = canonicalize_name(req.name)
        if name.startswith("mm-") or name in ACCELERATOR_ONLY:
            continue
        assert name in pins, f"{folder}: {req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"{folder}: {req} excludes {pins[name]}"
