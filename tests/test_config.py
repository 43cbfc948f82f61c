import math

import pytest

from cachescout.policy import ConfigError, PolicyConfig


def test_defaults_are_valid_and_documented():
    cfg = PolicyConfig()
    assert cfg.block_size == 16
    for name, kind, _, doc in PolicyConfig.describe():
        assert doc and kind in {"int", "float", "bool"}, name


@pytest.mark.parametrize("field,value,needle", [
    ("block_size", 0, "'block_size' must be an integer >= 1"),
    ("transition_half_life", -3.0, "'transition_half_life' must be a finite number > 0"),
    ("transition_half_life", 10**400, "'transition_half_life' must be a finite number > 0 and <= 1e+12"),
    ("session_idle_timeout_s", 10**20, "'session_idle_timeout_s'"),
    ("prefetch_max_inflight_bytes", 10**400, "'prefetch_max_inflight_bytes'"),
    ("transition_half_life", math.nan, "'transition_half_life'"),
    ("prefetch_min_probability", 1.5, "<= 1"),
    ("min_confidence", math.inf, "'min_confidence'"),
    ("block_size", 16.0, "must be an integer"),
    ("block_size", True, "must be an integer"),
    ("kv_bytes_per_token", "131072", "got '131072' (str)"),
])
def test_bad_values_fail_naming_field_and_accepted_values(field, value, needle):
    with pytest.raises(ConfigError) as err:
        PolicyConfig(**{field: value})
    assert needle in str(err.value)
    assert field in str(err.value)


def test_unknown_key_lists_accepted_names():
    with pytest.raises(ConfigError) as err:
        PolicyConfig.from_mapping({"block_size": 16, "half_life": 10})
    msg = str(err.value)
    assert "'half_life'" in msg and "transition_half_life" in msg and "block_size" in msg


def test_from_mapping_round_trip_and_type_of_mapping():
    cfg = PolicyConfig.from_mapping({"block_size": 32, "prediction_horizon": 3})
    assert (cfg.block_size, cfg.prediction_horizon) == (32, 3)
    with pytest.raises(ConfigError, match="mapping"):
        PolicyConfig.from_mapping([("block_size", 32)])


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        PolicyConfig(max_agents=1)


def test_docs_list_every_setting_with_its_default():
    import pathlib
    doc = (pathlib.Path(__file__).parent.parent / "docs" / "policy.md").read_text()
    for name, _, default, _ in PolicyConfig.describe():
        assert f"| `{name}` |" in doc and f"| {default!r} |" in doc.split(f"| `{name}` |")[1].split("\n")[0], name
