"""The typed config: unknown keys, types, Literal values, required blocks, parallel sizes and overrides.

Every error must name the full dotted key and the bad value (ARCHITECTURE §4).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from mm_core.config import apply_overrides, load_config, parse_override, validate_config
from mm_core.config.schema import ParallelConfig
from mm_core.errors import ConfigError, MMError
from mm_core.parallel.state import resolve_sizes


def error_for(raw: dict[str, Any], edit: Callable[[dict[str, Any]], Any]) -> str:
    raw = copy.deepcopy(raw)
    edit(raw)
    with pytest.raises(ConfigError) as info:
        validate_config(raw, source="cfg.yaml")
    msg = str(info.value)
    assert "\n" not in msg, f"config errors are one line, got {msg!r}"
    assert msg.startswith("cfg.yaml: "), msg
    return msg


def test_the_base_config_is_valid(good_raw: dict[str, Any]) -> None:
    cfg = validate_config(copy.deepcopy(good_raw))
    assert cfg.model.model_id == "qwen3"
    assert cfg.parallel.fully_shard_parallel_size == "auto"
    assert cfg.training.train_iters == 2
    assert cfg.parallel.tensor_parallel_size == 1


# ------------------------------------------------------------------------------------------ unknown keys
@pytest.mark.parametrize(
    ("edit", "key", "suggestion"),
    [
        (lambda r: r.update(tols={}), "tols", "tools"),
        (lambda r: r["training"].update(learning_rate=1e-3), "training.learning_rate", None),
        (
            lambda r: r["training"].update(lr_warmup_raito=0.1),
            "training.lr_warmup_raito",
            "training.lr_warmup_ratio",
        ),
        (
            lambda r: r["parallel"]["fsdp_plan"].update(aply_modules=["x"]),
            "parallel.fsdp_plan.aply_modules",
            "parallel.fsdp_plan.apply_modules",
        ),
        (
            lambda r: r["model"].update(loss_cfg={"loss_typ": "raw"}),
            "model.loss_cfg.loss_typ",
            "model.loss_cfg.loss_type",
        ),
        (
            lambda r: r["data"]["dataset_param"].update(dataset_typ="x"),
            "data.dataset_param.dataset_typ",
            "data.dataset_param.dataset_type",
        ),
        (
            lambda r: r["data"]["dataloader_param"].update(num_worker=2),
            "data.dataloader_param.num_worker",
            "data.dataloader_param.num_workers",
        ),
        (
            lambda r: r.update(tools={"tensorboard": {"enabled": True}}),
            "tools.tensorboard.enabled",
            "tools.tensorboard.enable",
        ),
    ],
)
def test_unknown_key_names_the_dotted_key_and_suggests(
    good_raw: dict[str, Any], edit: Callable, key: str, suggestion: str | None
) -> None:
    msg = error_for(good_raw, edit)
    assert f"{key}: unknown key" in msg
    if suggestion is not None:
        assert f"did you mean {suggestion}?" in msg
    assert "accepted here:" in msg


def test_unknown_key_without_a_close_match_has_no_suggestion(good_raw: dict[str, Any]) -> None:
    msg = error_for(good_raw, lambda r: r["training"].update(zzzzzz=1))
    assert "training.zzzzzz: unknown key" in msg
    assert "did you mean" not in msg


@pytest.mark.parametrize("key", ["list", "dict"])
def test_unknown_key_named_like_a_type(good_raw: dict[str, Any], key: str) -> None:
    msg = error_for(good_raw, lambda r: r["training"].update({key: 1}))
    assert f"training.{key}: unknown key" in msg


def test_collate_param_passes_extra_keys_through(good_raw: dict[str, Any]) -> None:
    raw = copy.deepcopy(good_raw)
    raw["data"]["dataloader_param"]["collate_param"]["my_collator_option"] = 7
    cfg = validate_config(raw)
    assert cfg.data.dataloader_param.collate_param.model_dump()["my_collator_option"] == 7


# ------------------------------------------------------------------------------------------ wrong types
@pytest.mark.parametrize(
    ("edit", "key", "value"),
    [
        (lambda r: r["training"].update(lr="fast"), "training.lr", "'fast'"),
        (lambda r: r["training"].update(train_iters="ten"), "training.train_iters", "'ten'"),
        (lambda r: r["training"].update(train_iters=2.5), "training.train_iters", "2.5"),
        (lambda r: r["training"].update(micro_batch_size=0), "training.micro_batch_size", "0"),
        (lambda r: r["training"].update(optimizer=["adamw"]), "training.optimizer", "['adamw']"),
        (
            lambda r: r["parallel"]["fsdp_plan"].update(apply_modules="model.layers.{*}"),
            "parallel.fsdp_plan.apply_modules",
            "'model.layers.{*}'",
        ),
        (
            lambda r: r.update(tools={"tensorboard": {"enable": "maybe"}}),
            "tools.tensorboard.enable",
            "'maybe'",
        ),
        (
            lambda r: r["parallel"].update(fully_shard_parallel_size="two"),
            "parallel.fully_shard_parallel_size",
            "'two'",
        ),
        (
            lambda r: r["parallel"].update(fully_shard_parallel_size=0),
            "parallel.fully_shard_parallel_size",
            "0",
        ),
        (lambda r: r["parallel"].update(data_parallel_size=-2), "parallel.data_parallel_size", "-2"),
        (lambda r: r["parallel"].update(ulysses_parallel_size=0), "parallel.ulysses_parallel_size", "0"),
        (lambda r: r.update(training=5), "training", "5"),
    ],
)
def test_wrong_type_names_key_and_value(
    good_raw: dict[str, Any], edit: Callable, key: str, value: str
) -> None:
    msg = error_for(good_raw, edit)
    assert f"cfg.yaml: {key}: got {value};" in msg


def test_union_error_says_what_each_member_accepts(good_raw: dict[str, Any]) -> None:
    msg = error_for(good_raw, lambda r: r["parallel"].update(fully_shard_parallel_size="two"))
    assert "integer" in msg and "'auto'" in msg


@pytest.mark.parametrize(
    ("section", "key"),
    [("training", "train_iters"), ("parallel", "fully_shard_parallel_size")],
)
def test_boolean_is_not_accepted_as_an_integer(good_raw: dict[str, Any], section: str, key: str) -> None:
    msg = error_for(good_raw, lambda r: r[section].update({key: True}))
    assert f"{section}.{key}: got True" in msg


# ------------------------------------------------------------------------------------------ Literal values
@pytest.mark.parametrize(
    ("edit", "key", "value", "accepted"),
    [
        (
            lambda r: r["training"].update(lr_decay_style="cosin"),
            "training.lr_decay_style",
            "'cosin'",
            ["'constant'", "'linear'", "'cosine'"],
        ),
        (
            lambda r: r["parallel"]["fsdp_plan"].update(param_dtype="fp8"),
            "parallel.fsdp_plan.param_dtype",
            "'fp8'",
            ["'bf16'", "'fp32'"],
        ),
        (
            lambda r: r["model"].update(loss_cfg={"loss_type": "mean"}),
            "model.loss_cfg.loss_type",
            "'mean'",
            ["'per_token_loss'", "'per_sample_loss'"],
        ),
        (
            lambda r: r["data"]["dataloader_param"].update(dataloader_mode="fast"),
            "data.dataloader_param.dataloader_mode",
            "'fast'",
            ["'base'", "'sampler'"],
        ),
    ],
)
def test_literal_value_lists_the_accepted_values(
    good_raw: dict[str, Any], edit: Callable, key: str, value: str, accepted: list[str]
) -> None:
    msg = error_for(good_raw, edit)
    assert f"{key}: got {value};" in msg
    for option in accepted:
        assert option in msg


# ------------------------------------------------------------------------------------------ required blocks
@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda r: r.pop("model"), "model"),
        (lambda r: r.pop("data"), "data"),
        (lambda r: r.pop("training"), "training"),
        (lambda r: r["model"].pop("model_id"), "model.model_id"),
        (lambda r: r["data"].pop("dataset_param"), "data.dataset_param"),
        (lambda r: r["data"]["dataset_param"].pop("dataset_type"), "data.dataset_param.dataset_type"),
    ],
)
def test_missing_required_key_is_named(good_raw: dict[str, Any], edit: Callable, key: str) -> None:
    msg = error_for(good_raw, edit)
    assert f"cfg.yaml: {key}: missing" in msg


@pytest.mark.parametrize(
    ("edit", "got"),
    [
        (lambda r: r["training"].pop("train_iters"), "neither"),
        (lambda r: r["training"].update(train_epochs=2), "both (train_iters 2, train_epochs 2.0)"),
    ],
)
def test_one_of_train_iters_and_train_epochs(good_raw: dict[str, Any], edit: Callable, got: str) -> None:
    msg = error_for(good_raw, edit)
    assert msg == (
        "cfg.yaml: training: give exactly one of training.train_iters (optimizer steps) and "
        f"training.train_epochs (passes over the data), got {got}; set the other to null"
    )


def test_train_epochs_alone_is_accepted(good_raw: dict[str, Any]) -> None:
    raw = copy.deepcopy(good_raw)
    raw["training"].pop("train_iters")
    raw["training"]["train_epochs"] = 1.5
    tcfg = validate_config(raw).training
    assert tcfg.train_epochs == 1.5
    with pytest.raises(RuntimeError, match="not resolved"):
        _ = tcfg.total_iters
    tcfg.set_epoch_iters(7)
    assert tcfg.total_iters == 7
    assert "train_iters: null" in yaml.safe_dump(tcfg.model_dump(mode="json"))  # the saved config as given


def test_optional_blocks_take_defaults(good_raw: dict[str, Any]) -> None:
    raw = copy.deepcopy(good_raw)
    raw.pop("parallel")
    raw.pop("tools", None)
    cfg = validate_config(raw)
    assert cfg.parallel.fsdp_plan.apply_modules == []
    assert cfg.tools.tensorboard.enable is False


def test_empty_file_reports_the_missing_blocks(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"(data|model|training): missing"):
        load_config(path)


def test_tensor_parallel_size_other_than_one_is_rejected(good_raw: dict[str, Any]) -> None:
    msg = error_for(good_raw, lambda r: r["parallel"].update(tensor_parallel_size=2))
    assert "parallel.tensor_parallel_size: got 2;" in msg
    assert "only 1" in msg
    validate_config({**copy.deepcopy(good_raw), "parallel": {"tensor_parallel_size": 1}})


# ------------------------------------------------------------------------------------------ files
def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_invalid_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("training:\n  lr: 1\n  save: [unclosed\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{path}:" in str(info.value) and "not valid YAML" in str(info.value)


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)


# ------------------------------------------------------------------------------------------ parallel sizes
def sizes(world: int, **parallel: Any):
    return resolve_sizes(ParallelConfig(**parallel), world)


def test_auto_shards_over_the_whole_world() -> None:
    s = sizes(4)
    assert (s.world_size, s.dp_replicate, s.dp_shard, s.cp, s.dp, s.fsdp) == (4, 1, 4, 1, 4, 4)
    assert s.layout == "FSDP x4"


def test_fully_shard_one_is_ddp() -> None:
    s = sizes(4, fully_shard_parallel_size=1)
    assert (s.dp_replicate, s.dp_shard, s.dp, s.fsdp) == (4, 1, 4, 1)
    assert s.layout == "DDP x4"


def test_fully_shard_smaller_than_world_is_hsdp() -> None:
    s = sizes(8, fully_shard_parallel_size=2)
    assert (s.dp_replicate, s.dp_shard, s.dp, s.fsdp) == (4, 2, 8, 2)
    assert s.layout == "HSDP 4 replicas x 2 shards"


def test_explicit_sizes_equal_to_the_world_are_fsdp() -> None:
    s = sizes(2, fully_shard_parallel_size=2, data_parallel_size=2)
    assert (s.dp_replicate, s.dp_shard) == (1, 2)


def test_single_process() -> None:
    s = sizes(1)
    assert (s.dp_replicate, s.dp_shard) == (1, 1)
    assert s.layout == "single process"


@pytest.mark.parametrize(
    ("world", "parallel", "key", "value"),
    [
        (4, {"fully_shard_parallel_size": 3}, "parallel.fully_shard_parallel_size", "3"),
        (4, {"fully_shard_parallel_size": 8}, "parallel.fully_shard_parallel_size", "8"),
        (6, {"fully_shard_parallel_size": 4}, "parallel.fully_shard_parallel_size", "4"),
        (4, {"data_parallel_size": 2}, "parallel.data_parallel_size", "2"),
        (4, {"ulysses_parallel_size": 3}, "parallel.ulysses_parallel_size", "3"),
        (4, {"ring_attention_size": 3}, "parallel.ring_attention_size", "3"),
        (4, {"expert_parallel_size": 3}, "parallel.expert_parallel_size", "3"),
        (
            4,
            {"fully_shard_parallel_size": 2, "expert_parallel_size": 4},
            "parallel.expert_parallel_size",
            "4",
        ),
        (
            4,
            {"expert_parallel_size": 2, "expert_fully_shard_parallel_size": 4},
            "parallel.expert_fully_shard_parallel_size",
            "4",
        ),
        (
            4,
            {"ulysses_parallel_size": 2, "fully_shard_parallel_size": 1},
            "parallel.fully_shard_parallel_size",
            "1",
        ),
    ],
)
def test_impossible_parallel_sizes_name_the_key_and_value(
    world: int, parallel: dict[str, Any], key: str, value: str
) -> None:
    with pytest.raises(ConfigError) as info:
        sizes(world, **parallel)
    msg = str(info.value)
    assert f"{key}: got {value};" in msg


def test_context_and_expert_sizes() -> None:
    s = sizes(8, ulysses_parallel_size=2, ring_attention_size=2, expert_parallel_size=4)
    assert (s.dp_replicate, s.dp_shard, s.cp, s.fsdp, s.ep, s.efsdp, s.dp) == (1, 2, 4, 8, 4, 2, 2)
    s = sizes(8, ulysses_parallel_size=2, fully_shard_parallel_size=4, expert_parallel_size=2)
    assert (s.dp_replicate, s.dp_shard, s.cp, s.fsdp, s.efsdp, s.dp) == (2, 2, 2, 4, 2, 4)


def test_fully_shard_not_dividing_the_world_lists_the_divisors() -> None:
    with pytest.raises(ConfigError) as info:
        sizes(6, fully_shard_parallel_size=4)
    assert "world size 6" in str(info.value)
    assert "1, 2, 3, 6" in str(info.value)


def test_nonpositive_world_size_is_rejected() -> None:
    with pytest.raises(ConfigError, match="world size must be positive"):
        sizes(0)


# ------------------------------------------------------------------------------------------ overrides
@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("training.save=null", "training.save", None),
        ("training.save=", "training.save", None),
        ("training.train_iters=7", "training.train_iters", 7),
        ("training.progress_bar=false", "training.progress_bar", False),
        ("model.model_id=qwen3", "model.model_id", "qwen3"),
        (
            "parallel.fsdp_plan.apply_modules=[model.layers.{*}]",
            "parallel.fsdp_plan.apply_modules",
            ["model.layers.{*}"],
        ),
        (
            "parallel.fsdp_plan.apply_modules=[model.layers.{0-3}, lm_head]",
            "parallel.fsdp_plan.apply_modules",
            ["model.layers.{0-3}", "lm_head"],
        ),
        ("parallel.fsdp_plan.apply_modules=[]", "parallel.fsdp_plan.apply_modules", []),
        ("model.config_overrides={num_hidden_layers: 3}", "model.config_overrides", {"num_hidden_layers": 3}),
        ("training.output_dir=a=b", "training.output_dir", "a=b"),
    ],
)
def test_parse_override_reads_the_value_as_yaml(text: str, key: str, value: Any) -> None:
    assert parse_override(text) == (key, value)


@pytest.mark.parametrize("text", ["training.lr", "=3", "training..lr=1", ".lr=1", "training.=1", ""])
def test_bad_override_syntax_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_override(text)
    assert repr(text) in str(info.value)
    assert "KEY=VALUE" in str(info.value)


def test_overrides_applied_when_loading(write_config: Callable[..., Path]) -> None:
    path = write_config(lambda r: r["training"].update(save="/somewhere"))
    cfg = load_config(
        path,
        [
            "training.lr=3e-4",
            "training.save=null",
            "parallel.fsdp_plan.apply_modules=[model.layers.{*}.mlp]",
            "parallel.fully_shard_parallel_size=1",
        ],
    )
    assert cfg.training.lr == pytest.approx(3e-4)
    assert isinstance(cfg.training.lr, float)
    assert cfg.training.save is None
    assert cfg.parallel.fsdp_plan.apply_modules == ["model.layers.{*}.mlp"]
    assert cfg.parallel.fully_shard_parallel_size == 1
    # the file itself is untouched
    assert yaml.safe_load(path.read_text())["training"]["save"] == "/somewhere"


def test_later_override_wins(write_config: Callable[..., Path]) -> None:
    cfg = load_config(write_config(), ["training.lr=1e-2", "training.lr=5e-3"])
    assert cfg.training.lr == pytest.approx(5e-3)


def test_override_creates_a_missing_block(write_config: Callable[..., Path]) -> None:
    path = write_config(lambda r: r.pop("tools", None))
    cfg = load_config(path, ["tools.tensorboard.enable=true", "tools.tensorboard.log_dir=/tmp/tb"])
    assert cfg.tools.tensorboard.enable is True
    assert cfg.tools.tensorboard.log_dir == "/tmp/tb"


def test_override_creates_nested_blocks_in_place() -> None:
    raw: dict[str, Any] = {"training": {"lr": 1.0}}
    out = apply_overrides(raw, ["parallel.fsdp_plan.param_dtype=bf16"])
    assert out is raw
    assert raw == {"training": {"lr": 1.0}, "parallel": {"fsdp_plan": {"param_dtype": "bf16"}}}


def test_override_of_an_unknown_key_is_caught_by_validation(write_config: Callable[..., Path]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write_config(), ["training.lrr=1e-3"])
    assert "training.lrr: unknown key; did you mean training.lr?" in str(info.value)


def test_override_of_an_unknown_nested_block_names_the_first_unknown_key(
    write_config: Callable[..., Path],
) -> None:
    with pytest.raises(ConfigError, match=r"training\.foo: unknown key"):
        load_config(write_config(), ["training.foo.bar=1"])


def test_override_through_a_scalar_is_an_error(write_config: Callable[..., Path]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write_config(), ["training.lr.value=1"])
    msg = str(info.value)
    assert "training.lr.value" in msg and "not a block of keys" in msg and "0.001" in msg


def test_override_with_a_bad_value_names_key_and_value(write_config: Callable[..., Path]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write_config(), ["training.lr=abc"])
    assert "training.lr: got 'abc'" in str(info.value)


def test_config_errors_are_user_errors() -> None:
    assert issubclass(ConfigError, MMError)
