"""``tools.profile`` and ``tools.memory_profile`` on CPU (2 gloo ranks): the files they write open and hold
the chosen steps and ranks."""

from __future__ import annotations

import json

import pytest
from _memory_runs import run_variants


@pytest.mark.slow
def test_profile_and_memory_profile_write_what_they_recorded(tmp_path):
    run_variants(
        2,
        {
            "tools": [
                "tools.profile.enable=true",
                "tools.profile.ranks=[1]",
                "tools.profile.start_step=2",
                "tools.profile.end_step=3",
                "tools.profile.record_shapes=true",
                "tools.profile.with_memory=true",
                "tools.memory_profile.enable=true",
                "tools.memory_profile.ranks=[0,1]",
                "tools.memory_profile.start_step=1",
                "tools.memory_profile.end_step=2",
            ]
        },
        str(tmp_path),
    )
    prof = tmp_path / "tools" / "profile"
    assert sorted(p.name for p in prof.glob("trace_*.json")) == ["trace_rank1_steps2-3.json"]
    trace = json.loads((prof / "trace_rank1_steps2-3.json").read_text(encoding="utf-8"))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"train_step_2", "train_step_3"} <= names and "train_step_1" not in names
    assert any(n and n.startswith("aten::mm") for n in names)  # the model's matmuls were recorded
    assert any(e.get("name") == "[memory]" for e in trace["traceEvents"])  # with_memory
    assert "Name" in (prof / "ops_rank1_steps2-3.txt").read_text(encoding="utf-8")

    for rank in (0, 1):
        data = json.loads(
            (tmp_path / "tools" / "memory_profile" / f"memory_timeline_rank{rank}.json").read_text()
        )
        assert data["rank"] == rank and [s["step"] for s in data["steps"]] == [1, 2]
        for s in data["steps"]:
            assert 0 < s["rss_start_mb"] <= s["rss_peak_mb"] and s["rss_end_mb"] <= s["rss_peak_mb"]
            assert s["t_end_s"] > s["t_start_s"] and s["samples"] >= 2
        assert {x["step"] for x in data["samples"]} == {1, 2}
        assert all(x["rss_mb"] > 50 for x in data["samples"])  # a process with torch loaded holds more
