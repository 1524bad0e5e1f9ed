import pytest

from mm_core.data.params import BASIC, optional_positive_int, positive_int, read_params, string
from mm_core.errors import ConfigError

FIELDS = {"seq_len": positive_int(), "text_key": string("text"), "pad": optional_positive_int()}


def test_defaults_and_values():
    assert read_params({"seq_len": 8}, FIELDS, BASIC) == {"seq_len": 8, "text_key": "text", "pad": None}


def test_unknown_key_did_you_mean():
    with pytest.raises(ConfigError) as e:
        read_params({"seq_len": 8, "text_kye": "x"}, FIELDS, BASIC)
    msg = str(e.value)
    assert msg.startswith(
        "data.dataset_param.basic_parameters.text_kye: unknown key; did you mean 'text_key'?"
    )
    assert "accepted keys: pad, seq_len, text_key" in msg


def test_missing_and_bad_values():
    with pytest.raises(
        ConfigError,
        match=r"^data\.dataset_param\.basic_parameters\.seq_len: missing; "
        r"expected a positive integer$",
    ):
        read_params({}, FIELDS, BASIC)
    for bad in (0, -3, True, "8", 2.0):
        with pytest.raises(
            ConfigError, match=r"basic_parameters\.seq_len: got .*; expected a positive integer"
        ):
            read_params({"seq_len": bad}, FIELDS, BASIC)
    with pytest.raises(ConfigError, match="expected a mapping"):
        read_params([1], FIELDS, BASIC)
