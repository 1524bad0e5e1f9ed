"""The process group and device meshes that ``init_parallel_state`` builds (issue #12 / #11).

On 4 gloo ranks, for each layout (FSDP, HSDP, Ulysses, ring x Ulysses, expert parallel): every mesh dimension
has the ranks ``init_device_mesh`` would give it, and every group (the world included) has the collective
timeout of ``parallel.timeout_minutes``, not torch's default. Plus the backend strings for accelerators.

At 1,024 and 4,096 ranks (torch's fake process-group backend: one process takes the place of a rank, no
other process exists): every mesh dimension gives the rank the group of its row, and the number of groups a
rank creates depends on the layout's dimensions, not on the world size."""

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


SCALE_LAYOUTS = {
    "fsdp": {},
    "hsdp": {"fully_shard_parallel_size": 64},
    "ep": {"expert_parallel_size": 8},
    "cp": {"ring_attention_size": 2, "ulysses_parallel_size": 4},
}


def _row(mesh, dim: int) -> list[int]:
    """The ranks of this rank's row along ``dim`` of ``mesh``."""
    index = list(mesh.get_coordinate())
    index[dim] = slice(None)
    return mesh.mesh[tuple(index)].tolist()


def _simulated_worker(_: int, out: str) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from mm_core.config.schema import ParallelConfig
    from mm_core.parallel.state import init_parallel_state

    report = []
    for world in (1024, 4096):
        for name, layout in SCALE_LAYOUTS.items():
            for rank in (0, 777, world - 1):
                dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
                state = init_parallel_state(ParallelConfig(**layout), "cpu")
                meshes = [state.world_mesh, state.shard_mesh] + [m for m in [state.expert_mesh] if m]
                rows_ok = all(
                    dist.get_process_group_ranks(m.get_group(d)) == _row(m, d)
                    for m in meshes
                    for d in range(m.ndim)
                )
                groups = state.process_groups
                report.append({"world": world, "layout": name, "rank": rank, "groups": groups, "ok": rows_ok})
                dist.destroy_process_group()
    Path(out, "simulated.json").write_text(json.dumps(report), encoding="utf-8")


def test_groups_grow_with_mesh_dimensions_not_world_size(tmp_path):
    args = (str(tmp_path),)
    mp.start_processes(_simulated_worker, args=args, nprocs=1, start_method=START_METHOD, join=True)
    report = json.loads((tmp_path / "simulated.json").read_text(encoding="utf-8"))
    assert len(report) == 2 * len(SCALE_LAYOUTS) * 3
    assert all(r["ok"] for r in report), [r for r in report if not r["ok"]]
    groups = {(r["layout"], r["world"], r["rank"]): r["groups"] for r in report}
    # FSDP: the size-1 dimensions share one local group; HSDP: replicate + shard + the size-1 ones;
    # EP adds efsdp and ep; CP: ring, ulysses and the shard group they form with dp_shard
    want = {"fsdp": 1, "hsdp": 3, "ep": 3, "cp": 4}
    for (layout, world, rank), count in groups.items():
        assert count == want[layout], (layout, world, rank, count)
