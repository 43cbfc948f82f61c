"""The connector's settings (kv_connector_extra_config): accepted values and start-up errors."""

import pytest

from cachescout.connector import ConnectorSettings
from cachescout.policy import ConfigError


def test_defaults_take_vllm_block_size():
    s = ConnectorSettings.from_extra_config(None, block_size=32)
    assert s.policy.block_size == 32
    assert s.steer_gpu is True
    assert s.steer_ahead_blocks == 16


def test_values_are_read():
    s = ConnectorSettings.from_extra_config(
        {"steer_gpu": False, "steer_ahead_blocks": 8, "steer_ahead_factor": 0.5, "store_wait_ms": 0,
         "policy": {"max_agents": 100}}, block_size=16)
    assert (s.steer_gpu, s.steer_ahead_blocks, s.steer_ahead_factor, s.store_wait_ms) == (False, 8, 0.5, 0)
    assert s.policy.max_agents == 100


@pytest.mark.parametrize("extra, field", [
    ({"steer_gpux": True}, "steer_gpux"),                      # unknown key
    ({"steer_gpu": "yes"}, "steer_gpu"),                       # wrong type
    ({"steer_ahead_blocks": -4}, "steer_ahead_blocks"),        # negative size
    ({"steer_ahead_blocks": 2.5}, "steer_ahead_blocks"),       # not an integer
    ({"steer_ahead_factor": float("nan")}, "steer_ahead_factor"),
    ({"store_wait_ms": -1}, "store_wait_ms"),                  # negative wait
    ({"store_wait_ms": "50"}, "store_wait_ms"),
    ({"lmcache_cpu_gib": -1}, "lmcache_cpu_gib"),
    ({"lmcache_cpu_gib": "20GiB"}, "lmcache_cpu_gib"),
    ({"hold_queued": "yes"}, "hold_queued"),
    ({"policy": {"no_such_setting": 1}}, "no_such_setting"),   # unknown policy setting
    ({"policy": {"block_size": 64}}, "block_size"),            # disagrees with vLLM's
    ({"policy": []}, "policy"),
    ({"store_wait_ms": 10**400}, "store_wait_ms"),             # an integer beyond any float
    ({"steer_ahead_factor": 10**400}, "steer_ahead_factor"),
    ({"steer_ahead_blocks": None}, "steer_ahead_blocks"),
    ({"policy": {"transition_half_life": 10**400}}, "transition_half_life"),
    ({"shared_state": {"url": "redis://h", "flush_interval_s": 10**400}}, "flush_interval_s"),
])
def test_bad_values_name_the_field(extra, field):
    with pytest.raises(ConfigError, match=field):
        ConnectorSettings.from_extra_config(extra, block_size=16)


def test_unknown_key_lists_accepted_ones():
    with pytest.raises(ConfigError) as err:
        ConnectorSettings.from_extra_config({"bogus": 1}, block_size=16)
    assert "steer_ahead_blocks" in str(err.value)


def test_not_a_mapping():
    with pytest.raises(ConfigError, match="JSON object"):
        ConnectorSettings.from_extra_config([("steer_gpu", True)], block_size=16)


def test_usage_doc_lists_every_setting_with_its_default():
    import dataclasses
    import pathlib

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "usage.md").read_text()
    for f in dataclasses.fields(ConnectorSettings):
        if f.name in ("policy", "shared_state"):
            continue
        if f.default is None:
            default = "none"
        else:
            default = str(f.default).lower() if isinstance(f.default, bool) else f"{f.default:g}"
        assert f"| `{f.name}` | " in doc, f.name
        row = doc.split(f"| `{f.name}` | ", 1)[1].split("\n", 1)[0]
        assert default in row.split("|")[0], (f.name, default, row)


def test_shared_state_doc_lists_every_setting_with_its_default():
    import dataclasses
    import pathlib

    from cachescout.connector.shared_state import SharedStateSettings

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "shared_state.md").read_text()
    for f in dataclasses.fields(SharedStateSettings):
        key = f"`shared_state.{f.name}`"
        assert key in doc, f.name
        row = doc.split(key, 1)[1].split("\n", 1)[0]
        if f.default is None or f.name in ("model", "replica"):
            continue
        if isinstance(f.default, bool):
            want = str(f.default).lower()
        elif isinstance(f.default, tuple):
            want = "[]"
        elif isinstance(f.default, str):
            want = f.default
        else:
            want = f"{f.default:,g}" if f.default < 1e5 else f"{int(f.default):,}"
        assert want in row.split("|")[1], (f.name, want, row)


def test_settings_built_directly_are_checked_like_raw_input():
    """One mechanism: constructing a settings object checks it as reading it from JSON does."""
    from cachescout.connector.shared_state import SharedStateSettings

    with pytest.raises(ConfigError, match="'steer_ahead_blocks' must be an integer >= 1"):
        ConnectorSettings(steer_ahead_blocks=0)
    with pytest.raises(ConfigError, match="'timeout_s' must be a finite number >= 0.01 and <= 10"):
        SharedStateSettings(url="redis://127.0.0.1:6379/0", timeout_s=100.0)
    with pytest.raises(ConfigError, match="'deployment' must be a non-empty string"):
        SharedStateSettings(url="redis://127.0.0.1:6379/0", deployment="")
    with pytest.raises(ConfigError, match="'kv_connector_extra_config.shared_state.timeout_s'"):
        ConnectorSettings.from_extra_config({"shared_state": {"url": "redis://127.0.0.1:6379/0", "timeout_s": 100}},
                                            block_size=16, check_environment=False)


def test_a_warm_up_address_is_parsed_at_start_up():
    s = ConnectorSettings.from_extra_config({"gpu_warmup_url": "http://127.0.0.1:8000", "gpu_warmup_timeout_s": 5})
    assert (s.gpu_warmup_url, s.gpu_warmup_timeout_s) == ("http://127.0.0.1:8000", 5)
    assert ConnectorSettings.from_extra_config({}).gpu_warmup_url is None
    for bad in ("http://127.0.0.1:abc", "redis://h:1", 8000):
        with pytest.raises(ConfigError, match="gpu_warmup_url"):
            ConnectorSettings.from_extra_config({"gpu_warmup_url": bad})
    with pytest.raises(ConfigError, match="gpu_warmup_timeout_s"):
        ConnectorSettings.from_extra_config({"gpu_warmup_timeout_s": 0})
