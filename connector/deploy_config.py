"""What a user writes to turn CacheScout on: vLLM's `--kv-transfer-config` JSON and, with lower
tiers, LMCache's YAML. `cachescout config` prints them; every value is validated first.

Without lower tiers the connector is CacheScoutConnector alone (it steers GPU eviction). With a
CPU tier or Redis, vLLM's own MultiConnector runs CacheScoutConnector first and LMCache's
connector second: CacheScout orders the GPU prefix cache, LMCache moves KV between GPU, CPU and
Redis, each through its own unmodified connector.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from cachescout.policy import ConfigError

from .settings import ConnectorSettings

LMCACHE_CHUNK_SIZES = (64, 128, 256, 512)
POLICY_NAME = "cachescout"   # LMCache's CPU-tier policy (lmcache_tier.py; the same name)


def connector_entry(extra: Mapping[str, Any]) -> dict:
    # Fails here, naming the field, if anything is off (secrets and files are the pod's, not here).
    ConnectorSettings.from_extra_config(extra, check_environment=False)
    return {"kv_connector": "CacheScoutConnector", "kv_connector_module_path": "cachescout.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": dict(extra)}


def kv_transfer_config(extra: Mapping[str, Any], *, lmcache: bool, cpu_gib: float = 0.0) -> dict:
    """`cpu_gib`: LMCache's CPU tier, also told to CacheScout (`lmcache_cpu_gib`) unless `extra` sets it."""
    if lmcache and cpu_gib > 0 and "lmcache_cpu_gib" not in extra:
        extra = {**extra, "lmcache_cpu_gib": cpu_gib}
    entry = connector_entry(extra)
    if not lmcache:
        return entry
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [
                entry, {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}]}}


def lmcache_yaml(*, cpu_gib: float, redis_url: str | None, chunk_size: int = 256) -> str:
    """LMCache's config file (LMCACHE_CONFIG_FILE) for a CPU tier of `cpu_gib` and optional Redis."""
    if not (isinstance(cpu_gib, (int, float)) and math.isfinite(cpu_gib) and cpu_gib >= 0):
        raise ConfigError(f"cpu_gib must be a number >= 0, got {cpu_gib!r}")
    if chunk_size not in LMCACHE_CHUNK_SIZES:
        raise ConfigError(f"chunk_size must be one of {', '.join(map(str, LMCACHE_CHUNK_SIZES))}, got {chunk_size!r}")
    lines = [f"chunk_size: {chunk_size}",
             f"local_cpu: {'true' if cpu_gib > 0 else 'false'}",
             f"max_local_cpu_size: {float(cpu_gib):g}",
             f"cache_policy: {POLICY_NAME}   # registered by CacheScoutConnector's worker side"]
    if redis_url:
        u = urlparse(redis_url)
        if u.scheme not in ("redis", "rediss") or not u.hostname:
            raise ConfigError(f"redis_url must look like redis://HOST:PORT or rediss://HOST:PORT, got {redis_url!r}")
        if u.password:
            raise ConfigError("redis_url must not carry a password: give it to LMCache through its environment")
        lines += ["remote_storage_plugins: [\"redis\"]",
                  "extra_config:",
                  f"  remote_storage_plugin.redis.redis_url: {json.dumps(redis_url)}"]
    return "\n".join(lines) + "\n"
