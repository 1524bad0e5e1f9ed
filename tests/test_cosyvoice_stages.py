"""CosyVoice3's language-model and flow stages train the same model on 2 FSDP ranks (built on the meta device,
weights loaded into the shards) as in 1 process: gloo, fp32, 3 steps of 2 micro-batches over a tiny speech
store of utterances of different lengths. Losses and gradient norms agree within 1e-5 relative and the token
counts are equal.

- ``lm``: mm's token loss (``per_token_loss``) over the assembled text-speech rows, half of the eligible
  samples bi-stream (the coin drawn from each sample's seed), normalised by the speech tokens of the step;
- ``flow``: the raw flow-matching loss, time, noise, prompt, guidance dropout and streaming mask drawn from
  each sample's seed, so a sample is trained the same whichever rank and micro-batch it lands in.
"""

from __future__ import annotations

import pytest
from _cosyvoice import make_stage_configs
from _mm import assert_close_series, train_layouts

STEPS = 3
COMMON = [f"training.train_iters={STEPS}", "training.gradient_accumulation_steps=2"]
LAYOUTS = [
    ("single", 1, ["training.micro_batch_size=2"]),
    ("fsdp2", 2, ["training.micro_batch_size=1", "training.init_model_with_meta_device=true"]),
]


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return make_stage_configs(tmp_path_factory.mktemp("cosyvoice_assets"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["lm", "flow"])
def test_cosyvoice_stage_trains_the_same_on_two_ranks(configs, stage, tmp_path_factory):
    got = train_layouts(tmp_path_factory, configs[stage], LAYOUTS, COMMON, timeout=180)
    ref, other = got["single"], got["fsdp2"]
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        assert_close_series([r[key] for r in ref], [r[key] for r in other], 1e-5, f"{stage} fsdp2 {key}")
    assert [r["tokens"] for r in ref] == [r["tokens"] for r in other]
    assert len({r["loss"] for r in ref}) == STEPS  # every step sees other samples (and draws)
