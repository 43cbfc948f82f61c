"""The connector's settings, read from vLLM's `kv_connector_extra_config`, validated at start-up.

    {"policy": {...PolicyConfig settings...}, "steer_gpu": true, "steer_ahead_blocks": 16, ...,
     "shared_state": {...SharedStateSettings, see shared_state.py...}}

An unknown key, a wrong type or a value out of range raises ConfigError naming the field and what
it accepts, before the engine serves anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from cachescout.policy import ConfigError, PolicyConfig, check_fields, check_mapping, reject_unknown, setting

from .shared_state import SharedStateSettings


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    policy: PolicyConfig = PolicyConfig()
    steer_gpu: bool = setting(True, "reorder vLLM's free queue by CacheScout's eviction order")
    steer_ahead_blocks: int = setting(16, "at least this many next victims are put at the queue's head",
                                      lo=1, hi=1_000_000)
    steer_ahead_factor: float = setting(
        1.5, "... or this many times the most blocks the next step can allocate", lo=0, hi=1_000_000)
    store_wait_ms: float = setting(
        50.0, "LMCache store path: wait this long for CPU-tier room before dropping", lo=0, hi=10_000)
    gpu_warmup_url: str | None = setting(
        None, "this server's address (http://127.0.0.1:8000): prefetch predicted anchors into the GPU cache "
              "with warm-up requests to it; off without it")
    gpu_warmup_timeout_s: float = setting(30.0, "a warm-up request's HTTP timeout", lo=0.1, hi=3600)
    lmcache_cpu_gib: float = setting(
        0.0, "LMCache's CPU tier beside this connector (its max_local_cpu_size, GiB): CacheScout follows what "
             "it holds and lets GPU blocks with a CPU copy go first (losing one costs a load, not a recompute); "
             "0: none", lo=0, hi=1e6)
    hold_queued: bool = setting(
        True, "with LMCache's CPU tier beside (lmcache_cpu_gib > 0): keep a queued request's prefix in that tier "
              "from its arrival to its admission (at most half the tier), so that the prompts stored while it "
              "waits do not push out what it will load")
    shared_state: SharedStateSettings | None = None   # learn with the other replicas through Redis

    def __post_init__(self) -> None:
        check_fields(self)
        if self.gpu_warmup_url is not None:
            _check_http_url(self.gpu_warmup_url, "kv_connector_extra_config.gpu_warmup_url")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, *, block_size: int | None = None,
                          check_environment: bool = True) -> ConnectorSettings:
        """`block_size`: vLLM's; the policy takes it (a different `policy.block_size` is an error).
        `check_environment`: see SharedStateSettings.from_mapping."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigError(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
        extra = dict(extra or {})
        reject_unknown(extra, {f.name for f in dataclasses.fields(cls)}, "kv_connector_extra_config: unknown key(s)")
        policy = extra.pop("policy", None)
        policy = {} if policy is None else policy
        if not isinstance(policy, Mapping):
            raise ConfigError(f"kv_connector_extra_config.policy must be a JSON object, got {type(policy).__name__}")
        policy = dict(policy)
        if block_size is not None:
            if policy.get("block_size", block_size) != block_size:
                raise ConfigError(f"kv_connector_extra_config.policy.block_size is {policy['block_size']!r} but "
                                  f"vLLM's block_size is {block_size}; leave it out (it is taken from vLLM)")
            policy["block_size"] = block_size
        try:
            policy_cfg = PolicyConfig.from_mapping(policy)
        except ConfigError as exc:
            raise ConfigError(f"kv_connector_extra_config.policy: {exc}") from None
        check_mapping(cls, extra, "kv_connector_extra_config")
        shared = extra.pop("shared_state", None)
        if shared is not None:
            shared = SharedStateSettings.from_mapping(shared, "kv_connector_extra_config.shared_state",
                                                      check_environment=check_environment)
        return cls(policy=policy_cfg, shared_state=shared, **extra)


def _check_http_url(url: str, where: str) -> None:
    """ConfigError unless `url` is http(s)://host[:port] with a valid port (and no path but /)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"{where} must start with http:// or https://, got {url[:40]!r}")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise ConfigError(f"{where} has an invalid port (an integer in 1..65535): {parts.netloc!r:.80}")
    if not parts.hostname:
        raise ConfigError(f"{where} names no host: {url[:40]!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{where} is the server's address only (e.g. http://127.0.0.1:8000), got {url[:80]!r}")
