"""Config input that used to be accepted silently: infinite/NaN floats, keys given twice, non-UTF-8 files.

Each must be a one-line ConfigError naming the dotted key (or the file and line) and what to do.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from mm_core.config import load_config, parse_override, validate_config
from mm_core.errors import ConfigError


def one_line_error(raw: dict[str, Any], edit: Callable[[dict[str, Any]], Any]) -> str:
    raw = copy.deepcopy(raw)
    edit(raw)
    with pytest.raises(ConfigError) as info:
        validate_config(raw, source="cfg.yaml")
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------------------------------ finite floats
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda r, v: r["training"].update(lr=v), "training.lr"),
        (lambda r, v: r["training"].update(lr_min=v), "training.lr_min"),
        (lambda r, v: r["training"].update(weight_decay=v), "training.weight_decay"),
        (lambda r, v: r["training"].update(clip_grad=v), "training.clip_grad"),
        (lambda r, v: r["training"].update(adam_eps=v), "training.adam_eps"),
        (lambda r, v: r["training"].update(lora={"alpha": v}), "training.lora.alpha"),
        (lambda r, v: r["training"].update(muon={"adamw_lr": v}), "training.muon.adamw_lr"),
        (
            lambda r, v: r["training"].update(muon={"ns_coefficients": [1.0, v, 2.0]}),
            "training.muon.ns_coefficients.1",
        ),
        (
            lambda r, v: r["model"].update(loss_cfg={"router_aux_loss_coef": v}),
            "model.loss_cfg.router_aux_loss_coef",
        ),
    ],
)
def test_infinite_or_nan_float_is_refused(
    good_raw: dict[str, Any], edit: Callable, key: str, bad: float
) -> None:
    msg = one_line_error(good_raw, lambda r: edit(r, bad))
    assert msg.startswith(f"cfg.yaml: {key}: got "), msg
    assert "finite number" in msg, msg


@pytest.mark.parametrize("text", ["training.lr=.inf", "training.lr=.nan", "training.lr=-.inf"])
def test_infinite_lr_from_yaml_or_override_is_refused(
    write_config: Callable[..., Path], tmp_path: Path, text: str
) -> None:
    with pytest.raises(ConfigError, match=r"training\.lr: got (-?inf|nan); input should be a finite number"):
        load_config(write_config(), [text])
    path = tmp_path / "inf.yaml"
    raw = yaml.safe_load(write_config().read_text(encoding="utf-8"))
    raw["training"]["lr"] = yaml.safe_load(text.split("=")[1])
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    assert text.split("=")[1] in path.read_text()
    with pytest.raises(ConfigError, match=r"training\.lr: got (-?inf|nan)"):
        load_config(path)


def test_finite_floats_still_accepted(good_raw: dict[str, Any]) -> None:
    raw = copy.deepcopy(good_raw)
    raw["training"].update(lr=3e-4, clip_grad=None, muon={"ns_coefficients": [3.4445, -4.775, 2.0315]})
    cfg = validate_config(raw)
    assert cfg.training.lr == 3e-4 and cfg.training.clip_grad is None


def test_new_training_keys_have_safe_defaults(good_raw: dict[str, Any]) -> None:
    cfg = validate_config(copy.deepcopy(good_raw))
    assert cfg.training.skip_nonfinite_steps == 0
    assert cfg.training.overwrite_output_dir is False
    msg = one_line_error(good_raw, lambda r: r["training"].update(skip_nonfinite_steps=-1))
    assert "training.skip_nonfinite_steps: got -1" in msg


# ------------------------------------------------------------------------------------------ duplicate keys
def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_a_block_given_twice_names_the_key_and_both_lines(good_raw: dict[str, Any], tmp_path: Path) -> None:
    # the fault from the issue: a second ``training:`` block replaced the first, and checkpointing vanished
    body = yaml.safe_dump(good_raw, sort_keys=False)
    text = body + "training:\n  train_iters: 5\n"
    first = next(i for i, line in enumerate(text.splitlines(), 1) if line == "training:")
    second = len(text.splitlines()) - 1
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}:{second}: key training is given twice"), msg
    assert f"lines {first} and {second}" in msg, msg


def test_a_nested_key_given_twice_names_the_dotted_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "training:\n  lr: 1.0e-3\n  seed: 1\n  lr: 3.0e-4\nmodel: {model_id: qwen3}\n")
    with pytest.raises(ConfigError, match=r"cfg\.yaml:4: key training\.lr is given twice \(lines 2 and 4\)"):
        load_config(path)


def test_a_key_given_twice_inside_a_list_item(tmp_path: Path) -> None:
    path = _write(tmp_path, "tools:\n  profile:\n    ranks: [0]\nx:\n  - {a: 1, b: 2}\n  - {a: 1, a: 2}\n")
    with pytest.raises(ConfigError, match=r"cfg\.yaml:6: key x\[1\]\.a is given twice \(lines 6 and 6\)"):
        load_config(path)


def test_merge_keys_may_still_be_overridden(good_raw: dict[str, Any], tmp_path: Path) -> None:
    # ``<<: *anchor`` then an explicit key is how YAML overrides a merged value; that is not a duplicate
    raw = copy.deepcopy(good_raw)
    raw["training"].pop("lr")
    text = "defaults: &d {lr: 1.0e-3, seed: 7}\n" + yaml.safe_dump(raw, sort_keys=False)
    text = text.replace("training:\n", "training:\n  <<: *d\n  lr: 5.0e-4\n", 1)
    data = yaml.safe_load(text)
    data.pop("defaults")
    cfg = validate_config(data)
    assert (cfg.training.lr, cfg.training.seed) == (5.0e-4, 7)
    with pytest.raises(ConfigError, match="defaults: unknown key"):  # the loader itself accepted it
        load_config(_write(tmp_path, text))


def test_equal_looking_keys_of_different_types_are_not_duplicates(tmp_path: Path) -> None:
    from mm_core.config.loader import read_yaml

    assert read_yaml(_write(tmp_path, "a:\n  1: x\n  '1': y\n")) == {"a": {1: "x", "1": "y"}}


def test_a_key_given_twice_in_an_override_value() -> None:
    with pytest.raises(ConfigError, match=r"override value '\{lr: 1, lr: 2\}': key lr is given twice"):
        parse_override("training={lr: 1, lr: 2}")


# ------------------------------------------------------------------------------------------ encoding
def test_non_utf8_config_names_the_file_line_and_byte_offset(
    write_config: Callable[..., Path], tmp_path: Path
) -> None:
    good = write_config().read_bytes()
    path = tmp_path / "latin1.yaml"
    bad = good + "# r\u00e9sum\u00e9\n".encode("latin-1")
    path.write_bytes(bad)
    offset = bad.index(b"\xe9")
    line = bad[:offset].count(b"\n") + 1
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert "Traceback" not in msg and "\n" not in msg
    assert msg.startswith(f"{path}:{line}: not valid UTF-8 at byte offset {offset} "), msg
    assert "save the file as UTF-8" in msg


def test_utf8_with_bom_is_fine(write_config: Callable[..., Path], tmp_path: Path) -> None:
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + write_config().read_bytes())
    assert load_config(path).training.train_iters == 2
