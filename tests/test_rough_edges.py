"""Bad inputs that once ended in a library's traceback now end in one line naming the cause (issue 31,
point 7). Each case runs ``mm`` as a user types it, in this process (``_mm.mm_here``) where no worker is
needed; the data-preparation cases live with the text data package
(packages/mm-data-text/tests/test_text_prepared.py: a source gone mid-preparation, ``cache_dir`` naming a
file, ``mm data verify`` with nothing prepared)."""

from __future__ import annotations

import json
from pathlib import Path

from _mm import QUICKSTART, mm_here


def _qwen3_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "qwen3_model"
    folder.mkdir()
    config = json.loads((QUICKSTART.parent / "model" / "config.json").read_text(encoding="utf-8"))
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def test_a_folder_of_another_architecture_is_named(tmp_path: Path) -> None:
    """qwen3 weights run as ``qwen3_moe`` or ``qwen3_5``: the key, both model types and the id that fits
    (before: ``AttributeError: 'Qwen3Config' object has no attribute 'mlp_only_layers'``)."""
    folder = _qwen3_folder(tmp_path)
    for model_id in ("qwen3_moe", "qwen3_5"):
        done = mm_here(
            "check", QUICKSTART, f"model.model_id={model_id}", f"model.model_name_or_path={folder}"
        )
        errors = [line for line in done.stderr.splitlines() if line.startswith("mm: error")]
        assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
        assert f"model.model_id: {model_id!r}" in errors[0] and f"takes a {model_id!r} config" in errors[0]
        assert "model_type 'qwen3'" in errors[0] and "model.model_id: 'qwen3' builds it" in errors[0]
        assert "Traceback" not in done.stderr


def test_a_crash_while_checking_before_the_launch_is_summarised(tmp_path: Path) -> None:
    """``mm train --nproc-per-node N`` checks the config before starting workers; a crash inside a model
    class there (an activation transformers does not know) prints the innermost frames and one summary
    line, as a worker's crash does."""
    done = mm_here(
        "train",
        QUICKSTART,
        "--nproc-per-node",
        "1",
        "model.config_overrides.hidden_act=no_such_activation",
        f"training.output_dir={tmp_path / 'out'}",
    )
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last == "mm: the check before starting the workers failed: KeyError: 'no_such_activation'", last
    assert "innermost frames" in done.stderr and "activations.py" in done.stderr
