"""Checkpoints: save every N steps with a ``latest`` marker, resume exactly, export to Hugging Face with equal
logits, and load Hugging Face weights (directly or via ``mm convert hf-to-dcp``) under meta-device init.

The training runs (and the conversions between them, the functions behind ``mm convert``) happen once for the
module, in one launch of 2 processes (see :func:`runs`); ``--max-shard-size`` and the one-line error go
through the ``mm convert`` command."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _launch import Call, run_in_one_launch
from _mm import QUICKSTART, REPO, mm, read_metrics
from transformers import AutoModelForCausalLM, AutoTokenizer

COMMON = [
    "training.log_interval=1",
    "training.seed=3",
    "data.dataset_param.basic_parameters.seq_len=64",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=1",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "training.lr_warmup_ratio=0",
]


def convert_weights(ckpt: str, exported: str, dcp_dir: str) -> None:
    """Rank 0: what ``mm convert dcp-to-hf CKPT EXPORTED`` and then ``mm convert hf-to-dcp EXPORTED DCP_DIR``
    do (the functions behind them, with the commands' default options)."""
    if os.environ["RANK"] == "0":
        from mm_core import convert

        convert.dcp_to_hf(ckpt, exported)
        convert.hf_to_dcp(exported, dcp_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's training runs in one launch of 2 processes, each as an ``mm train --nproc-per-node 2``
    worker runs it (see :mod:`_launch`): ``straight`` (4 steps, saving at steps 2 and 4); its save root
    exported to Hugging Face (following ``latest``) and that export written again as DCP; ``resume`` (from
    step 2 of ``straight``); then one step from the exported weights under meta-device init (``hf``: the HF
    folder, ``dcp``: its DCP copy) and without it (``plain``). The folders by name."""
    names = ("straight", "hf_export", "resume", "hf", "dcp", "plain")
    d = {name: tmp_path_factory.mktemp(name) for name in names}
    ckpt, exported = d["straight"] / "ckpt", d["hf_export"]
    step_2 = ckpt / "step_2"
    dcp_dir = exported.with_name(exported.name + "_dcp")
    one_step = [*COMMON, "training.train_iters=1", "training.save=null"]
    meta = ["training.init_model_with_meta_device=true"]
    from_hf = [f"model.model_name_or_path={exported}", "model.from_scratch=false"]
    overrides = {
        "straight": [*COMMON, "training.train_iters=4", "training.save_interval=2", f"training.save={ckpt}"],
        "resume": [*COMMON, "training.train_iters=4", "training.save=null", f"training.load={step_2}"],
        "hf": [*one_step, *meta, *from_hf],
        "dcp": [*one_step, *meta, f"training.load={dcp_dir}"],
        "plain": [*one_step, *from_hf, "training.init_model_with_meta_device=false"],
    }
    run = {k: (k, str(QUICKSTART), [*o, f"training.output_dir={d[k]}"]) for k, o in overrides.items()}
    # the save root: the export follows `latest`
    convert = Call("convert", f"{__name__}:convert_weights", (str(ckpt), str(exported), str(dcp_dir)))
    items = [run["straight"], convert, run["resume"], run["hf"], run["dcp"], run["plain"]]
    run_in_one_launch(2, items, REPO, timeout=900)
    return d


@pytest.fixture(scope="module")
def straight(runs):
    """4 steps on 2 ranks, saving at steps 2 and 4."""
    return runs["straight"]


def test_layout_and_latest_marker(straight):
    ckpt = straight / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "step_4"
    for step in (2, 4):
        assert (ckpt / f"step_{step}" / ".metadata").is_file()
        assert (ckpt / f"step_{step}" / "mm_config.yaml").is_file()
    assert not list(ckpt.glob(".*partial*"))
    assert (straight / "config.yaml").is_file()


def test_resume_gives_identical_losses(straight, runs):
    resumed = read_metrics(runs["resume"])
    ref = {r["step"]: r for r in read_metrics(straight)}
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        assert r["loss"] == ref[r["step"]]["loss"], r["step"]
        assert r["grad_norm"] == ref[r["step"]]["grad_norm"], r["step"]


def _mm_model_from_checkpoint(path):
    from mm_core.config import load_config
    from mm_core.models import ModelHub

    cfg = load_config(QUICKSTART)
    model = ModelHub.build(cfg.model)  # from_scratch: random weights, overwritten below
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state["model"])
    return model.eval()


@pytest.fixture(scope="module")
def exported(runs):
    return runs["hf_export"]


def test_export_loads_in_plain_transformers_with_equal_logits(straight, exported, monkeypatch):
    monkeypatch.chdir(REPO)  # the quickstart config's paths are relative to the repository root
    conf = json.loads((exported / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3ForCausalLM"]
    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ours = _mm_model_from_checkpoint(straight / "ckpt" / "step_4")
    tok = AutoTokenizer.from_pretrained(exported)  # the tokenizer travels with the export
    ids = torch.tensor([tok.encode("def f(x):\n    return x + 1")])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=0, atol=0)


def test_sharded_export_has_index(straight, tmp_path):
    mm("convert", "dcp-to-hf", str(straight / "ckpt" / "step_2"), str(tmp_path), "--max-shard-size", "2MB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    AutoModelForCausalLM.from_pretrained(tmp_path)


def test_meta_init_loads_hf_weights_and_dcp_weights(runs):
    """Under meta-device init each rank loads only its slices, from the HF folder or from its DCP copy;
    the first loss equals the one computed by the unsharded exported model."""
    runs = {name: read_metrics(runs[name])[0] for name in ("hf", "dcp", "plain")}
    assert runs["hf"]["loss"] == pytest.approx(runs["plain"]["loss"], rel=1e-6)
    assert runs["dcp"]["loss"] == pytest.approx(runs["plain"]["loss"], rel=1e-6)
    assert runs["plain"]["loss"] < 7.5  # trained weights, not a fresh initialisation (ln 4096 = 8.3)


def test_convert_errors_are_one_line(tmp_path):
    proc = mm("convert", "dcp-to-hf", str(tmp_path / "missing"), str(tmp_path / "out"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("mm: error:")
