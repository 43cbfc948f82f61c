import json

import pytest

from cachescout.cli.main import main


def test_bench_writes_results_and_plots(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["bench", "--workloads", "gaia", "--sessions", "30", "--gpu-blocks", "1500", "--jobs", "1",
               "--policies", "lru,cachescout,belady", "--json", str(out), "--plots", str(png), "--quiet"])
    assert rc == 0
    report = json.loads(out.read_text())
    (workload,) = report["workloads"]
    assert workload["workload"] == "gaia" and workload["gpu_blocks"] == 1500
    for r in workload["results"]:
        for key in ("policy", "token_hit_rate", "gpu_token_hit_rate", "prefill_tokens", "ttft_mean_ms",
                    "ttft_p99_ms", "throughput_at_saturation_calls_per_s"):
            assert key in r, key
    assert set(workload["cache_sweep"]) == {"lru", "cachescout", "belady"}
    assert png.stat().st_size > 10_000
    assert "gaia: 30 sessions" in capsys.readouterr().out


def test_fresh_process_replays_each_workload_in_a_new_interpreter(tmp_path, monkeypatch):
    """--fresh-process: every workload runs in a spawned interpreter (so a CPU-time figure does not
    carry this process's heap): a change made to this process cannot reach the replays."""
    import cachescout.bench.run as bench_run

    def poisoned(*args, **kwargs):
        raise AssertionError("generated in the parent process")

    monkeypatch.setattr(bench_run, "generate", poisoned)
    args = ["bench", "--workloads", "gsm8k,gaia", "--sessions", "12", "--gpu-blocks", "900", "--policies", "lru",
            "--no-sweeps", "--quiet", "--json"]
    with pytest.raises(AssertionError, match="parent process"):
        main(args + [str(tmp_path / "in.json"), "--jobs", "1"])
    assert main(args + [str(tmp_path / "fresh.json"), "--fresh-process"]) == 0
    report = json.loads((tmp_path / "fresh.json").read_text())
    assert [w["workload"] for w in report["workloads"]] == ["gsm8k", "gaia"]
    assert all(w["results"][0]["token_hit_rate"] > 0 for w in report["workloads"])


def test_a_fresh_process_on_another_build_is_refused(tmp_path, monkeypatch, capsys):
    # A source edited while a report runs sends later fresh processes to the pure-Python sources:
    # their timings would not compare with the others', so the run stops instead.
    import cachescout.bench.run as bench_run

    monkeypatch.setattr(bench_run, "NATIVE_STATUS", "the build this process started with")
    rc = main(["bench", "--workloads", "gsm8k", "--sessions", "12", "--gpu-blocks", "900", "--policies", "lru",
               "--no-sweeps", "--quiet", "--fresh-process", "--json", str(tmp_path / "r.json")])
    assert rc == 1
    assert "would use another build" in capsys.readouterr().err


@pytest.mark.parametrize("args,needle", [
    (["--policies", "lru,oracle"], "unknown policy 'oracle'"),
    (["--workloads", "chat"], "unknown workload 'chat'"),
    (["--routing", "zigzag"], "argument --routing: invalid choice"),
    (["--cost-profile", "a100"], "unknown cost profile 'a100'"),
    (["--cpu-blocks", "-1"], "--cpu-blocks"),
    (["--trace", "/nonexistent/t.jsonl"], "no such file or folder"),
    (["--engine", "vllm", "--policies", "lru,belady"], "--engine vllm runs lru and cachescout"),
    (["--engine", "vllm", "--cpu-blocks", "100", "--policies", "lru"],
     "--engine vllm with CPU/Redis tiers runs lmcache-lru and cachescout"),
    (["--engine", "serve", "--serve-configs", "prefix,bogus"], "--serve-configs: unknown bogus"),
    (["--engine", "serve", "--serve-target", "1.5"], "--serve-target: '1.5' is not a finite number > 0"),
    (["--cpu-ratio", "inf"], "--cpu-ratio: 'inf' is not a finite number"),
    (["--engine", "vllm", "--timings", "3"], "--timings 3: only the fast replay"),
    (["--timings", "-1"], "--timings"),
    (["--rate", "nan"], "--rate: 'nan' is not a finite number"),
    (["--sessions", "1e400"], "--sessions: '1e400' is not an integer"),
    (["--gpu-blocks", "9" * 40], "--gpu-blocks"),
    (["--engine", "serve", "--serve-model", "/nonexistent"], "not a model folder"),
])
def test_bad_arguments_fail_with_one_line(args, needle, capsys):
    assert main(["bench", "--quiet", "--no-sweeps", *args]) in (1, 2)
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_engine_serve_without_a_device_says_where_to_run_it(capsys):
    """This environment's vLLM is the CUDA build, and there is no GPU here: refused before any
    server starts, with where to run it instead."""
    from vllm.platforms import current_platform
    if current_platform.device_type:
        pytest.skip(f"this vLLM serves on {current_platform.device_type} here")
    assert main(["bench", "--quiet", "--engine", "serve", "--serve-configs", "prefix"]) == 2
    err = capsys.readouterr().err.strip()
    assert "real-engine environment" in err and "\n" not in err


def test_engine_vllm_compares_both_engines(tmp_path, capsys):
    out = tmp_path / "e.json"
    rc = main(["bench", "--engine", "vllm", "--workloads", "gaia", "--sessions", "12", "--gpu-blocks", "1200",
               "--jobs", "1", "--json", str(out), "--quiet"])
    assert rc == 0
    (workload,) = json.loads(out.read_text())["workloads"]
    assert workload["engine"] == "vllm" and workload["gpu_blocks"] == 1200
    lru, ours = workload["results"]
    assert (lru["policy"], ours["policy"]) == ("lru", "cachescout")
    for r in (lru, ours):
        assert r["calls"] == workload["calls"]
        assert r["engine_difference"] == pytest.approx(r["gpu_token_hit_rate"] - r["fast_gpu_token_hit_rate"])
    assert ours["connector_us_per_step"] > 0 and 0 < ours["connector_step_overhead"] < 1
    assert ours["connector"]["requests"] == workload["calls"]
    assert "on vLLM" in capsys.readouterr().out


def test_help_does_not_import_vllm():
    import subprocess
    import sys
    code = "import sys; from cachescout.cli.main import main\ntry: main(['--help'])\nexcept SystemExit: pass\n" \
           "print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False False")


def test_state_show_export_and_reset(redis_server, tmp_path, capsys):
    import json

    from test_shared_state import learn, make, sync

    a, b = make(redis_server.url, "replica-a"), make(redis_server.url, "replica-b")
    learn(a[0], [("supervisor", "coder")], 6)
    learn(b[0], [("supervisor", "searcher")], 2)
    sync(a, b)
    where = ["--url", redis_server.url, "--deployment", "test", "--model", "m"]
    assert main(["state", "show", *where]) == 0
    out = capsys.readouterr().out
    assert "replica-a" in out and "replica-b" in out
    assert "supervisor -> coder 0.75 (6.0), searcher 0.25 (2.0)" in out
    assert main(["state", "export", *where, "--out", str(tmp_path / "s.json")]) == 0
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["merged"]["supervisor"]["coder"] == {"p": 0.75, "count": 6.0}
    assert {e["name"] for e in data["entries"]} == {"replica-a", "replica-b"}
    assert main(["state", "reset", *where]) == 2          # asks for --yes, changes nothing
    assert "add --yes" in capsys.readouterr().out
    assert main(["state", "export", *where]) == 0
    assert json.loads(capsys.readouterr().out)["merged"]
    assert main(["state", "reset", *where, "--yes"]) == 0
    capsys.readouterr()
    assert main(["state", "export", *where]) == 0
    assert json.loads(capsys.readouterr().out)["merged"] == {}


def test_state_errors_are_one_line(capsys):
    assert main(["state", "show", "--url", "http://h", "--model", "m"]) == 2
    assert "url must start with redis://" in capsys.readouterr().err
    assert main(["state", "show", "--url", "redis://127.0.0.1:1", "--model", "m",
                 "--shared-state", '{"timeout_s": 0.1}']) == 1
    err = capsys.readouterr().err
    assert err.startswith("cachescout state: error: Redis at redis://127.0.0.1:1") and err.count("\n") == 1


def test_config_with_shared_state_does_not_need_the_pods_secrets(capsys, monkeypatch):
    monkeypatch.delenv("CS_NOT_HERE", raising=False)
    settings = json.dumps({"shared_state": {"url": "redis://state:6379", "password_env": "CS_NOT_HERE",
                                            "tls_ca_file": "/ca.crt"}})
    assert main(["config", "--settings", settings]) == 0
    out = capsys.readouterr().out
    assert '"password_env": "CS_NOT_HERE"' in out
    assert main(["config", "--settings", '{"shared_state": {"url": "http://state"}}']) == 2
    assert "shared_state.url" in capsys.readouterr().err


@pytest.mark.parametrize("args,needle", [
    (["--settings", "null"], "--settings must be a JSON object"),
    (["--settings", "[1]"], "--settings must be a JSON object"),
    (["--settings", '{"store_wait_ms": 1e400}'], "store_wait_ms"),
    (["--settings", '{"policy": {"max_agents": 1e400}}'], "max_agents"),
    (["--cpu-gib", "nan"], "--cpu-gib: 'nan' is not a finite number"),
    (["--chunk-size", "0"], "--chunk-size"),
])
def test_config_refuses_bad_values_in_one_line(args, needle, capsys):
    assert main(["config", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_config_with_a_state_store(capsys):
    assert main(["config", "--state-url", "rediss://state:6379/0", "--deployment", "prod"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("PYTHONHASHSEED=0 vllm serve"))
    kvt = json.loads(line.split("--kv-transfer-config ", 1)[1].strip("'"))
    assert kvt["kv_connector_extra_config"]["shared_state"] == {
        "url": "rediss://state:6379/0", "password_env": "CACHESCOUT_STATE_PASSWORD", "deployment": "prod"}
    assert main(["config", "--deployment", "prod"]) == 2
    assert "--deployment goes with --state-url" in capsys.readouterr().err
    assert main(["config", "--state-url", "http://state"]) == 2
    assert "shared_state.url" in capsys.readouterr().err


def test_config_with_gpu_warmups_points_them_at_the_server_it_starts(capsys):
    assert main(["config", "--gpu-warmup", "--port", "8123", "--cpu-gib", "4"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "vllm serve" in x and not x.startswith("#"))
    assert " --port 8123 --scheduling-policy priority --kv-transfer-config " in line
    kvt = json.loads(line.split("--kv-transfer-config ", 1)[1].strip("'"))
    ours = kvt["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]
    assert ours["gpu_warmup_url"] == "http://127.0.0.1:8123"
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "gpu_warmup_url" not in out and "--scheduling-policy" not in out and "--port" not in out
    assert main(["config", "--gpu-warmup", "--settings", '{"gpu_warmup_url": "http://127.0.0.1:1"}']) == 2
    assert "gpu_warmup_url either in --settings or with --gpu-warmup" in capsys.readouterr().err
    assert main(["config", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err


def test_a_reader_that_goes_away_is_not_an_error():
    import subprocess
    import sys
    # `true` reads nothing and is gone before the command writes: every write meets a closed pipe.
    out = subprocess.run(f"set -o pipefail; {sys.executable} -m cachescout.cli.main config --cpu-gib 2 | true",
                         shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr[-500:]


def test_a_defect_shows_its_traceback_not_a_one_liner(monkeypatch):
    # Only errors CacheScout raises on purpose become one line; a plain ValueError is a bug.
    import cachescout.bench.command as command

    def broken(args):
        raise ValueError("an internal defect")
    monkeypatch.setattr(command, "run", broken)
    with pytest.raises(ValueError, match="an internal defect"):
        main(["bench", "--quiet"])


def test_bench_without_the_benchmark_installed_says_so(monkeypatch, capsys):
    # The serving image carries the operator commands only.
    import sys
    monkeypatch.setitem(sys.modules, "cachescout.bench.command", None)   # an import of it fails
    assert main(["bench", "--help"]) == 1
    err = capsys.readouterr().err
    assert "the benchmark is not installed" in err and err.count("\n") == 1
    assert main(["config", "--cpu-gib", "1"]) == 0


def _settings_classes(model_dir):
    from cachescout.bench.run import BenchOptions
    from cachescout.bench.serve import ServeOptions
    from cachescout.bench.trace import TraceOptions
    (model_dir / "config.json").write_text("{}")
    return [(BenchOptions, "--", {}), (TraceOptions, "--trace-", {}),
            (ServeOptions, "--serve-", {"model": str(model_dir), "gpu_blocks": 4})]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["bench", "trace", "serve"])
def test_every_setting_is_a_flag_with_its_default_and_range(which, tmp_path):
    """`cachescout bench`'s flags for BenchOptions, TraceOptions (--trace-*) and ServeOptions
    (--serve-*) are generated from their fields: same default, range and choices, and what a flag
    parses builds the settings object field for field."""
    import argparse

    from cachescout.bench.command import add_arguments
    from cachescout.cli.args import setting_flags, setting_values
    from cachescout.policy import ConfigError

    cls, prefix, required = _settings_classes(tmp_path)[which]
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    defaults = parser.parse_args([])
    flags = setting_flags(cls, prefix)
    assert len(flags) >= 3
    for flag, dest, f in flags:
        assert getattr(defaults, dest) == f.default, flag
        hi, choices = f.metadata["hi"], f.metadata["choices"]
        if hi is not None and f.type in ("int", "float", "int | None", "float | None"):
            too_big = str(int(hi) + 1) if "int" in f.type else str(hi * 2)
            with pytest.raises(argparse.ArgumentError, match=flag):
                parser.parse_args([flag, too_big])
            with pytest.raises(ConfigError, match=repr(f.name)):
                cls(**required, **{f.name: int(hi) + 1 if "int" in f.type else hi * 2})
        if choices is not None:
            with pytest.raises(argparse.ArgumentError, match=flag):
                parser.parse_args([flag, "bogus"])
            with pytest.raises(ConfigError, match=repr(f.name)):
                cls(**required, **{f.name: "bogus"})
            parsed = parser.parse_args([flag, choices[-1]])
            assert getattr(cls(**required, **setting_values(parsed, cls, prefix)), f.name) == choices[-1]
