"""How the trainer feeds context parallelism: the batch split (global position ids, shifted targets,
padding that does not change the loss), the attention registration, and the errors for what CP cannot run."""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _launch import START_METHOD
from transformers import (
    AttentionInterface,
    Qwen3_5MoeTextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3VLConfig,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mm_core.config.schema import MMConfig, ParallelConfig
from mm_core.errors import ConfigError
from mm_core.models.facts import ModelFacts
from mm_core.models.plan import plan_of
from mm_core.parallel.context import (
    ATTENTION_NAME,
    LAYOUT_KWARG,
    ContextParallel,
    context_parallel_attention_forward,
    plan_context_parallel,
    shard_module_inputs,
    use_context_parallel_attention,
)
from mm_core.parallel.state import ParallelSizes, init_parallel_state, resolve_sizes
from mm_core.train.loss import IGNORE_INDEX, count_units, shift_labels
from mm_parallel.context import SequenceLayout


def _switch(model: Any, cfg: MMConfig, sizes: ParallelSizes) -> None:
    """The build plan's context-parallel checks, then the attention switch, as a worker makes them."""
    facts = ModelFacts.of(model)
    use_context_parallel_attention(
        model, plan_context_parallel(model, facts, plan_of(model), cfg.model, sizes), facts
    )


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
            start_method=START_METHOD,
        )


@pytest.mark.parametrize(("ring", "ulysses"), [(1, 2), (2, 1), (2, 2)])
def test_split_module_inputs_reassemble(ring, ulysses):
    """The inputs of a vision-language model's split point (embeddings, 3-D positions, masks, deepstack
    rows packed by the image-token mask) cut per rank and put back together give the whole inputs; each
    deepstack row goes to the rank holding its image token, in that rank's token order."""
    g = torch.Generator().manual_seed(0)
    b, n, h = 2, 16, 3
    segments = torch.zeros(b, n, dtype=torch.long)
    segments[1, 12:] = -1
    visual = torch.rand(b, n, generator=g) < 0.4
    full = {
        "inputs_embeds": torch.randn(b, n, h, generator=g),
        "position_ids": torch.randint(0, 50, (3, b, n), generator=g),
        "attention_mask": (segments >= 0).long(),
        "visual_pos_masks": visual,
        "deepstack_visual_embeds": [torch.randn(int(visual.sum()), h, generator=g) for _ in range(2)],
        "cache_position": torch.arange(n),
        "use_cache": False,
    }
    number = torch.full((b, n), -1, dtype=torch.long)  # row of each image token in the packed features
    number[visual] = torch.arange(int(visual.sum()))
    back = {k: torch.zeros_like(v) for k, v in full.items() if isinstance(v, torch.Tensor)}
    for r in range(ring):
        for u in range(ulysses):
            layout = SequenceLayout(segments, ring, r, ulysses, u)
            index = layout.local_index()
            local = shard_module_inputs(full, layout, {"deepstack_visual_embeds": "visual_pos_masks"})
            assert local["use_cache"] is False and local["inputs_embeds"].shape[1] == n // (ring * ulysses)
            for k in ("inputs_embeds", "attention_mask", "visual_pos_masks"):
                back[k].index_copy_(1, index, local[k])
            back["position_ids"][:, :, index] = local["position_ids"]
            back["cache_position"][index] = local["cache_position"]
            want = layout.shard(number)[local["visual_pos_masks"]]
            for mine, whole in zip(local["deepstack_visual_embeds"], full["deepstack_visual_embeds"]):
                assert torch.equal(mine, whole[want])
    for k, v in back.items():
        assert torch.equal(v, full[k]), k


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
    _switch(model, _cfg(), _sizes(ring_attention_size=2))
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
            _switch(stand_in(Qwen3Config()), _cfg(loss_type), _sizes(ring_attention_size=2))
    with pytest.raises(ConfigError, match=r"parallel.ulysses_parallel_size: .*linear_attention"):
        _switch(stand_in(Qwen3_5MoeTextConfig()), _cfg(), _sizes(ulysses_parallel_size=2))
    odd = Qwen3Config(num_attention_heads=3, num_key_value_heads=1)
    with pytest.raises(ConfigError, match="ulysses_parallel_size: got 2; it must divide .* 3"):
        _switch(stand_in(odd), _cfg(), _sizes(ulysses_parallel_size=2))
    with pytest.raises(ConfigError, match="did not accept the attention implementation"):
        _switch(stand_in(Qwen3Config()), _cfg(), _sizes(ring_attention_size=2))
    # a model with a vision tower needs its plan to name the split point (ModelPlan.cp_split_module)
    with pytest.raises(ConfigError, match=r"sub-models \['vision_config'\].*ModelPlan.cp_split_module"):
        _switch(stand_in(Qwen3VLConfig()), _cfg(), _sizes(ulysses_parallel_size=2))


def test_vision_language_model_switches_only_its_language_model():
    from mm_models_qwen.qwen3_vl import Qwen3VLForTraining

    config = Qwen3VLConfig(
        text_config={
            "vocab_size": 32,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 16,
            "deepstack_visual_indexes": [],
        },
    )
    model = Qwen3VLForTraining(config)
    vision = model.config.vision_config._attn_implementation
    _switch(model, _cfg(), _sizes(ulysses_parallel_size=2))
    assert model.config.text_config._attn_implementation == ATTENTION_NAME
    assert model.config.vision_config._attn_implementation == vision != ATTENTION_NAME
