"""The token embedding and the final norm + output head are FSDP units of their own (the model plan's
``input_embedding`` / ``output_norm`` / ``output_head``): the embedding is resharded after its forward, the
head unit stays gathered into the backward, a tied embedding and head are one unit, and a model trained with
them on 2 ranks matches one process.

Runs in-process on a 1-rank gloo group (the plan and the sharded model), and one launch of 2 ranks."""

from __future__ import annotations

import pytest
from _mm import QUICKSTART, assert_close_series, train_layouts
from test_build_plan import SMALL
from torch.distributed.tensor import DTensor

from mm_core.config import load_config
from mm_core.parallel.state import init_parallel_state
from mm_core.tasks.base import TaskContext
from mm_core.tasks.standard import StandardTask

UNTIED = "model.config_overrides.tie_word_embeddings=false"
TIED = "model.config_overrides.tie_word_embeddings=true"


def _build(*overrides: str) -> StandardTask:
    cfg = load_config(QUICKSTART, [*SMALL, "model.config_overrides.vocab_size=256", *overrides])
    task = StandardTask(TaskContext(cfg, init_parallel_state(cfg.parallel, "cpu"), None))
    task.build()
    return task


def _sharded(module) -> bool:
    return all(isinstance(p, DTensor) for p in module.parameters())


def _forward(task: StandardTask) -> None:
    import torch

    ids = torch.randint(0, 100, (2, 16))
    task.model(input_ids=ids).logits.sum()


def test_untied_embedding_and_head_are_units_of_their_own(group) -> None:
    task = _build(UNTIED)
    plan, model = task.plan, task.model
    assert plan.edges.groups == (("model.embed_tokens",), ("model.norm", "lm_head"))
    assert plan.edges.kept == ("model.norm", "lm_head")
    assert plan.unit_groups[:2] == [("model.embed_tokens",), ("model.norm", "lm_head")]
    state = {n: m._get_fsdp_state() for n, m in model.named_modules() if hasattr(m, "_get_fsdp_state")}
    assert state["model.norm"] is state["lm_head"]  # one unit: one all-gather, one reduce-scatter
    assert len({id(state[n]) for n in ("", "model.embed_tokens", "lm_head", "model.layers.0")}) == 4
    root_params = {id(p) for p in model.parameters()} - {
        id(p)
        for n in ("model.embed_tokens", "model.norm", "lm_head", "model.layers")
        for p in model.get_submodule(n).parameters()
    }
    assert not root_params  # nothing left on the root
    _forward(task)
    # after the forward: the embedding is resharded, the head unit kept gathered for its backward
    assert _sharded(model.model.embed_tokens) and _sharded(model.model.layers[0])
    assert not _sharded(model.lm_head) and not _sharded(model.model.norm)


def test_tied_embedding_and_head_are_one_unit(group) -> None:
    task = _build(TIED)  # as the quickstart's Qwen3 does
    plan, model = task.plan, task.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert plan.edges.groups == (("model.embed_tokens", "model.norm", "lm_head"),)
    assert model.model.embed_tokens._get_fsdp_state() is model.lm_head._get_fsdp_state()
    _forward(task)
    assert not _sharded(model.lm_head) and model.lm_head.weight is model.model.embed_tokens.weight


def test_a_module_already_a_unit_is_not_grouped_again(group) -> None:
    task = _build(UNTIED, "parallel.fsdp_plan.apply_modules=[model.layers.{*}, lm_head]")
    plan = task.plan
    assert plan.edges.groups == (("model.embed_tokens",),)
    assert dict(plan.edges.notes)["model.norm + lm_head"].startswith("not a unit of its own")


def test_two_ranks_with_edge_units_match_one_process(tmp_path_factory) -> None:
    common = [
        "training.train_iters=4",
        "training.save=null",
        "training.seed=3",
        "data.dataset_param.basic_parameters.seq_len=64",
        "training.progress_bar=false",
        "tools.tensorboard.enable=false",
        "model.config_overrides={num_hidden_layers: 2, tie_word_embeddings: false}",
        "parallel.fsdp_plan.num_to_forward_prefetch=1",
        "parallel.fsdp_plan.num_to_backward_prefetch=1",
    ]
    runs = train_layouts(
        tmp_path_factory,
        QUICKSTART,
        [
            ("single", 1, ["training.micro_batch_size=4", "training.gradient_accumulation_steps=1"]),
            ("fsdp2", 2, ["training.micro_batch_size=2", "training.gradient_accumulation_steps=1"]),
        ],
        common,
    )
    ref, got = runs["single"], runs["fsdp2"]
    assert_close_series([r["loss"] for r in ref], [r["loss"] for r in got], 1e-5, "loss")
    assert_close_series([r["grad_norm"] for r in ref], [r["grad_norm"] for r in got], 1e-5, "grad_norm")


if __name__ == "__main__":
    pytest.main([__file__])
