"""``training.train_epochs``, ``training.save_hf_interval``, ``model.special_tokens`` and
``training.lr_scaling_plan`` end to end, on a tiny Qwen3 (tied embeddings) over the quickstart's text, 2 gloo
processes, in one launch:

- ``epochs``: from scratch on the meta device, ``train_epochs: 0.01`` (the steps the loader gives), two
  special tokens (embedding and tied head grown to 4098 rows), a DCP checkpoint and a Hugging Face folder
  every 2 steps and at the last; the HF folders load with plain transformers, hold the checkpoint's weights
  and the extended tokenizer;
- ``resume``: from its step 2 with the same epochs: the same steps and losses;
- ``pretrained``: from a pretrained folder (built whole): the new rows take the mean of the loaded rows, and
  ``lr_scaling_plan: {model.embed_tokens: 0}`` keeps the embedding (tied head included) exactly as loaded
  while the rest trains.

Per-group multipliers inside AdamW and Muon are measured in packages/mm-core/tests/test_lr_scaling.py; the
epoch arithmetic in packages/mm-core/tests/test_train_epochs.py."""

from __future__ import annotations

import json

import pytest
import torch
from _launch import run_in_one_launch
from _mm import QUICKSTART, REPO, mm, quickstart_text_data, read_metrics
from _tiny import QWEN3
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

TINY = "{hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 2, " + (
    "num_key_value_heads: 1, head_dim: 16}"
)
TOKENS = "[<tool>, </tool>]"
COMMON = [
    f"model.config_overrides={TINY}",
    "data.dataset_param.basic_parameters.seq_len=64",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=1",
    "training.log_interval=1",
    "training.progress_bar=false",
    "tools.tensorboard.enable=false",
    "training.lr_warmup_ratio=0",
]
EPOCHS = 0.01
_TINY_QWEN3 = {**QWEN3}


def expected_iters() -> int:
    """What ``train_epochs: 0.01`` comes to on 2 ranks (the loader of the run, built here)."""
    from mm_core.config.schema import DataConfig
    from mm_core.data import build_collator, build_dataloader, build_dataset
    from mm_core.data.epochs import iters_for_epochs

    data = DataConfig.model_validate(quickstart_text_data(64))
    dataset = build_dataset(data, 42)
    loader = build_dataloader(
        dataset, build_collator(data, dataset), data, micro_batch_size=2, dp_size=2, dp_rank=0, seed=42
    )
    return iters_for_epochs(loader, EPOCHS, 1)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = {n: tmp_path_factory.mktemp(n) for n in ("epochs", "resume", "pretrained", "weights")}
    torch.manual_seed(0)
    conf = json.loads((QUICKSTART.parent / "model" / "config.json").read_text())
    conf.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    conf.update(num_key_value_heads=1, head_dim=16)
    conf.pop("layer_types", None)
    Qwen3ForCausalLM(Qwen3Config(**conf)).save_pretrained(d["weights"])
    ckpt = d["epochs"] / "ckpt"
    budget = ["training.train_iters=null", f"training.train_epochs={EPOCHS}"]
    overrides = {
        "epochs": [
            *budget,
            f"model.special_tokens={TOKENS}",
            f"training.save={ckpt}",
            "training.save_interval=2",
            "training.save_hf_interval=2",
        ],
        "resume": [
            *budget,
            f"model.special_tokens={TOKENS}",
            f"training.load={ckpt / 'step_2'}",
            "training.save=null",
        ],
        "pretrained": [
            "training.train_iters=2",
            f"model.model_name_or_path={d['weights']}",
            "model.from_scratch=false",
            f"model.special_tokens={TOKENS}",
            "training.lr_scaling_plan={model.embed_tokens: 0.0}",
            "training.save=null",
            "training.save_hf_interval=5",
        ],
    }
    items = [
        (name, str(QUICKSTART), [*COMMON, *extra, f"training.output_dir={d[name]}"])
        for name, extra in overrides.items()
    ]
    run_in_one_launch(2, items, REPO, timeout=900)
    return d


def test_epochs_give_the_loaders_steps_and_resume(runs):
    iters = expected_iters()
    assert iters == 5  # 0.01 x 438 micro-batches per rank, rounded up
    straight = read_metrics(runs["epochs"])
    assert [r["step"] for r in straight] == list(range(1, iters + 1))
    resumed = read_metrics(runs["resume"])
    assert [r["step"] for r in resumed] == list(range(3, iters + 1))
    for r in resumed:
        assert r["loss"] == straight[r["step"] - 1]["loss"], r["step"]


def test_hf_folders_load_in_plain_transformers_with_the_checkpoints_weights(runs, tmp_path):
    hf_root = runs["epochs"] / "ckpt" / "hf"
    assert sorted(p.name for p in hf_root.iterdir()) == ["step_2", "step_4", "step_5"]
    folder = hf_root / "step_5"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    emb = model.get_input_embeddings().weight
    assert emb.shape == (4098, 32) and model.config.vocab_size == 4098
    assert model.lm_head.weight.data_ptr() == emb.data_ptr()  # still tied
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 4098 and tok.convert_tokens_to_ids(["<tool>", "</tool>"]) == [4096, 4097]
    assert "<tool>" in tok.tokenize("a <tool> b")  # one token, never split
    # the same weights as the DCP checkpoint of that step, exported by mm convert
    mm("convert", "dcp-to-hf", str(runs["epochs"] / "ckpt" / "step_5"), str(tmp_path / "x"))
    ours, theirs = load_file(folder / "model.safetensors"), load_file(tmp_path / "x" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)
    saved = AutoTokenizer.from_pretrained(runs["epochs"] / "tokenizer")  # the run's extended tokenizer
    assert len(saved) == 4098


def test_new_rows_take_the_mean_and_a_zero_multiplier_freezes_them(runs):
    loaded = Qwen3ForCausalLM.from_pretrained(runs["weights"]).get_input_embeddings().weight.detach()
    folder = runs["pretrained"] / "hf" / "step_2"  # the last step (save_hf_interval 5 > 2 steps)
    trained = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    emb = trained.get_input_embeddings().weight.detach()
    assert emb.shape == (4098, 32)
    torch.testing.assert_close(emb[:4096], loaded, rtol=0, atol=0)  # lr x0: not moved by 2 steps
    spread = loaded.std(dim=0).max().item()
    for row in emb[4096:]:
        torch.testing.assert_close(row, loaded.mean(dim=0), rtol=0, atol=1e-3 * spread)
    init = Qwen3ForCausalLM.from_pretrained(runs["weights"]).state_dict()
    moved = [n for n, p in trained.named_parameters() if "embed" not in n and not torch.equal(p, init[n])]
    assert any(n.startswith("model.layers.") for n in moved)  # the rest trained (lr x1)
    assert len(read_metrics(runs["pretrained"])) == 2


def test_check_shows_the_lr_groups():
    out = mm(
        "check",
        str(QUICKSTART),
        f"model.config_overrides={TINY}",
        "training.lr_scaling_plan={model.embed_tokens: 0.1, 'model.layers.{*}.mlp': 2.0}",
        "--world-size",
        "2",
    ).stdout
    lines = out.splitlines()
    start = lines.index("lr scaling  : training.lr_scaling_plan (first matching pattern wins)")
    assert lines[start + 1].startswith("  lr x0.1  model.embed_tokens: 1 tensors (131,072 elements)")
    assert lines[start + 2].startswith("  lr x2  model.layers.{*}.mlp: 6 tensors (12,288 elements)")
    assert lines[start + 3].startswith("  lr x1  (no pattern): ")
    bad = mm("check", str(QUICKSTART), "training.lr_scaling_plan={model.embed: 0.1}", check=False)
    assert bad.returncode == 2
    assert "training.lr_scaling_plan: pattern 'model.embed' matches no trainable parameter" in bad.stderr


# ------------------------------------------------------------------------------- special tokens, in process
def _cfg(tmp_path, **model):
    from mm_core.config import validate_config

    raw = {
        "data": quickstart_text_data(64),
        "model": {"model_id": "qwen3", "special_tokens": ["<a>", "<b>", "<c>"], **model},
        "training": {"train_iters": 1, "output_dir": str(tmp_path / "out")},
    }
    return validate_config(raw)


@pytest.mark.parametrize("tie", [True, False])
def test_resize_rows_take_the_mean_tied_or_not(tie):
    from mm_core.models.special_tokens import resize_embeddings

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**{**_TINY_QWEN3, "tie_word_embeddings": tie}))
    emb, head = model.get_input_embeddings().weight.detach().clone(), model.lm_head.weight.detach().clone()
    note = resize_embeddings(model, 131, mean_init=True)
    assert note == (
        f"model.special_tokens: input embedding and {'tied ' if tie else ''}output head resized from 128 to "
        "131 rows (new rows: the mean of the existing rows)"
    )
    new_emb, new_head = model.get_input_embeddings().weight, model.lm_head.weight
    assert new_emb.shape == new_head.shape == (131, 32) and model.config.vocab_size == 131
    assert (new_emb.data_ptr() == new_head.data_ptr()) is tie
    for old, new in ((emb, new_emb), (head, new_head)):
        torch.testing.assert_close(new[:128], old, rtol=0, atol=0)
        for row in new[128:]:
            torch.testing.assert_close(row, old.mean(0), rtol=0, atol=1e-3 * old.std(0).max().item())
    assert resize_embeddings(model, 130, mean_init=True) is None  # never shrinks


def test_prepare_tokenizer_writes_the_run_tokenizer(tmp_path):
    from mm_core.models.special_tokens import prepare_tokenizer, vocabulary_size

    cfg = _cfg(tmp_path)
    assert vocabulary_size(cfg) == 4099
    note = prepare_tokenizer(cfg, tmp_path / "out")
    dst = (tmp_path / "out" / "tokenizer").resolve()
    assert cfg.data.dataset_param.preprocess_parameters["model_name_or_path"] == str(dst)
    assert note.startswith("model.special_tokens: 3 tokens added to the tokenizer of ")
    assert note.endswith(
        f"(4099 tokens now), saved to {dst} (data.dataset_param.preprocess_parameters.model_name_or_path)"
    )
    tok = AutoTokenizer.from_pretrained(dst)
    assert tok.convert_tokens_to_ids(["<a>", "<b>", "<c>"]) == [4096, 4097, 4098]
    assert tok.decode(tok.encode("x<b>y"), skip_special_tokens=True) == "xy"  # special: dropped on decode
    source = QUICKSTART.parent / "tokenizer"
    assert {p.name for p in source.iterdir()} <= {p.name for p in dst.iterdir()}
    assert prepare_tokenizer(cfg, tmp_path / "out") == note.replace(
        f"tokenizer of {source}", f"tokenizer of {dst}"
    )


def test_meta_init_and_special_tokens(tmp_path):
    from mm_core.errors import ConfigError
    from mm_core.parallel.apply import meta_init

    folder = tmp_path / "weights"
    Qwen3ForCausalLM(Qwen3Config(**{**_TINY_QWEN3, "vocab_size": 4096})).save_pretrained(folder)
    pretrained = _cfg(tmp_path, model_name_or_path=str(folder))
    meta, why = meta_init("auto", pretrained.model, None)
    assert not meta and "model.special_tokens: new embedding rows take the mean of the loaded ones" in why
    scratch = _cfg(tmp_path, model_name_or_path=str(folder), from_scratch=True)
    assert meta_init("auto", scratch.model, None)[0]
    with pytest.raises(ConfigError, match="names no tokenizer folder|is not a local folder"):
        from mm_core.models.special_tokens import vocabulary_size

        bad = _cfg(tmp_path)
        bad.data.dataset_param.preprocess_parameters = {"model_name_or_path": str(tmp_path / "nowhere")}
        vocabulary_size(bad)
