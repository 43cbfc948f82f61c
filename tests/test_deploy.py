"""The Helm chart, offline: rendered with Helm's own engine, validated, linted, scanned, and its
objects checked (no cluster here). The tools live in their own venv (`make tools`), named by
$CACHESCOUT_TOOLS."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess

import pytest
import yaml

ROOT = pathlib.Path(__file__).parent.parent
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "cachescout"
KUBE_VERSIONS = ("1.37.0", "1.33.0")   # the current release and the oldest still supported
VARIANTS = {
    "default": [],
    "single-replica": [str(DEPLOY / "values" / "single-replica.yaml")],
    "fleet-sentinel-tls": [str(DEPLOY / "values" / "fleet-sentinel-tls.yaml")],
}
WORKLOADS = ("Deployment", "StatefulSet")


def _tools() -> pathlib.Path:
    path = os.environ.get("CACHESCOUT_TOOLS")
    if not path or not (pathlib.Path(path) / "bin" / "python").exists():
        if os.environ.get("CI"):
            pytest.fail("CACHESCOUT_TOOLS is not set: run the tests with `make test`")
        pytest.skip("deployment tools not built (make tools; CACHESCOUT_TOOLS)")
    return pathlib.Path(path) / "bin"


def _run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    if ok and out.returncode != 0:
        raise AssertionError(f"{' '.join(args[:3])}... exited {out.returncode}:\n"
                             f"{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return out


def render(files: list[str], *, set_json: str | None = None, ok: bool = True) -> subprocess.CompletedProcess:
    args = [str(_tools() / "python"), str(DEPLOY / "render.py")]
    for f in files:
        args += ["-f", f]
    if set_json:
        args += ["--set-json", set_json]
    return _run(*args, ok=ok)


@pytest.fixture(scope="module", params=list(VARIANTS))
def rendered(request, tmp_path_factory) -> tuple[str, pathlib.Path, list[dict]]:
    text = render(VARIANTS[request.param]).stdout
    path = tmp_path_factory.mktemp("render") / f"{request.param}.yaml"
    path.write_text(text)
    return request.param, path, [d for d in yaml.safe_load_all(text) if d]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def containers(objs: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for o in objs:
        if o["kind"] in WORKLOADS:
            spec = o["spec"]["template"]["spec"]
            out += [(f"{o['kind']}/{o['metadata']['name']}/{c['name']}", c)
                    for c in spec.get("initContainers", []) + spec["containers"]]
    return out


def vllm_args(objs: list[dict]) -> list[str]:
    (dep,) = [o for o in by_kind(objs, "Deployment") if o["metadata"]["name"].endswith("-vllm")]
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


# -- the chart's own checks -------------------------------------------------------------------------
@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_every_rendered_object_is_valid_kubernetes(rendered, kube):
    _, path, objs = rendered
    out = _run(str(_tools() / "kubernetes-validate"), "--strict", "-k", kube, str(path))
    assert out.stdout.count("passed for resource") == len(objs) >= 10


def test_yamllint_passes_on_values_and_rendered_manifests(rendered):
    _, path, _ = rendered
    _run(str(_tools() / "yamllint"), "-s", "-c", str(DEPLOY / ".yamllint"), str(DEPLOY / "values"),
         str(CHART / "values.yaml"), str(CHART / "Chart.yaml"), str(path))


def test_helm_lint_is_clean_in_strict_mode():
    code = ("import json, sys; from helm_python.chart import lint, values_from_yaml; "
            "v = values_from_yaml(open(sys.argv[2]).read()) if len(sys.argv) > 2 else None; "
            "print(json.dumps(lint(sys.argv[1], v, strict=True, kube_version='v1.37.0')))")
    for files in VARIANTS.values():
        report = json.loads(_run(str(_tools() / "python"), "-c", code, str(CHART), *files).stdout)
        assert report["errors"] == [] and report["total_charts_linted"] == 1
        # Severity 2 is a warning, 3 an error; the only note left is "icon is recommended" (1).
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_policy_scanner_finds_nothing_unjustified(rendered, tmp_path):
    name, path, objs = rendered
    scan = tmp_path / "scan"
    scan.mkdir()
    (scan / path.name).write_text(path.read_text())
    out = _run(str(_tools() / "checkov"), "-d", str(scan), "--framework", "kubernetes", "--skip-download",
               "--compact", "--quiet", "-o", "json", ok=False)
    report = json.loads(out.stdout)
    summary = report["summary"]
    assert summary["failed"] == 0, [c["check_id"] + " " + c["resource"] for c in report["results"]["failed_checks"]]
    assert summary["passed"] > 200
    # Every skipped check carries its reason in the chart (checkov.io/skipN: CHECK=reason).
    for o in objs:
        for key, value in (o["metadata"].get("annotations") or {}).items():
            if key.startswith("checkov.io/skip"):
                check, _, reason = value.partition("=")
                assert re.fullmatch(r"CKV_K8S_\d+", check) and len(reason) > 30, (key, value)


def test_a_values_file_with_a_wrong_type_is_rejected_by_the_schema(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("vllm:\n  replicas: two\n")
    out = render([str(bad)], ok=False)
    assert out.returncode != 0 and "/vllm/replicas" in out.stderr and "want integer" in out.stderr
    for values, where in (({"kvRedis": {"memoryMiB": "16Gi"}}, "/kvRedis/memoryMiB"),
                          ({"lmcache": {"chunkSize": 100}}, "/lmcache/chunkSize"),
                          ({"tls": {"enabled": True}}, "/tls/secretName"),
                          ({"vllm": {"replicaz": 2}}, "replicaz"),
                          ({"cachescout": {"settings": {"shared_state": {}}}}, "/cachescout/settings"),
                          ({"cachescout": {"settings": {"gpu_warmup_url": "http://x:1"}}}, "/cachescout/settings"),
                          ({"cachescout": {"gpuWarmup": {"enabled": "yes"}}}, "/cachescout/gpuWarmup/enabled")):
        out = render([], set_json=json.dumps(values), ok=False)
        assert out.returncode != 0 and where in out.stderr, (values, out.stderr[-500:])


@pytest.mark.parametrize("values,needle", [
    ({"stateRedis": {"sentinel": {"enabled": True, "replicas": 3, "quorum": 4}}}, "quorum (4) must be at most"),
    ({"vllm": {"pythonHashSeed": "4294967296"}}, "pythonHashSeed must be 0-4294967295"),
    ({"vllm": {"pythonHashSeed": "99999999999999999999"}}, "/vllm/pythonHashSeed"),
    ({"stateRedis": {"enabled": False}}, "sharedState.enabled needs stateRedis.enabled"),
    ({"kvRedis": {"enabled": False}}, "lmcache.enabled needs kvRedis.enabled"),
    ({"fullnameOverride": "My_Release"}, "/fullnameOverride"),
    ({"nameOverride": "-x"}, "/nameOverride"),
    ({"auth": {"existingSecret": "Bad Secret"}}, "/auth/existingSecret"),
])
def test_values_that_would_render_what_cannot_run_are_refused(values, needle):
    out = render([], set_json=json.dumps(values), ok=False)
    assert out.returncode != 0 and needle in out.stderr, (values, out.stderr[-500:])


def test_the_refusals_leave_working_combinations_alone():
    for values in ({"stateRedis": {"sentinel": {"enabled": True, "replicas": 3, "quorum": 3}}},
                   {"vllm": {"pythonHashSeed": "4294967295"}},
                   {"stateRedis": {"enabled": False}, "cachescout": {"sharedState": {"enabled": False}}},
                   {"kvRedis": {"enabled": False}, "lmcache": {"enabled": False}},
                   {"fullnameOverride": "cs-prod", "auth": {"existingSecret": "cs.secrets"}}):
        render([], set_json=json.dumps(values))


def test_plain_manifests_are_the_chart_rendered(tmp_path):
    committed = (DEPLOY / "manifests" / "cachescout.yaml").read_text()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import render; "
            "sys.stdout.write(render.render(render.MANIFEST_VALUES))")
    fresh = _run(str(_tools() / "python"), "-c", code, str(DEPLOY)).stdout
    assert committed.split("\n", 2)[2] == fresh, "deploy/manifests is stale: run `make manifests`"


# -- what the rendered objects must hold ------------------------------------------------------------
def test_every_container_has_resources_and_probes(rendered):
    _, _, objs = rendered
    found = containers(objs)
    assert len(found) >= 3
    for where, c in found:
        res = c.get("resources") or {}
        assert res.get("requests") and res.get("limits"), where
        assert {"cpu", "memory"} <= set(res["limits"]), where
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c.get(probe), (where, probe)
        sc = c.get("securityContext") or {}
        assert sc.get("allowPrivilegeEscalation") is False and sc.get("readOnlyRootFilesystem") is True, where
        assert sc["capabilities"]["drop"] == ["ALL"], where


def test_redis_memory_request_equals_limit_and_tiers_are_configured_as_documented(rendered):
    _, _, objs = rendered
    confs = {o["metadata"]["name"]: o["data"].get("redis.conf", "") for o in by_kind(objs, "ConfigMap")}
    kv = next(v for k, v in confs.items() if k.endswith("-kv-redis"))
    state = next(v for k, v in confs.items() if k.endswith("-state-redis"))
    assert "maxmemory-policy allkeys-lru" in kv and "appendonly no" in kv and 'save ""' in kv
    assert "maxmemory-policy noeviction" in state and "appendonly yes" in state
    for where, c in containers(objs):
        if "redis" in where:
            assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"], where
    (sts,) = [o for o in by_kind(objs, "StatefulSet") if o["metadata"]["name"].endswith("-state-redis")]
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_no_secret_value_in_args_or_configmaps(rendered):
    name, _, objs = rendered
    secrets = by_kind(objs, "Secret")
    values = [v for s in secrets for v in (s.get("stringData") or {}).values()]
    if name == "fleet-sentinel-tls":
        assert not secrets          # an existing Secret is used
    else:
        assert len(values) >= 4
    # Passwords are long random strings; a URL carries one.
    values += [p for v in values for p in re.findall(r":([^:@/]{16,})@", v)]
    visible = [json.dumps(o["data"]) for o in by_kind(objs, "ConfigMap")]
    for _, c in containers(objs):
        visible += [json.dumps(c.get("args", [])), json.dumps(c.get("command", []))]
        visible += [json.dumps(e.get("value", "")) for e in c.get("env", [])]
    blob = "\n".join(visible)
    for v in values:
        if len(v) >= 16 and "://" not in v:
            assert v not in blob
    assert not re.search(r"(?i)(requirepass|password)\s+\S{8,}", blob)     # no literal password config
    assert "redis://lmcache:" not in blob and "rediss://lmcache:" not in blob


def test_network_policies_let_only_vllm_pods_reach_redis(rendered):
    _, _, objs = rendered
    policies = by_kind(objs, "NetworkPolicy")
    vllm = next(o for o in by_kind(objs, "Deployment") if o["metadata"]["name"].endswith("-vllm"))
    vllm_labels = vllm["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict, labels: dict) -> bool:
        return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())

    redis_workloads = [o for o in objs if o["kind"] in WORKLOADS and "redis" in o["metadata"]["name"]]
    assert len(redis_workloads) >= 2
    redis_labels = [o["spec"]["template"]["metadata"]["labels"] for o in redis_workloads]
    for labels in redis_labels:
        mine = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert mine, labels
        for p in mine:
            assert p["spec"]["policyTypes"] == ["Ingress"]
            for rule in p["spec"]["ingress"]:
                for peer in rule["from"]:
                    sel = peer.get("podSelector")
                    assert sel and sel.get("matchLabels") and not peer.get("namespaceSelector"), p["metadata"]["name"]
                    # the vLLM pods, or (with Sentinel) the state store's own pods
                    assert selects(sel, vllm_labels) or any(selects(sel, lab) for lab in redis_labels), sel
        kv_only = [p for p in mine if p["metadata"]["name"].endswith("-kv-redis")]
        for p in kv_only:
            peers = [peer for r in p["spec"]["ingress"] for peer in r["from"]]
            assert [selects(peer["podSelector"], vllm_labels) for peer in peers] == [True]


def test_vllm_gets_one_kv_transfer_config_naming_cachescout(rendered, tmp_path):
    from cachescout.connector import ConnectorSettings

    name, _, objs = rendered
    args = vllm_args(objs)
    i = args.index("--kv-transfer-config")
    config = json.loads(args[i + 1])                  # one argument, valid JSON
    assert config["kv_connector"] == "MultiConnector"
    ours, lmcache = config["kv_connector_extra_config"]["connectors"]
    assert ours["kv_connector"] == "CacheScoutConnector" and ours["kv_connector_module_path"] == "cachescout.connector"
    assert lmcache["kv_connector"] == "LMCacheConnectorV1"
    extra = ours["kv_connector_extra_config"]
    # CacheScout follows LMCache's CPU tier at the size LMCache is given (the chart's configmap).
    cpu_gib = next(float(line.split(":")[1]) for o in objs if o["kind"] == "ConfigMap"
                   for text in o.get("data", {}).values() for line in text.splitlines()
                   if line.strip().startswith("max_local_cpu_size:"))
    assert extra["lmcache_cpu_gib"] == cpu_gib > 0
    shared = extra["shared_state"]
    assert shared["password_file"] == "/secrets/state-password" and "password" not in json.dumps(shared["username"])
    # CacheScout accepts these settings as it will at start-up (files that exist in the pod made here).
    (tmp_path / "pw").write_text("x")
    (tmp_path / "ca").write_text("x")
    extra = {**extra, "shared_state": {**shared, "password_file": str(tmp_path / "pw"),
                                       **({"tls_ca_file": str(tmp_path / "ca")} if "tls_ca_file" in shared else {})}}
    settings = ConnectorSettings.from_extra_config(extra, block_size=16)
    if name == "fleet-sentinel-tls":
        assert settings.shared_state.sentinels and settings.shared_state.deployment == "agents-prod"
        assert settings.steer_ahead_blocks == 32 and settings.policy.max_agents == 256
    else:
        assert settings.shared_state.url.startswith("redis://") and "state-redis" in settings.shared_state.url
    env = {e["name"]: e for e in next(c for w, c in containers(objs) if w.endswith("/vllm"))["env"]}
    assert env["PYTHONHASHSEED"]["value"] == "0"
    assert env["LMCACHE_REMOTE_URL"]["valueFrom"]["secretKeyRef"]["key"] == "lmcache-remote-url"


def test_gpu_warmups_go_to_the_pods_own_server_at_the_lowest_priority():
    """cachescout.gpuWarmup: the pod's own address (its port) as gpu_warmup_url, which CacheScout
    accepts, and vLLM scheduling by priority so that a warm-up yields to every real request; off
    by default, and then neither."""
    from cachescout.connector import ConnectorSettings

    for enabled in (False, True):
        values = {"vllm": {"port": 8123}, "cachescout": {"gpuWarmup": {"enabled": enabled}}}
        objs = [d for d in yaml.safe_load_all(render([], set_json=json.dumps(values)).stdout) if d]
        args = vllm_args(objs)
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        extra = config["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]
        assert ("--scheduling-policy=priority" in args) == enabled
        assert extra.get("gpu_warmup_url") == ("http://127.0.0.1:8123" if enabled else None)
        settings = ConnectorSettings.from_extra_config({k: v for k, v in extra.items() if k != "shared_state"},
                                                       block_size=16)
        assert settings.gpu_warmup_url == extra.get("gpu_warmup_url")


def test_lmcache_yaml_loads_with_lmcaches_loader_and_points_at_the_kv_tier(rendered, tmp_path, monkeypatch):
    pytest.importorskip("lmcache")
    from lmcache.v1.config import LMCacheEngineConfig

    from cachescout.connector import lmcache_tier

    name, _, objs = rendered
    cm = next(o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("-lmcache"))
    (tmp_path / "lmcache.yaml").write_text(cm["data"]["lmcache.yaml"])
    secret = by_kind(objs, "Secret")
    url = (secret[0]["stringData"]["lmcache-remote-url"] if secret
           else "rediss://lmcache:pw@cachescout-kv-redis:6379/0?ssl_ca_certs=/tls/ca.crt")
    kv_service = next(o for o in by_kind(objs, "Service") if o["metadata"]["name"].endswith("-kv-redis"))
    monkeypatch.setenv("LMCACHE_REMOTE_URL", url)          # what the pod gets from the Secret
    lmcache_tier.register()
    config = LMCacheEngineConfig.from_file(str(tmp_path / "lmcache.yaml"))
    config.update_config_from_env()
    assert config.chunk_size in (64, 128, 256, 512) and config.local_cpu and config.max_local_cpu_size > 0
    assert config.cache_policy == "cachescout"
    assert f"@{kv_service['metadata']['name']}:6379" in config.remote_url
    assert config.remote_url.startswith("rediss://" if name == "fleet-sentinel-tls" else "redis://")


def test_every_replica_shares_the_hash_seed_and_an_in_memory_shm(rendered):
    _, _, objs = rendered
    vllm = next(o for o in by_kind(objs, "Deployment") if o["metadata"]["name"].endswith("-vllm"))
    spec = vllm["spec"]["template"]["spec"]
    shm = next(v for v in spec["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert spec["terminationGracePeriodSeconds"] >= 30 and spec["automountServiceAccountToken"] is False
    probe = spec["containers"][0]["startupProbe"]
    assert probe["httpGet"]["path"] == "/health" and probe["periodSeconds"] * probe["failureThreshold"] >= 600
    assert spec["securityContext"]["runAsNonRoot"] is True
    pdbs = [p for p in by_kind(objs, "PodDisruptionBudget") if p["metadata"]["name"].endswith("-vllm")]
    assert len(pdbs) == (vllm["spec"]["replicas"] > 1)


# -- the rendered Redis start scripts, run for real -------------------------------------------------
def _start_script(objs: list[dict], suffix: str) -> tuple[str, dict]:
    (wl,) = [o for o in objs if o["kind"] in WORKLOADS and o["metadata"]["name"].endswith(suffix)]
    (c,) = wl["spec"]["template"]["spec"]["containers"]
    conf = next(o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith(suffix))
    return c["args"][0], conf["data"]["redis.conf"]


@pytest.mark.parametrize("suffix, user, keys, tls", [
    ("-kv-redis", "lmcache", ["kv-password"], False),
    ("-state-redis", "cachescout", ["state-password"], False),
    ("-state-redis", "cachescout", ["state-password"], True),
], ids=["kv", "state", "state-tls"])
def test_redis_start_scripts_and_probes_work_on_redis_server(tmp_path, suffix, user, keys, tls):
    """Each Redis pod's start script, run as written (paths moved under a temp dir), makes a config
    and an ACL file redis-server accepts; its probe command passes; the default user may only PING;
    the service user logs in with the Secret's password and can do its job (over TLS when on)."""
    import time

    import redis

    from conftest import free_port, make_certs, need_redis, need_tool
    need_redis()
    for tool in ("sha256sum", "redis-cli") + (("openssl",) if tls else ()):
        need_tool(tool)
    values = json.dumps({"tls": {"enabled": True, "secretName": "redis-tls"}}) if tls else None
    objs = [d for d in yaml.safe_load_all(render([], set_json=values).stdout) if d]
    script, conf = _start_script(objs, suffix)
    for d in ("run", "etc", "secrets", "data", "tls"):
        (tmp_path / d).mkdir()
    for k in keys:
        (tmp_path / "secrets" / k).write_text(f"pw-{k}")
    if tls:
        make_certs(str(tmp_path / "tls"))
        (tmp_path / "tls" / "server.crt").rename(tmp_path / "tls" / "tls.crt")
        (tmp_path / "tls" / "server.key").rename(tmp_path / "tls" / "tls.key")

    def moved(text: str) -> str:
        for path, to in (("/run/redis", "run"), ("/etc/redis", "etc"), ("/secrets", "secrets"), ("/tls", "tls"),
                         ("/data", "data")):
            text = re.sub(rf"(?<![\w/]){re.escape(path)}(?=[/\s]|$)", str(tmp_path / to), text)
        return text

    (tmp_path / "etc" / "redis.conf").write_text(moved(conf))
    port = free_port()
    # Options after the config file override it: a free port on loopback.
    ports = f"--tls-port {port} --port 0" if tls else f"--port {port}"
    script = re.sub(r"exec redis-server (\S+)", rf"exec redis-server \1 {ports} --bind 127.0.0.1", moved(script))
    proc = subprocess.Popen(["sh", "-c", script], env={**os.environ, "POD_NAME": "state-0"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tls_kw = {"ssl": True, "ssl_ca_certs": str(tmp_path / "tls" / "ca.crt")} if tls else {}

    def client(**kw) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, **tls_kw, **kw)

    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if client().ping():
                    break
            except redis.RedisError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"redis-server did not start: {proc.stdout.read()[-2000:]}")
            time.sleep(0.05)
        (wl,) = [o for o in objs if o["kind"] in WORKLOADS and o["metadata"]["name"].endswith(suffix)]
        probe = wl["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
        probe = [moved(a).replace(" -p 6379", f" -p {port}") for a in probe]
        assert subprocess.run(probe, capture_output=True, timeout=10).returncode == 0, probe
        anonymous = client()
        with pytest.raises(redis.exceptions.NoPermissionError):
            anonymous.get("anything")
        with pytest.raises(redis.exceptions.AuthenticationError):
            client(username=user, password="wrong").ping()
        if user == "lmcache":
            r = client(username=user, password="pw-kv-password")
            r.set("chunk:1", b"\x00" * 1024)
            assert r.get("chunk:1") == b"\x00" * 1024 and r.exists("chunk:1") == 1
            assert r.delete("chunk:1") == 1
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.flushall()
            r.close()
        else:
            from test_shared_state import learn

            from cachescout.connector.shared_state import SharedLearnedState, SharedStateSettings
            from cachescout.policy import CacheScoutPolicy, PolicyConfig
            (tmp_path / "pwfile").write_text("pw-state-password")
            arg = vllm_args(objs)[vllm_args(objs).index("--kv-transfer-config") + 1]
            shared = json.loads(arg)["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"][
                "shared_state"]
            assert shared["url"].startswith("rediss://" if tls else "redis://")
            settings = SharedStateSettings.from_mapping(
                {**shared, "url": f"{shared['url'].split(':')[0]}://127.0.0.1:{port}/0", "replica": "vllm-0",
                 "password_file": str(tmp_path / "pwfile"),
                 **({"tls_ca_file": str(tmp_path / "tls" / "ca.crt")} if tls else {})})
            policy = CacheScoutPolicy(PolicyConfig())
            state = SharedLearnedState(settings, half_life=policy.half_life, model="m", hash_domain="d")
            state.attach(policy)
            learn(policy, [("a", "b")], 3)
            assert state.sync_now(), state.status()
            assert state.sync_now() and state.stats["auth_errors"] == 0 and state.stats["flush_ok"] == 2
            state.close(final_flush=False)
        anonymous.close()
    finally:
        proc.terminate()
        proc.wait(5)
        proc.stdout.close()
