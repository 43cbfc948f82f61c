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

from cachescout.policy import ConfigError, PolicyConfig
from cachescout.policy import check_value

from .shared_state import SharedStateSettings


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    policy: PolicyConfig = PolicyConfig()
    steer_gpu: bool = True            # reorder vLLM's free queue by CacheScout's eviction order
    steer_ahead_blocks: int = 16      # at least this many next victims are put at the queue's head
    steer_ahead_factor: float = 1.5   # ... or this many times the most blocks the next step can allocate
    store_wait_ms: float = 50.0       # LMCache store path: wait this long for CPU-tier room before dropping
    shared_state: SharedStateSettings | None = None   # learn with the other replicas through Redis

    _LIMITS = {"steer_gpu": ("bool", None, None), "steer_ahead_blocks": ("int", 1, 1_000_000),
               "steer_ahead_factor": ("float", 0, 1_000_000), "store_wait_ms": ("float", 0, 10_000)}

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, *, block_size: int | None = None,
                          check_environment: bool = True) -> ConnectorSettings:
        """`block_size`: vLLM's; the policy takes it (a different `policy.block_size` is an error).
        `check_environment`: see SharedStateSettings.from_mapping."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigError(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
        extra = dict(extra or {})
        known = {"policy", "steer_gpu", "steer_ahead_blocks", "steer_ahead_factor", "store_wait_ms", "shared_state"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                              f"accepted: {', '.join(sorted(known))}")
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
        for name, (kind, lo, hi) in cls._LIMITS.items():
            if name in extra:
                check_value(f"kv_connector_extra_config.{name}", extra[name], kind, lo, hi)
        shared = extra.pop("shared_state", None)
        if shared is not None:
            shared = SharedStateSettings.from_mapping(shared, "kv_connector_extra_config.shared_state",
                                                      check_environment=check_environment)
        return cls(policy=policy_cfg, shared_state=shared, **extra)
