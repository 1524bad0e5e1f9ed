"""Mixture-of-experts balance (docs/parallelism.md, "Expert load and router bias").

- Every MoE run logs ``moe/load_max_over_mean`` and ``moe/dead_experts`` (whole model and per group of
  layers) from the global tokens per expert: a tiny Qwen3-MoE gives the same values on 1 process, FSDP 2 and
  EP 2 (with and without recompute) and Ulysses 2 (the same global batch of 8 sequences, padding left out).
- ``model.loss_cfg.router_bias_update_rate`` moves the ``e_score_correction_bias`` of a tiny DeepSeek-V3
  (Kimi K2.5's language model; ``tests/_plugin_moe.py``, text only) after each optimizer step: 1 process and
  EP 2 give the same losses, grad norms and load metrics within 1e-5 and the same final bias over 4 steps;
  the bias has moved (each entry a multiple of the rate, not all zero); a run resumed from step 2 ends with
  the very same bias and losses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from _launch import run_in_one_launch
from _mm import REPO, assert_close_series, checkpoint_tensors, read_metrics
from _plugin_moe import TINY_DEEPSEEK_V3
from _tiny import QWEN3_MOE
from test_ep_parity import moe_config

RATE = 1e-3
STEPS = 4
COMMON = [
    f"training.train_iters={STEPS}",
    "training.log_interval=1",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
    "training.gradient_accumulation_steps=2",
    "data.dataset_param.basic_parameters.seq_len=32",
    "training.seed=5",
]
QWEN = [*COMMON, "training.save=null"]
KIMI = [*COMMON, f"model.loss_cfg.router_bias_update_rate={RATE}", "training.save_interval=2"]
DEEPSEEK_V3 = {
    "model_id": "test_deepseek_v3",
    "from_scratch": True,
    "config_overrides": dict(TINY_DEEPSEEK_V3),
    "loss_cfg": {"loss_type": "per_token_loss"},
}
BALANCE = ("moe/load_max_over_mean", "moe/dead_experts")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    root = tmp_path_factory.mktemp("balance")
    qwen = str(moe_config(root))
    (root / "kimi").mkdir()
    path = moe_config(root / "kimi", DEEPSEEK_V3)
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    raw["training"]["plugin"] = ["_plugin_moe"]
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    kimi = str(path)
    out = {
        name: root / name
        for name in (
            "single",
            "fsdp2",
            "ep2",
            "ep2_recompute",
            "ulysses2",
            "kimi",
            "kimi_ep2",
            "kimi_resumed",
        )
    }

    def run(name: str, config: str, overrides: list[str]) -> tuple[str, str, list[str]]:
        return name, config, [*overrides, f"training.output_dir={out[name]}"]

    one = [
        run("single", qwen, [*QWEN, "training.micro_batch_size=4"]),
        run("kimi", kimi, [*KIMI, "training.micro_batch_size=4", f"training.save={root / 'ck_kimi'}"]),
        run(
            "kimi_resumed",
            kimi,
            [
                *KIMI,
                "training.micro_batch_size=4",
                f"training.load={root / 'ck_kimi' / 'step_2'}",
                f"training.save={root / 'ck_resumed'}",
            ],
        ),
    ]
    two = [
        run("fsdp2", qwen, [*QWEN, "training.micro_batch_size=2"]),
        run("ep2", qwen, [*QWEN, "training.micro_batch_size=2", "parallel.expert_parallel_size=2"]),
        run(
            "ep2_recompute",
            qwen,
            [*QWEN, "training.micro_batch_size=2", "parallel.expert_parallel_size=2", "model.recompute=true"],
        ),
        run("ulysses2", qwen, [*QWEN, "training.micro_batch_size=4", "parallel.ulysses_parallel_size=2"]),
        run(
            "kimi_ep2",
            kimi,
            [
                *KIMI,
                "training.micro_batch_size=2",
                "parallel.expert_parallel_size=2",
                f"training.save={root / 'ck_ep2'}",
            ],
        ),
    ]
    run_in_one_launch(1, one, REPO, 600)
    run_in_one_launch(2, two, REPO, 600)
    return root, {name: read_metrics(path) for name, path in out.items()}


def biases(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The routers' correction biases saved in a DCP checkpoint folder."""
    state = checkpoint_tensors(checkpoint, "e_score_correction_bias")
    return {k[len("model.") :]: v for k, v in state.items()}


def balance_keys(record: dict) -> list[str]:
    return sorted(k for k in record if k.startswith("moe/"))


def test_load_statistics_do_not_depend_on_the_layout(runs):
    _, got = runs
    ref = got["single"]
    keys = balance_keys(ref[0])
    # the whole model and each of the 2 MoE layers (groups of consecutive layers: at most 4)
    assert keys == sorted(f"{m}{suffix}" for m in BALANCE for suffix in ("", "/layers_0-0", "/layers_1-1")), (
        keys
    )
    # top-2 of 8 experts: the busiest expert gets more than the mean; the whole model is the layers' mean
    assert all(r["moe/load_max_over_mean"] > 1.0 for r in ref)
    for r in ref:
        per_layer = [r["moe/load_max_over_mean/layers_0-0"], r["moe/load_max_over_mean/layers_1-1"]]
        assert r["moe/load_max_over_mean"] == pytest.approx(sum(per_layer) / 2, rel=1e-12)
    for name in ("fsdp2", "ep2", "ep2_recompute", "ulysses2"):  # a recomputed forward counts nothing again
        assert [balance_keys(r) for r in got[name]] == [keys] * STEPS
        for key in keys:
            assert_close_series([r[key] for r in ref], [r[key] for r in got[name]], 1e-9, f"{name} {key}")


def test_router_bias_update_matches_between_layouts_and_resumes_exactly(runs):
    root, got = runs
    ref, ep2, resumed = got["kimi"], got["kimi_ep2"], got["kimi_resumed"]
    assert [r["step"] for r in ep2] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", *BALANCE):
        assert_close_series([r[key] for r in ref], [r[key] for r in ep2], 1e-5, f"kimi ep2 {key}")
    final = biases(root / "ck_kimi" / f"step_{STEPS}")
    assert len(final) == 3  # a dense first layer, then 3 MoE layers
    # every step moves each entry by +-rate (or 0 at the mean): multiples of the rate, and they moved
    for name, bias in final.items():
        steps = bias.double() / RATE
        assert torch.allclose(steps, steps.round(), atol=1e-4), (name, bias)
        assert steps.round().abs().max() <= STEPS
        assert bias.abs().sum() > 0, f"{name} was not updated"
    for name, bias in biases(root / "ck_ep2" / f"step_{STEPS}").items():
        torch.testing.assert_close(bias, final[name], rtol=0, atol=1e-5)
    # resumed from step 2: the bias came back with the weights, the steps after it are the same steps
    assert [r["step"] for r in resumed] == list(range(3, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in ref[2:]]
    again = biases(root / "ck_resumed" / f"step_{STEPS}")
    assert again.keys() == final.keys()
    for name, bias in again.items():
        assert torch.equal(bias, final[name]), name


def test_bias_update_direction_and_refusal_for_a_softmax_routed_model():
    """An overloaded expert's bias decreases, an underloaded one's increases (Megatron / DeepSeek-V3), and
    a softmax-routed model (Qwen3-MoE: no correction bias) refuses the key, naming it."""
    from _plugin_moe import DeepseekV3ForTraining
    from transformers import DeepseekV3Config, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from mm_core.errors import ConfigError
    from mm_core.parallel.expert_load import expert_load_for

    model = DeepseekV3ForTraining(DeepseekV3Config(**TINY_DEEPSEEK_V3))
    names = [f"model.layers.{i}.mlp.experts" for i in (1, 2, 3)]
    load = expert_load_for(model, names, RATE, torch.device("cpu"))
    assert load is not None and len(load.biases()) == 3
    loads = torch.tensor([[10.0, 0.0, 2.0, 4.0]] * 3, dtype=torch.float64)  # mean 4
    load.update_bias(loads, RATE)
    for bias in load.biases():
        torch.testing.assert_close(bias, torch.tensor([-RATE, RATE, RATE, 0.0]))
    metrics = load.metrics(loads)
    assert metrics["moe/load_max_over_mean"].item() == pytest.approx(2.5)
    assert metrics["moe/dead_experts"].item() == pytest.approx(0.25)

    qwen = Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_MOE))
    experts = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert expert_load_for(qwen, experts, 0.0, torch.device("cpu")) is not None
    with pytest.raises(ConfigError, match=r"model\.loss_cfg\.router_bias_update_rate: got 0\.001; "):
        expert_load_for(qwen, experts, RATE, torch.device("cpu"))


def test_counts_real_tokens_once_per_micro_batch_with_recompute():
    """Padding rows are left out; the forward recomputed in backward and an evaluation forward add nothing."""
    from _plugin_moe import DeepseekV3ForTraining
    from transformers import DeepseekV3Config

    from mm_core.parallel.expert_load import ExpertLoad
    from mm_parallel.memory import apply_recompute

    torch.manual_seed(0)
    model = DeepseekV3ForTraining(DeepseekV3Config(**TINY_DEEPSEEK_V3))
    assert apply_recompute(model.model.layers) == 4
    names = [f"model.layers.{i}.mlp.experts" for i in (1, 2, 3)]
    load = ExpertLoad(model, names, torch.device("cpu"))
    ids = torch.randint(0, 4096, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0  # 3 padding tokens
    load.start_step()
    load.start_micro_batch(mask)
    model(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum().backward()
    real = int(mask.sum())
    assert load.counts.sum(dim=1).tolist() == [real * 2.0] * 3  # top-2 of each real token, once per layer
    with torch.no_grad():
        load.start_micro_batch(None)
        model(input_ids=ids, use_cache=False)
    assert load.counts.sum().item() == real * 2 * 3
