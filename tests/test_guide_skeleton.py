"""The MindSpeed-MM FSDP2 migration guide's own YAML skeleton (its section 5) runs as written, with only its
placeholders filled: `mm check` accepts it and `mm train` runs 5 steps on 2 ranks, once on the quickstart's
dense Qwen3 and once on a tiny Qwen3-MoE with expert parallelism 2.

The dense case runs both commands as a user types them (subprocesses). The expert-parallel case calls the
same `mm check` in this process (`mm_core.cli.main`, its output captured) and trains in one launch of 2
processes (`_launch`: the run as an `mm train` worker runs it; the log records of every rank, which `mm train`
prints, written to a file for the test to read).

The skeleton is read from the guide itself (../shared/reference, beside the repository in CI), so the test
follows the guide rather than a copy of it. What is filled in, and why:
- module paths: the guide's `model.language_model.layers` is a VLM's language model; the quickstart's decoder
  layers are `model.layers` (the `{*}` patterns are kept, `hook_modules` included);
- `<...>` placeholders: the quickstart's tokenizer, data, model config and collator; `training.plugin` lists
  mm's plugin modules by dotted name (mm imports plugins from installed packages, never from file paths);
- `basic_parameters.seq_len`: the text_pretrain dataset's own parameter (the guide leaves those to the
  dataset);
- `model.from_scratch: true`: the quickstart's model folder holds a config, no weights;
- the dense run drops `ep_plan.apply_modules` (it names MoE experts, which a dense model does not have).
Everything else (`loss_type: raw`, `adam_fused: true`, `trust_remote_code: true`, `pin_memory: true`,
`num_workers: 4`, `dataloader_mode: sampler`, `lr`, `seed`, ...) is the guide's value.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from _launch import captured, read_captured, run_in_one_launch
from _mm import QUICKSTART, REPO, mm, mm_here, read_metrics

GUIDE = REPO.parent / "shared" / "reference" / "seed-fsdp2-migration-guide.zh.txt"
STEPS = 5


def guide_skeleton() -> dict:
    """The YAML block of the guide's section 5: from its `parallel:` line to the line before the prose."""
    if not GUIDE.is_file():
        pytest.skip(f"the migration guide is not beside the repository ({GUIDE})")
    lines = GUIDE.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("5.") and "YAML" in line)
    start = next(i for i in range(start, len(lines)) if lines[i] == "parallel:")
    end = next(i for i in range(start, len(lines)) if lines[i].strip() and not lines[i][0].isascii())
    return yaml.safe_load("\n".join(lines[start:end]))


def _relocate(patterns: list[str]) -> list[str]:
    return [p.replace("model.language_model.layers", "model.layers") for p in patterns]


def filled(raw: dict, model_dir: Path, model_id: str, tmp: Path) -> dict:
    par, data, model, training = raw["parallel"], raw["data"], raw["model"], raw["training"]
    plan = par["fsdp_plan"]
    assert plan["hook_modules"] and raw["model"]["loss_cfg"]["loss_type"] == "raw"
    assert training["adam_fused"] is True and model["trust_remote_code"] is True
    plan["apply_modules"] = _relocate(plan["apply_modules"])
    plan["hook_modules"] = _relocate(plan["hook_modules"])
    model["recompute_plan"]["apply_modules"] = _relocate(model["recompute_plan"]["apply_modules"])
    par["ep_plan"]["apply_modules"] = _relocate(par["ep_plan"]["apply_modules"])
    ds = data["dataset_param"]
    ds["dataset_type"] = "text_pretrain"
    ds["preprocess_parameters"]["model_name_or_path"] = str(QUICKSTART.parent / "tokenizer")
    ds["basic_parameters"]["dataset_dir"] = str(QUICKSTART.parent / "data")
    ds["basic_parameters"]["dataset"] = "python_reference.jsonl"
    ds["basic_parameters"]["seq_len"] = 128  # text_pretrain's own parameter
    data["dataloader_param"]["collate_param"]["model_name"] = "llm_pretrain"
    model["model_id"] = model_id
    model["model_name_or_path"] = str(model_dir)
    model["from_scratch"] = True
    training["plugin"] = ["mm_models_qwen", "mm_data_text"]
    training["train_iters"] = STEPS
    training["output_dir"] = str(tmp / "run")
    return raw


def tiny_moe_dir(tmp: Path) -> Path:
    from transformers import Qwen3MoeConfig

    dense = json.loads((QUICKSTART.parent / "model" / "config.json").read_text(encoding="utf-8"))
    config = Qwen3MoeConfig(
        vocab_size=dense["vocab_size"],
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=dense["max_position_embeddings"],
        tie_word_embeddings=True,
    )
    out = tmp / "qwen3_moe_tiny"
    config.save_pretrained(out)
    return out


def run_skeleton(cfg: dict, tmp: Path, extra: list[str], in_process: bool = False) -> tuple[str, list[dict]]:
    """`mm check` and `mm train` of ``cfg``: as subprocesses, or with ``in_process`` the check in this process
    (`_mm.mm_here`) and the training in one launch; their output and the metrics."""
    path = tmp / "guide.yaml"
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True), encoding="utf-8")
    if not in_process:
        check = mm("check", str(path), *extra, "--world-size", "2").stdout
        train = mm("train", str(path), *extra, "--nproc-per-node", "2")
        out = check + train.stdout + train.stderr
    else:
        proc = mm_here("check", str(path), *extra, "--world-size", "2")
        assert proc.returncode == 0, f"mm check failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        check = proc.stdout
        log = tmp / "train.log"
        run_in_one_launch(2, captured(log, [("train", str(path), list(extra))]), REPO, timeout=600)
        out = check + read_captured(log)
    assert "hook groups : the FSDP units inside each of model.layers.{*}" in check
    records = read_metrics(tmp / "run")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    return out, records


def test_guide_skeleton_dense(tmp_path):
    cfg = filled(guide_skeleton(), QUICKSTART.parent / "model", "qwen3", tmp_path)
    del cfg["parallel"]["ep_plan"]["apply_modules"]
    out, _ = run_skeleton(cfg, tmp_path, [])
    # the edge unit (embedding, final norm and head gathered together) first, then one group per layer
    assert "gathering plan: model.embed_tokens + model.norm + lm_head [" in out
    assert "; model.layers.0 [model.layers.0];" in out


def test_guide_skeleton_expert_parallel(tmp_path):
    cfg = filled(guide_skeleton(), tiny_moe_dir(tmp_path), "qwen3_moe", tmp_path)
    out, _ = run_skeleton(cfg, tmp_path, ["parallel.expert_parallel_size=2"], in_process=True)
    assert "expert par. : ep=2 x efsdp=1" in out
    # the layer's dense unit and its expert unit (over the expert mesh) are gathered as one group
    assert "; model.layers.0 [model.layers.0, model.layers.0.mlp.experts];" in out
