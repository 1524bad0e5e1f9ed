"""Every real-size configuration under ``examples/real_size`` is simulated at the world size its header names
(``mm check --simulate``: the model at its published size on meta, the run's meshes on torch's fake process
group) and fits a 64 GiB device, its activations estimated; the parameters counted are those of the published
model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _mm import REPO

from mm_core.config import load_config

CASES = sorted((REPO / "examples" / "real_size").glob("*.yaml"))
#: billions of parameters of each case's model as built (the published sizes, rounded)
PARAMETERS = {
    "qwen3_vl_30b_a3b": (30, 32),
    "qwen3_omni_30b_a3b": (30, 32),
    "kimi_k25": (1000, 1060),
    "qwen3_5_35b_a3b": (35, 36),
    "qwen3_6_35b_a3b": (35, 36),
    "qwen3_5_27b": (27, 28),
    "qwen3_5_397b_a17b": (390, 400),
    "ltx2": (18, 20),
    "qwen3_tts_1p7b": (1.7, 2.0),
    "fun_asr_nano": (0.7, 0.9),
    "cosyvoice3_lm": (0.45, 0.55),
}


def _world_size(path: Path) -> int:
    found = re.search(r"--world-size (\d+)", path.read_text(encoding="utf-8"))
    assert found, f"{path.name}: its header names no --world-size"
    return int(found.group(1))


def test_every_case_has_its_size():
    assert {p.stem for p in CASES} == set(PARAMETERS)


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_real_size_case_fits_at_its_world_size(path, monkeypatch):
    from mm_core.simulate import simulate

    monkeypatch.chdir(REPO)
    world = _world_size(path)
    result = simulate(load_config(str(path)), world)
    assert result.fits, result.describe()
    assert result.process_groups <= 4
    # activations: the estimate under the recompute plan (each layer's input, one layer's working set), for
    # every case: decoders from their text config, LTX-2, Qwen3-TTS and CosyVoice3's LM from their own counts
    assert result.activations > 0, result.activations
    # parameters: 4 bytes each (fp32 shards), rank 0 holds at most a few rows more than an even share
    low, high = PARAMETERS[path.stem]
    billions = result.params * world / 4 / 1e9
    assert low <= billions <= high * 1.01, billions
