"""Qwen3.5's long context: Ulysses context parallelism over both its full-attention and its Gated DeltaNet
(linear attention) layers trains what one process would.

The Qwen3.5-MoE language model (``qwen3_5_moe_text``: a Gated DeltaNet layer with 2 key heads serving 4 value
heads, then a full-attention layer with 4 query and 2 key/value heads, routed experts), fp32, 4 steps on the
quickstart's packed real text (61 tokens per row, which Ulysses 2 pads): Ulysses 2 alone and Ulysses 2 with
expert parallel 2 on the same 2 ranks give the loss, router loss and gradient norm of one process within 1e-5
relative at every step. In the same launch one Gated DeltaNet layer with random weights (decays and
convolution filters differing per head), a padded row and 70 tokens (not a multiple of the rule's 64-token
chunks) gives under Ulysses 2 the outputs, input gradients and weight gradients of transformers' forward over
the whole sequence. Ring attention is refused with the reason, and a Ulysses size that does not divide the
Gated DeltaNet heads names the key. The dense vision-language ``qwen3_5``, whose sequence is split at its
language model's input, matches one process the same way on rows of different lengths."""

from __future__ import annotations

import pytest
import torch
from _launch import Call, run_in_one_launch
from _mm import REPO, assert_close_series, mm_here, read_metrics
from test_ep_parity import moe_config
from test_ep_qwen3_5_moe import MODEL
from test_grouping import FAMILIES

STEPS = 4
SEQ = 61
COMMON = [
    f"training.train_iters={STEPS}",
    "training.log_interval=1",
    "training.save=null",
    "training.seed=11",
    "training.lr=3e-3",
    "training.lr_warmup_ratio=0.2",
    f"data.dataset_param.basic_parameters.seq_len={SEQ}",
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=2",
]
LAYOUTS = [
    ("single", 1, []),
    ("ulysses2", 2, ["parallel.ulysses_parallel_size=2"]),
    ("ulysses2_ep2", 2, ["parallel.ulysses_parallel_size=2", "parallel.expert_parallel_size=2"]),
]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return moe_config(tmp_path_factory.mktemp("cfg"), MODEL)


def check_layer() -> None:
    """On every rank of a 2-process launch: one Gated DeltaNet layer under Ulysses 2 equals transformers'
    forward and backward over the whole sequence (raises otherwise, which fails the launch)."""
    import copy

    import torch.distributed as dist
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    from mm_core.parallel.context import LAYOUT_KWARG
    from mm_models_qwen._deltanet_ulysses import use_ulysses_deltanet
    from mm_parallel.context import PAD_SEGMENT, SequenceLayout

    rank, size = dist.get_rank(), dist.get_world_size()
    config = Qwen3_5MoeTextConfig(
        hidden_size=32,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    torch.manual_seed(3)
    layer = Qwen3_5MoeGatedDeltaNet(config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
        layer.A_log.copy_(torch.linspace(-1.0, 1.0, 4))  # decays differ per value head
    batch, seq = 2, 70
    x = torch.randn(batch, seq, 32)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, -9:] = 0  # the second row is padded
    upstream = torch.randn(batch, seq, 32)

    ref_x = x.clone().requires_grad_()
    ref = layer(ref_x, attention_mask=mask)
    (ref * upstream).sum().backward()

    ulysses = copy.deepcopy(layer)
    ulysses.zero_grad()
    use_ulysses_deltanet(ulysses, size)
    assert type(ulysses).__name__ == "UlyssesQwen3_5MoeGatedDeltaNet"
    segments = torch.where(mask.bool(), 0, PAD_SEGMENT)
    layout = SequenceLayout(segments, 1, 0, size, rank, None, dist.group.WORLD)
    mine = slice(rank * seq // size, (rank + 1) * seq // size)
    local_x = x[:, mine].clone().requires_grad_()
    out = ulysses(local_x, attention_mask=mask[:, mine], **{LAYOUT_KWARG: layout})
    (out * upstream[:, mine]).sum().backward()

    real = mask[:, mine].bool()
    torch.testing.assert_close(out[real], ref[:, mine][real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(local_x.grad, ref_x.grad[:, mine], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(ulysses.named_parameters(), layer.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # each rank holds the gradient of its tokens' part of the loss
        torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


#: the dense Qwen3.5 vision-language model (``qwen3_5``) on padded text rows: the sequence is split at the
#: language model's input (``ModelPlan.cp_split_module``), 3 Gated DeltaNet layers then a full-attention one
VL_LAYOUTS = [("vl_single", 1, []), ("vl_ulysses2", 2, ["parallel.ulysses_parallel_size=2"])]
VL_COMMON = [c for c in COMMON if "seq_len" not in c] + ["data.dataloader_param.shuffle=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, config):
    vl_config = FAMILIES["qwen3_5"](tmp_path_factory.mktemp("vl_cfg"))
    dirs = {name: tmp_path_factory.mktemp(name) for name, _, _ in LAYOUTS + VL_LAYOUTS}
    items = {1: [], 2: []}
    for cfg, common, layouts in ((config, COMMON, LAYOUTS), (vl_config, VL_COMMON, VL_LAYOUTS)):
        for name, nproc, extra in layouts:
            items[nproc].append((name, str(cfg), [*common, *extra, f"training.output_dir={dirs[name]}"]))
    items[2].append(Call("layer", "test_cp_qwen3_5:check_layer"))
    for nproc, launch in items.items():
        run_in_one_launch(nproc, launch, REPO, 600 * len(launch))
    return {name: read_metrics(dirs[name]) for name in dirs}


def test_one_deltanet_layer_under_ulysses_equals_the_whole_sequence(runs):
    """check_layer ran on both ranks of the 2-process launch without raising (else ``runs`` failed)."""
    assert {"single", "ulysses2", "ulysses2_ep2"} <= set(runs)


@pytest.mark.parametrize("layout", ["ulysses2", "ulysses2_ep2"])
def test_ulysses_over_gated_deltanet_matches_single_process(runs, layout):
    ref, got = runs["single"], runs[layout]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for key in ("loss", "aux_loss", "grad_norm"):
        assert_close_series([r[key] for r in ref], [r[key] for r in got], 1e-5, f"{layout} {key}")
    assert [r["tokens"] for r in got] == [4 * SEQ] * STEPS


def test_ulysses_in_the_vision_language_model_matches_single_process(runs):
    ref, got = runs["vl_single"], runs["vl_ulysses2"]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        assert_close_series([r[key] for r in ref], [r[key] for r in got], 1e-5, f"qwen3_5 ulysses2 {key}")
    assert [r["tokens"] for r in ref] == [r["tokens"] for r in got]


def test_ring_attention_is_refused_with_the_reason(config):
    done = mm_here("check", config, "--world-size", "2", "parallel.ring_attention_size=2")
    assert done.returncode != 0
    assert "parallel.ring_attention_size" in done.stderr
    assert "recurrent state" in done.stderr and "Ulysses only" in done.stderr


def test_ulysses_size_must_divide_the_deltanet_heads(config):
    # 4 attention heads and 4 value heads, but 2 key heads: Ulysses 4 cannot give each rank a whole key head
    done = mm_here("check", config, "--world-size", "4", "parallel.ulysses_parallel_size=4")
    assert done.returncode != 0
    assert "parallel.ulysses_parallel_size: got 4" in done.stderr
    assert "linear_num_key_heads 2" in done.stderr
