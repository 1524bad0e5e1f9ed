"""The process group and device meshes that ``init_parallel_state`` builds (issue #12 / #11).

On 4 gloo ranks, for each layout (FSDP, HSDP, Ulysses, ring x Ulysses, expert parallel): every mesh dimension
has the ranks ``init_device_mesh`` would give it, and every group (the world included) has the collective
timeout of ``parallel.timeout_minutes``, not torch's default. Plus the backend strings for accelerators."""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _launch import START_METHOD

from mm_core.errors import ConfigError
from mm_parallel.device import group_backend, process_group_backend

WORLD = 4
TIMEOUT_MIN = 7
LAYOUTS = [
    {},
    {"fully_shard_parallel_size": 2},
    {"ulysses_parallel_size": 2},
    {"ring_attention_size": 2, "ulysses_parallel_size": 2},
    {"expert_parallel_size": 2},
]


def _timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout  # test-side inspection only


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1",
    )  # fmt: skip
    from torch.distributed.device_mesh import init_device_mesh

    from mm_core.config.schema import ParallelConfig
    from mm_core.parallel.state import init_parallel_state

    def reference(mesh):
        return init_device_mesh("cpu", tuple(mesh.mesh.shape), mesh_dim_names=mesh.mesh_dim_names)

    report = []
    for layout in LAYOUTS:
        state = init_parallel_state(ParallelConfig(timeout_minutes=TIMEOUT_MIN, **layout))
        ref_world, ref_shard = reference(state.world_mesh), reference(state.shard_mesh)
        meshes = [
            ("world", state.world_mesh, ref_world),
            ("shard", state.shard_mesh, ref_shard),
            ("cp", state.cp_mesh, ref_world["ring", "ulysses"]),
        ]
        if state.expert_mesh is not None:
            ref_expert = reference(state.expert_mesh)
            meshes += [
                ("expert", state.expert_mesh, ref_expert),
                ("ep", state.expert_mesh["ep"], ref_expert["ep"]),
            ]
        for name, mesh, ref in meshes:
            assert mesh.mesh.tolist() == ref.mesh.tolist(), (layout, name)
            for dim in range(mesh.ndim):
                group = mesh.get_group(dim)
                report.append(
                    {
                        "layout": layout,
                        "mesh": name,
                        "dim": mesh.mesh_dim_names[dim],
                        "ranks": dist.get_process_group_ranks(group),
                        "ref_ranks": dist.get_process_group_ranks(ref.get_group(dim)),
                        "timeout_s": _timeout(group).total_seconds(),
                        "backend": str(dist.get_backend(group)),
                    }
                )
        report.append(
            {"layout": layout, "dp_rank": state.dp_rank, "coordinate": state.world_mesh.get_coordinate()}
        )
    report.append({"world_timeout_s": _timeout(dist.group.WORLD).total_seconds()})
    Path(out, f"rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[list[dict]]:
    out = tmp_path_factory.mktemp("groups")
    mp.start_processes(
        _worker, args=(_free_port(), str(out)), nprocs=WORLD, start_method=START_METHOD, join=True
    )
    return [json.loads(Path(out, f"rank{r}.json").read_text(encoding="utf-8")) for r in range(WORLD)]


def test_mesh_groups_match_init_device_mesh(reports):
    for rank, report in enumerate(reports):
        groups = [r for r in report if "ranks" in r]
        assert len(groups) >= 5 * len(LAYOUTS)
        for g in groups:
            assert g["ranks"] == g["ref_ranks"], (rank, g)
            assert rank in g["ranks"], (rank, g)


def test_every_group_has_the_configured_timeout(reports):
    want = TIMEOUT_MIN * 60.0
    for report in reports:
        assert report[-1]["world_timeout_s"] == want
        timeouts = {
            (g["mesh"], g["dim"], json.dumps(g["layout"])): g["timeout_s"] for g in report if "ranks" in g
        }
        assert set(timeouts.values()) == {want}, timeouts
        # groups smaller than the world were made by mm: torch's own default would be 30 minutes
        assert any(len(g["ranks"]) < WORLD for g in report if "ranks" in g)


def test_cpu_groups_are_plain_gloo_and_ranks_have_distinct_coordinates(reports):
    for report in reports:
        assert {g["backend"] for g in report if "ranks" in g} == {"gloo"}
    for layout in LAYOUTS:
        coords = [
            next(r for r in report if r.get("layout") == layout and "coordinate" in r) for report in reports
        ]
        assert len({json.dumps(c["coordinate"]) for c in coords}) == WORLD, (layout, coords)


def test_backend_strings():
    assert process_group_backend("cpu") == "gloo"
    assert process_group_backend("cuda") == "cuda:nccl,cpu:gloo"
    assert process_group_backend("npu") == "npu:hccl,cpu:gloo"
    with pytest.raises(ValueError, match="unsupported device type 'xpu'"):
        process_group_backend("xpu")


def test_group_backend_reads_the_device_part_of_a_mixed_backend():
    dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert str(dist.get_backend()) == "cpu:gloo"
        assert group_backend(None, "cpu") == "gloo"
        assert group_backend(None, "cuda") == ""
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert group_backend(None, "cpu") == "gloo"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("value", ["0", "-3", "ten"])
def test_timeout_minutes_is_validated(value):
    from _mm import QUICKSTART

    from mm_core.config.loader import load_config

    with pytest.raises(ConfigError, match=r"parallel\.timeout_minutes"):
        load_config(str(QUICKSTART), [f"parallel.timeout_minutes={value}"])


def test_timeout_minutes_default():
    from mm_core.config.schema import ParallelConfig

    assert ParallelConfig().timeout_minutes == 30
    assert ParallelConfig(timeout_minutes=120).timeout_minutes == 120
