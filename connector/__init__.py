"""CacheScout inside vLLM: the KV connector named in `kv_transfer_config`.

    {"kv_connector": "CacheScoutConnector", "kv_connector_module_path": "cachescout.connector",
     "kv_role": "kv_both", "kv_connector_extra_config": {...}}

`CacheScoutConnector` (vllm_connector.py) is imported on first use, so importing this package (for
`ConnectorSettings`, or the vLLM-free `GpuSteering`) does not import vLLM.
"""

from __future__ import annotations

from typing import Any

from cachescout.policy import compiled_first

compiled_first(__path__)  # noqa: F821: the GPU steering runs compiled when the policy core does

from .settings import ConnectorSettings

__all__ = ["CacheScoutConnector", "ConnectorSettings", "GpuSteering"]


def __getattr__(name: str) -> Any:
    if name in ("CacheScoutConnector", "CacheScoutStats"):
        from . import vllm_connector
        return getattr(vllm_connector, name)
    if name == "GpuSteering":
        from .gpu_steering import GpuSteering
        return GpuSteering
    raise AttributeError(f"module 'cachescout.connector' has no attribute {name!r}")
