"""`cachescout config`: what it prints is what vLLM and LMCache accept."""

import json
import subprocess
import sys

import pytest

from cachescout.cli.main import main


def _readable_json(text: str) -> dict:
    start = text.index("# kv_transfer_config, readable:\n") + len("# kv_transfer_config, readable:\n")
    return json.JSONDecoder().raw_decode(text[start:])[0]


def test_gpu_only_is_the_connector_alone(capsys):
    assert main(["config", "--settings", '{"steer_ahead_blocks": 32}']) == 0
    kvt = _readable_json(capsys.readouterr().out)
    assert kvt["kv_connector"] == "CacheScoutConnector"
    assert kvt["kv_connector_module_path"] == "cachescout.connector"
    assert kvt["kv_connector_extra_config"] == {"steer_ahead_blocks": 32}


def test_tiers_yaml_loads_with_lmcache(tmp_path, capsys):
    assert main(["config", "--cpu-gib", "4", "--redis-url", "redis://kv:6379", "--chunk-size", "128",
                 "--lmcache-file", str(tmp_path / "lm.yaml")]) == 0
    out = capsys.readouterr().out
    kvt = _readable_json(out)
    names = [c["kv_connector"] for c in kvt["kv_connector_extra_config"]["connectors"]]
    assert kvt["kv_connector"] == "MultiConnector" and names == ["CacheScoutConnector", "LMCacheConnectorV1"]
    # CacheScout is told the CPU tier's size, to follow what it holds.
    assert kvt["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"] == {"lmcache_cpu_gib": 4.0}
    yaml_text = out[out.index("chunk_size:"):]
    (tmp_path / "lm.yaml").write_text(yaml_text)
    from lmcache.v1.config import LMCacheEngineConfig
    cfg = LMCacheEngineConfig.from_file(str(tmp_path / "lm.yaml"))
    assert cfg.chunk_size == 128 and cfg.local_cpu and cfg.max_local_cpu_size == 4
    assert cfg.remote_storage_plugins == ["redis"] and cfg.cache_policy == "cachescout"
    assert cfg.extra_config["remote_storage_plugin.redis.redis_url"] == "redis://kv:6379"


@pytest.mark.parametrize("args, needle", [
    (["--settings", '{"steer_gpux": 1}'], "steer_gpux"),
    (["--settings", "{not json"], "--settings is not JSON"),
    (["--cpu-gib", "2", "--chunk-size", "100"], "chunk_size must be one of"),
    (["--redis-url", "http://kv:6379"], "redis_url must look like"),
    (["--redis-url", "redis://user:secret@kv:6379"], "must not carry a password"),
])
def test_bad_values_fail_naming_the_field(args, needle, capsys):
    assert main(["config", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "secret" not in err


def test_vllm_builds_the_printed_multiconnector(tmp_path):
    """vLLM's scheduler accepts the printed configuration with LMCache's real connector beside
    ours, and CacheScout's steering is bound to the scheduler's own block pool."""
    (tmp_path / "lm.yaml").write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 1\n")
    code = """
import json, sys
from cachescout.bench import vllm_replay
from cachescout.connector.deploy_config import kv_transfer_config
from vllm.config import KVTransferConfig
kvt = kv_transfer_config({"steer_ahead_blocks": 8}, lmcache=True)
vllm_replay.KVTransferConfig = lambda **_: KVTransferConfig(**kvt)
sched = vllm_replay.build_scheduler(256, connector={})
ours, lm = sched.connector._connectors
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
reg = CollectorRegistry()
bind = lambda cls: (lambda *a, **k: cls(*a, registry=reg, **{x: y for x, y in k.items() if x != "multiprocess_mode"}))
types = {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}
prom = type(sched.connector).build_prom_metrics(sched.connector._vllm_config, types, ["engine"], {0: ["0"]})
print(json.dumps([type(sched.connector).__name__, type(ours).__name__, type(lm).__name__,
                  ours.steering.pool is sched.kv_cache_manager.block_pool, ours.settings.steer_ahead_blocks,
                  type(prom._prom_metrics.get("CacheScoutConnector")).__name__]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**__import__("os").environ, "LMCACHE_CONFIG_FILE": str(tmp_path / "lm.yaml"),
                               "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == ["MultiConnector", "CacheScoutConnector", "LMCacheConnectorV1", True, 8, "CacheScoutPromMetrics"]
