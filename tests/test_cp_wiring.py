"""How the trainer feeds context parallelism: the batch split (global position ids, shifted targets,
padding that does not change the loss), the attention registration, and the errors for what CP cannot run."""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AttentionInterface, Qwen3_5MoeTextConfig, Qwen3Config, Qwen3ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mm_core.config.schema import ParallelConfig
from mm_core.context_parallel import (
    ATTENTION_NAME,
    LAYOUT_KWARG,
    ContextParallel,
    context_parallel_attention_forward,
    use_context_parallel_attention,
)
from mm_core.errors import ConfigError
from mm_core.parallel_state import init_parallel_state, resolve_sizes
from mm_core.train.loss import IGNORE_INDEX, count_units, shift_labels


def _split_worker(rank: int, world: int, init_file: str, ring: int, ulysses: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        state = init_parallel_state(
            ParallelConfig(ulysses_parallel_size=ulysses, ring_attention_size=ring), "cpu"
        )
        cp = ContextParallel(state)
        g = torch.Generator().manual_seed(0)
        b, s = 2, 13  # 13 is divisible by no layout: padded to 16 (ring 2 x ulysses 2) or 4 / 2
        ids = torch.randint(1, 100, (b, s), generator=g)
        positions = torch.tensor([list(range(5)) + list(range(8)), list(range(13))])
        labels = ids.clone()
        labels[0, 5] = IGNORE_INDEX
        batch = {"input_ids": ids, "position_ids": positions, "labels": labels}
        targets = shift_labels(batch.pop("labels"))
        local, local_targets = cp.shard(dict(batch), targets)
        layout = local[LAYOUT_KWARG]
        n = layout.seq_len
        assert n % cp.multiple == 0 and n - s < cp.multiple
        # documents of the packed row become segments; padding is segment -1
        assert (
            layout.segments[0, :s].tolist() == [0] * 5 + [1] * 8
            and layout.segments[1, :s].tolist() == [0] * 13
        )
        assert (layout.segments[:, s:] == -1).all()

        def gathered(t: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            index = [torch.empty_like(layout.local_index()) for _ in range(world)]
            dist.all_gather(index, layout.local_index())
            full = torch.empty(b, n, dtype=t.dtype)
            for idx, part in zip(index, parts):
                full[:, idx] = part
            return full

        assert torch.equal(gathered(local["input_ids"])[:, :s], ids)
        assert torch.equal(gathered(local["position_ids"])[:, :s], positions)  # global, not per shard
        full_targets = gathered(local_targets)
        assert torch.equal(full_targets[:, :s], targets) and (full_targets[:, s:] == IGNORE_INDEX).all()
        mask = gathered(local["attention_mask"])
        assert mask[:, :s].all() and not mask[:, s:].any()
        units = torch.tensor(float(count_units(local_targets, "per_token_loss")))
        dist.all_reduce(units)
        assert units.item() == count_units(targets, "per_token_loss")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("ring", "ulysses"), [(2, 2)])
def test_shard_reassembles_to_the_padded_batch(ring, ulysses):
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _split_worker,
            args=(ring * ulysses, os.path.join(tmp, "rdzv"), ring, ulysses),
            nprocs=ring * ulysses,
            start_method="spawn",
        )


def _sizes(**parallel):
    return resolve_sizes(ParallelConfig(**parallel), 2)


def _cfg(loss_type: str = "per_token_loss"):
    return SimpleNamespace(
        model=SimpleNamespace(model_id="qwen3", loss_cfg=SimpleNamespace(loss_type=loss_type))
    )


def test_attention_is_registered_under_its_own_name():
    config = Qwen3Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    model = Qwen3ForCausalLM(config)
    use_context_parallel_attention(model, _cfg(), _sizes(ring_attention_size=2))
    assert model.config._attn_implementation == ATTENTION_NAME
    assert AttentionInterface._global_mapping[ATTENTION_NAME] is context_parallel_attention_forward
    assert AttentionInterface._global_mapping["sdpa"] is sdpa_attention_forward  # built-ins untouched
    # every attention layer now goes through mm's function, which needs the layout the trainer passes
    with pytest.raises(RuntimeError, match=LAYOUT_KWARG):
        model(input_ids=torch.tensor([[1, 2, 3, 4]]))


def test_refuses_raw_loss_and_unsupported_models():
    def stand_in(config):
        return SimpleNamespace(config=config, set_attn_implementation=lambda name: None)

    for loss_type in ("raw", "per_sample_loss"):
        with pytest.raises(ConfigError, match=f"model.loss_cfg.loss_type: got '{loss_type}'"):
            use_context_parallel_attention(
                stand_in(Qwen3Config()), _cfg(loss_type), _sizes(ring_attention_size=2)
            )
    with pytest.raises(ConfigError, match=r"parallel.ulysses_parallel_size: .*linear_attention"):
        use_context_parallel_attention(
            stand_in(Qwen3_5MoeTextConfig()), _cfg(), _sizes(ulysses_parallel_size=2)
        )
    odd = Qwen3Config(num_attention_heads=3, num_key_value_heads=1)
    with pytest.raises(ConfigError, match="ulysses_parallel_size: got 2; it must divide .* 3"):
        use_context_parallel_attention(stand_in(odd), _cfg(), _sizes(ulysses_parallel_size=2))
    with pytest.raises(ConfigError, match="did not accept the attention implementation"):
        use_context_parallel_attention(stand_in(Qwen3Config()), _cfg(), _sizes(ring_attention_size=2))
