"""Plugin registries: in-process registration, unknown names, lazy lookup, duplicates and broken plugins.

Duplicate and broken plugins are real throwaway distributions: a ``*.dist-info`` folder (METADATA +
entry_points.txt) and a module in a temp folder put on ``sys.path`` of a fresh interpreter, which is how
``importlib.metadata`` discovers installed distributions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mm_core.errors import ConfigError, MMError, PluginError
from mm_core.registry import (
    REGISTRIES,
    collator_register,
    data_register,
    import_plugins,
    model_register,
    optimizer_register,
)


# ------------------------------------------------------------------------------- in-process registration
def test_register_get_and_unregister() -> None:
    name = "test_registry_tiny_model"

    @model_register.register(name)
    class Tiny:
        pass

    try:
        assert model_register.get(name) is Tiny
        assert name in model_register.names()
        info = next(i for i in model_register.infos() if i.name == name)
        assert info.kind == "model"
        assert info.provider == "<in-process>"
        assert info.target.endswith(":test_register_get_and_unregister.<locals>.Tiny")
    finally:
        model_register.unregister(name)
    assert name not in model_register.names()
    with pytest.raises(ConfigError, match=name):
        model_register.get(name)


def test_register_twice_with_another_object_is_an_error() -> None:
    name = "test_registry_twice"
    data_register.register(name)(dict)
    try:
        data_register.register(name)(dict)  # the same object again is harmless
        with pytest.raises(PluginError, match=f"dataset '{name}' is already registered"):
            data_register.register(name)(list)
        assert data_register.get(name) is dict
    finally:
        data_register.unregister(name)


def test_registries_are_independent() -> None:
    name = "test_registry_collator_only"
    collator_register.register(name)(len)
    try:
        assert collator_register.get(name) is len
        with pytest.raises(ConfigError):
            model_register.get(name)
    finally:
        collator_register.unregister(name)


def test_unregister_of_an_unknown_name_is_harmless() -> None:
    model_register.unregister("never_registered_anywhere")


def test_entry_points_resolve() -> None:
    from mm_core.optim.factory import build_adamw

    assert optimizer_register.get("adamw") is build_adamw
    cls = model_register.get("qwen3")
    assert cls.__name__ == "Qwen3ForTraining"
    assert {r.group for r in REGISTRIES} == {
        "mm.models",
        "mm.datasets",
        "mm.collators",
        "mm.optimizers",
        "mm.tasks",
    }


# ------------------------------------------------------------------------------------- unknown names
def test_unknown_name_lists_installed_names_and_closest_match() -> None:
    with pytest.raises(ConfigError) as info:
        model_register.get("qwen33")
    msg = str(info.value)
    assert msg.startswith("model.model_id: unknown model 'qwen33'")
    assert "did you mean 'qwen3'?" in msg
    assert "installed:" in msg and "qwen3" in msg.split("installed:", 1)[1]


def test_unknown_name_without_close_match() -> None:
    with pytest.raises(ConfigError) as info:
        data_register.get("zzzz_nothing_like_it")
    msg = str(info.value)
    assert msg.startswith("data.dataset_param.dataset_type: unknown dataset 'zzzz_nothing_like_it'")
    assert "did you mean" not in msg
    assert "text_pretrain" in msg and "sft" in msg


@pytest.mark.parametrize(
    ("registry", "key"),
    [
        (collator_register, "data.dataloader_param.collate_param.collator_id"),
        (optimizer_register, "training.optimizer"),
    ],
)
def test_unknown_name_names_the_config_key(registry, key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: unknown"):
        registry.get("no_such_plugin_name")


# ------------------------------------------------------------------------------------- training.plugin
@pytest.mark.parametrize("path", ["my_plugin.py", "plugins/my_model", "./plugins/my_model.py", "C:\\p\\m"])
def test_plugin_file_path_is_rejected_with_an_entry_point_explanation(path: str) -> None:
    with pytest.raises(ConfigError) as info:
        import_plugins(["json", path])
    msg = str(info.value)
    assert msg.startswith("training.plugin[1]: ")
    assert repr(path) in msg
    assert "entry points" in msg and "mm.models" in msg


def test_plugin_dotted_module_is_imported() -> None:
    import_plugins(["json.decoder"])
    assert "json.decoder" in sys.modules


def test_plugin_module_that_does_not_exist() -> None:
    with pytest.raises(PluginError) as info:
        import_plugins(["no_such_module_for_mm_tests"])
    assert "training.plugin[0]" in str(info.value) and "no_such_module_for_mm_tests" in str(info.value)
    assert issubclass(PluginError, MMError)


# ------------------------------------------------------------------------------------- fresh interpreters
def run_python(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )


def make_distribution(
    site: Path, dist: str, version: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str]
) -> None:
    """A minimal installed distribution: ``<dist>-<version>.dist-info`` plus top-level modules."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n", encoding="utf-8"
    )
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in eps.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines), encoding="utf-8")
    for name, source in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")


@pytest.fixture(scope="module")
def throwaway_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two throwaway distributions: one registers ``qwen3`` again (a duplicate), one is broken."""
    site = tmp_path_factory.mktemp("site")
    make_distribution(
        site,
        "mm-dup-plugin",
        "0.3.1",
        {"mm.models": {"qwen3": "mm_dup_plugin_mod:Other"}},
        {"mm_dup_plugin_mod": "class Other:\n    pass\n"},
    )
    make_distribution(
        site,
        "mm-broken-plugin",
        "0.0.7",
        {
            "mm.models": {"broken_model": "mm_broken_plugin_mod:Model"},
            "mm.datasets": {"fine_dataset": "mm_broken_fine_mod:Dataset"},
        },
        {
            "mm_broken_plugin_mod": "import mm_tests_module_not_installed\n\nclass Model:\n    pass\n",
            "mm_broken_fine_mod": "class Dataset:\n    pass\n",
        },
    )
    return site


def test_lookup_is_lazy() -> None:
    proc = run_python(
        """
        import json, sys
        from mm_core.registry import model_register
        model_register.get("qwen3")
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0].startswith("mm_"))))
        """
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "mm_models_qwen.qwen3" in loaded
    assert not any(m.startswith("mm_data_text") for m in loaded), loaded


def test_duplicate_and_broken_plugins_name_their_distributions(throwaway_site: Path) -> None:
    proc = run_python(
        """
        import json
        from mm_core.errors import PluginError
        from mm_core.registry import data_register, model_register
        out = {}
        for key, reg, name in [("dup", model_register, "qwen3"), ("broken", model_register, "broken_model"),
                               ("fine", data_register, "fine_dataset")]:
            try:
                out[key] = "ok: " + repr(reg.get(name))
            except PluginError as exc:
                out[key] = "PluginError: " + str(exc)
        out["names"] = model_register.names()
        out["providers"] = sorted({i.provider for i in model_register.infos()})
        print(json.dumps(out))
        """,
        extra_path=throwaway_site,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    dup = out["dup"]
    assert dup.startswith("PluginError: model 'qwen3' is registered twice"), dup
    assert "mm-models-qwen 0.1.0" in dup and "mm-dup-plugin 0.3.1" in dup
    assert "mm_dup_plugin_mod:Other" in dup and "mm_models_qwen.qwen3:Qwen3ForTraining" in dup

    broken = out["broken"]
    assert broken.startswith(
        "PluginError: model 'broken_model' from mm-broken-plugin 0.0.7 failed to import"
    ), broken
    assert "mm_broken_plugin_mod:Model" in broken
    assert "ModuleNotFoundError" in broken and "mm_tests_module_not_installed" in broken

    # another entry point of the same broken distribution still loads: only what is asked for is imported
    assert out["fine"].startswith("ok: <class 'mm_broken_fine_mod.Dataset'>"), out["fine"]
    assert "broken_model" in out["names"] and "qwen3" in out["names"]
    assert {"mm-dup-plugin 0.3.1", "mm-broken-plugin 0.0.7", "mm-models-qwen 0.1.0"} <= set(out["providers"])


def test_mm_plugins_lists_throwaway_distributions_without_importing_them(throwaway_site: Path) -> None:
    proc = run_python(
        """
        import sys
        from mm_core.cli import main
        code = main(["plugins"])
        assert "mm_broken_plugin_mod" not in sys.modules, "mm plugins must not import plugins"
        sys.exit(code)
        """,
        extra_path=throwaway_site,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {tuple(line.split()[:3]) for line in proc.stdout.splitlines()}
    assert ("model", "broken_model", "mm-broken-plugin") in rows
    assert ("model", "qwen3", "mm-dup-plugin") in rows
    assert ("model", "qwen3", "mm-models-qwen") in rows
    assert ("dataset", "fine_dataset", "mm-broken-plugin") in rows
