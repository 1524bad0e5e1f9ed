"""LTX-2 under Ulysses 2 (two gloo processes, no FSDP) gives the loss of one process and, for every
parameter, gradients whose mean over the two ranks (what FSDP's reduction computes) is one process's: with
the interleaved and the split rotary embedding, gated attention, LTX-2.3's prompt modulation and perturbed
attention blocks, and for a text-to-video batch (no audio latents)."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("diffusers")

sys.path.insert(0, os.path.dirname(__file__))
from _launch import START_METHOD
from test_ltx2_model import TINY, _batch  # noqa: E402

VARIANTS: list[dict[str, Any]] = [
    {"gated_attn": True, "audio_gated_attn": True},
    {"rope_type": "split", "cross_attn_mod": True, "audio_cross_attn_mod": True, "perturbed_attn": True},
]


def _worker(rank: int, init_file: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from mm_core.config.schema import ModelConfig
        from mm_core.models import ModelHub

        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("ring", "ulysses"))
        for variant in VARIANTS:
            for audio in (True, False):
                args = ModelConfig(model_id="ltx2", from_scratch=True, config_overrides={**TINY, **variant})
                torch.manual_seed(0)
                one = ModelHub.build(args)
                torch.manual_seed(0)
                split = ModelHub.build(args)
                split.use_context_parallel(mesh)
                assert split._mm_ulysses is not None
                batch = _batch(audio=audio)
                expected = one(**batch).loss
                expected.backward()
                got = split(**batch).loss
                got.backward()
                what = f"{variant} audio={audio}"
                assert torch.allclose(got, expected, rtol=1e-6), what
                grads = {n: p.grad for n, p in one.named_parameters() if p.grad is not None}
                scale = max(float(g.abs().max()) for g in grads.values())
                for name, p in split.named_parameters():
                    mine = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                    dist.all_reduce(mine)
                    mine /= 2
                    ref = grads.get(name, torch.zeros_like(p))
                    # fp32 summation order differs: a tolerance relative to the tensor, floored at the model's
                    bound = 1e-5 * max(float(ref.abs().max()), 1e-3 * scale)
                    assert float((mine - ref).abs().max()) <= bound, f"{what}: {name}"
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ulysses_gradients_are_one_process_gradients() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(os.path.join(tmp, "rdzv"),), nprocs=2, start_method=START_METHOD)
