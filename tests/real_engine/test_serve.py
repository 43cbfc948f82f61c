"""Real vLLM servers (vLLM's CPU build, a tiny random Llama, real forward passes), each configuration
`cachescout bench --engine serve` runs, the same calls through the OpenAI API: identical greedy
outputs, CacheScout steering and counting, LMCache storing and loading, a server that survives its
stats reports with LMCache beside CacheScout. One run of the harness in its own process, with a
hard timeout (LMCache's threads can keep an interpreter alive)."""

import json
import subprocess
import sys

import pytest

from cachescout.bench.serve import CONFIGS, parse_metrics


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve")
    cmd = [sys.executable, "-m", "cachescout.cli.main", "bench", "--engine", "serve", "--workloads", "gsm8k",
           "--sessions", "12", "--serve-max-output", "16", "--json", str(out / "serve.json"),
           "--plots", str(out / "serve.png"), "--serve-logs", str(out / "logs"), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)   # 4 servers: 1-2 min each
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "serve.png").stat().st_size > 0
    data = json.loads((out / "serve.json").read_text())
    data["logs"] = {c: (out / "logs" / f"server-{c}.log").read_text(errors="replace") for c in CONFIGS}
    return data


def _results(report):
    (workload,) = report["workloads"]
    return {r["config"]: r for r in workload["results"]}, workload


def test_every_configuration_served_every_call_with_identical_greedy_outputs(report):
    results, workload = _results(report)
    assert sorted(results) == sorted(CONFIGS)
    assert workload["outputs_identical"] and not workload["output_differences"]
    for r in results.values():
        assert r["calls"] == workload["calls"] > 50
        assert r["output_tokens"] > 0 and 0 < r["ttft_mean_ms"] <= r["ttft_p99_ms"]


def test_prefix_hits_are_real_and_cachescout_steered_vllms_cache(report):
    results, _ = _results(report)
    for r in results.values():
        assert 0.2 < r["gpu_hit_rate"] < 1.0           # a shared anchor is hit; the cache is under pressure
    for config in ("cachescout", "cachescout-lmcache"):
        ours = results[config]["cachescout"]           # the vllm:cachescout_* series of /metrics
        assert ours["requests"] == results[config]["calls"]
        assert ours["steered_blocks"] > 0 and ours["evictions_seen"] > 0
        # The guard compared the real cache with its shadow LRU, and says so to operators.
        assert ours["guard_compared"] > 0
        for key in ("guard_hits", "guard_lru_hits"):
            assert 0 <= ours[key] <= ours["guard_compared"]
    assert results["prefix"]["cachescout"] == {} and results["lmcache"]["cachescout"] == {}


def test_lmcache_stored_and_loaded_through_the_cpu_kv_adapter(report):
    results, _ = _results(report)
    for config in ("lmcache", "cachescout-lmcache"):
        log = report["logs"][config]
        assert "No supported cpu connector" not in log
        assert "Stored " in log and "Retrieved " in log
        assert results[config]["external_hit_rate"] > 0.0
    assert results["cachescout-lmcache"]["cachescout"]["cpu_evictions"] >= 0
    # Beside LMCache in MultiConnector, CacheScout's stats were rebuilt from the registry every report.
    assert "is not registered" not in report["logs"]["cachescout-lmcache"]


def test_parse_metrics_sums_labels_and_drops_histograms():
    text = ('vllm:prefix_cache_hits_total{engine="0",model_name="m"} 12.0\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 3.0\n'
            'vllm:time_to_first_token_seconds_bucket{le="0.1"} 4.0\n'
            '# HELP vllm:cachescout_requests_total requests\n'
            'vllm:cachescout_requests_total{engine="0"} 7.0\n')
    got = parse_metrics(text)
    assert got["vllm:prefix_cache_hits"] == 15.0 and got["vllm:cachescout_requests"] == 7.0
    assert not any(k.endswith("_bucket") for k in got)
