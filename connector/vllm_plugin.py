"""vLLM's plugin hook: puts CacheScoutConnector in vLLM's connector registry in every vLLM process.

vLLM loads a connector named with `kv_connector_module_path` without registering it, and beside
LMCache in `MultiConnector` that is not enough: `MultiConnector.build_kv_connector_stats` rebuilds
each child's stats (sent between processes as plain dicts) by looking the child's class up in the
registry by name, so the first stats report failed (under the OpenAI server: HTTP 500, then exit).
vLLM runs every `vllm.general_plugins` entry point in the API server, the engine core and each
worker before it builds configs or connectors; this package declares `register` as one
(pyproject.toml). The registry entry is lazy: vLLM imports the connector module only when it is used.
"""

from __future__ import annotations

CONNECTOR_NAME = "CacheScoutConnector"
LMCACHE_CPU_NAME = "LMCacheCpuConnector"   # LMCache alone on vLLM's CPU backend (lmcache_cpu.py)


def register() -> None:
    """Register CacheScoutConnector (and LMCacheCpuConnector) with vLLM's KVConnectorFactory; safe to
    call again."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:     # vLLM without connectors: nothing to register with
        return
    for name, module in ((CONNECTOR_NAME, "cachescout.connector.vllm_connector"),
                         (LMCACHE_CPU_NAME, "cachescout.connector.lmcache_cpu")):
        try:
            KVConnectorFactory.register_connector(name, module, name)
        except ValueError:  # already registered (plugins may run more than once per process)
            pass
