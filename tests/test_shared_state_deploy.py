"""The shared state on the Redis set-ups users run: ACL users, TLS, Sentinel, Cluster (real servers)."""

from __future__ import annotations

import logging
import pathlib
import socket
import subprocess
import time

import pytest
import redis
from conftest import RedisServer, free_port, need_redis, tls_redis

from cachescout.connector.shared_state import SharedLearnedState, SharedStateSettings
from cachescout.connector.state_store import FETCH_CHUNK_BYTES, StateKeys, StateStore
from cachescout.policy import CacheScoutPolicy, PolicyConfig



def _documented_acl() -> str:
    """The least-privilege rule docs/shared_state.md gives (for deployment "prod"): its commands."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "shared_state.md").read_text()
    block = text.split("ACL SETUSER cachescout", 1)[1].split("```", 1)[0]
    words = block.split()
    return " ".join(words[words.index("-@all"):])


ACL_COMMANDS = _documented_acl()


def pair(settings: dict, name: str):
    s = SharedStateSettings.from_mapping({"deployment": "prod", "replica": name, "timeout_s": 0.5, **settings})
    policy = CacheScoutPolicy(PolicyConfig(transition_half_life=1e9))
    shared = SharedLearnedState(s, half_life=1e9, model="m", hash_domain="d")
    shared.attach(policy)
    return policy, shared


def wait_for_sentinel(port: int, **tls_kw) -> None:
    """Until the Sentinel on `port` names the master "primary" (10 s at most)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            if redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5, **tls_kw).execute_command(
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", "primary"):
                return
        except redis.RedisError:
            pass
        assert time.monotonic() < deadline, "sentinel did not start"
        time.sleep(0.1)


def exchange(settings: dict) -> tuple[dict, dict]:
    """Two replicas on `settings` each learn one transition and must end up with both."""
    (pa, sa), (pb, sb) = pair(settings, "a"), pair(settings, "b")
    pa.learn_transition("x", "y")
    pb.learn_transition("x", "z")
    for _ in range(2):
        for p, s in ((pa, sa), (pb, sb)):
            assert s.sync_now(), s.status()
            s.on_step(p)
    sa.close(final_flush=False)
    sb.close(final_flush=False)
    return pa.inspect().learner.probabilities("x"), pb.inspect().learner.probabilities("x")


def _every_store_operation(client) -> None:
    """What rounds do beyond a plain exchange: a blob fetched in parts, a restart moving the
    previous life aside, a silent replica folded, departed counts pruned."""
    store = StateStore(client, StateKeys("prod", "ops"), max_blob_bytes=4 << 20)
    assert store.ensure_meta(1.0, "d", "e1")[0] == "created"
    big = bytes(range(256)) * (3 * FETCH_CHUNK_BYTES // 256 + 7)
    assert store.register("r", "e1", 60_000) == ("ok", 1) and store.flush("r", "e1", 1, 1, big, 60_000)[0] == "ok"
    parts = store.read().replicas[0].blob
    assert parts is not None and len(parts) == 4 and max(map(len, parts)) == FETCH_CHUNK_BYTES
    assert b"".join(parts) == big
    assert store.register("r", "e1", 60_000) == ("ok", 2)
    assert [(b.name, b"".join(b.blob or ())) for b in store.read().departed] == [("r#1", big)]
    assert store.fold("r", 2, 0) == "folded" and store.read().replicas == []
    assert store.prune_departed(int(time.time() * 1000) + 60_000) == 1 and store.read().departed == []


def test_least_privilege_acl_user_can_do_everything_the_replicas_need(redis_server, monkeypatch, caplog):
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", "cachescout", "on", ">s3cret-pw", "resetkeys", "~cs:{prod|*",
                          "resetchannels", *ACL_COMMANDS.split())
    admin.execute_command("ACL", "SETUSER", "readonly", "on", ">other-pw", "~cs:*", "-@all", "+@read",
                          "+evalsha", "+eval", "+script|load", "+client|setname", "+time")
    monkeypatch.setenv("CS_STATE_PW", "s3cret-pw")
    with caplog.at_level(logging.DEBUG):
        pa, pb = exchange({"url": redis_server.url, "username": "cachescout", "password_env": "CS_STATE_PW"})
    assert set(pa) == set(pb) == {"y", "z"}
    user = redis.Redis.from_url(redis_server.url, username="cachescout", password="s3cret-pw")
    _every_store_operation(user)
    user.close()
    # A user that may not write: loud, counted, and nothing raised into the caller.
    monkeypatch.setenv("CS_STATE_PW", "other-pw")
    _, shared = pair({"url": redis_server.url, "username": "readonly", "password_env": "CS_STATE_PW"}, "c")
    with caplog.at_level(logging.ERROR, "cachescout.shared_state"):
        assert not shared.sync_now()
    assert shared.stats["auth_errors"] == 1 and "refused access" in caplog.text
    # A wrong password: the same, and the password is never written to the log.
    monkeypatch.setenv("CS_STATE_PW", "wrong-pw")
    _, shared = pair({"url": redis_server.url, "username": "cachescout", "password_env": "CS_STATE_PW"}, "d")
    assert not shared.sync_now() and shared.stats["auth_errors"] == 1
    assert "s3cret-pw" not in caplog.text and "wrong-pw" not in caplog.text and "other-pw" not in caplog.text
    admin.close()


def test_password_from_a_file(redis_server, tmp_path):
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", "cachescout", "on", ">file-pw", "~cs:*", "+@all")
    admin.close()
    (tmp_path / "pw").write_text("file-pw\n")
    pa, _ = exchange({"url": redis_server.url, "username": "cachescout", "password_file": str(tmp_path / "pw")})
    assert set(pa) == {"y", "z"}


def test_tls_with_a_private_ca(tmp_path):
    server = tls_redis(str(tmp_path))
    try:
        pa, _ = exchange({"url": server.url, "tls_ca_file": str(tmp_path / "ca.crt")})
        assert set(pa) == {"y", "z"}
        # Without the CA the certificate is not trusted: an error, contained.
        _, shared = pair({"url": server.url}, "c")
        assert not shared.sync_now() and shared.stats["errors"] == 1
    finally:
        server.stop()


@pytest.mark.parametrize("mode", ["plain", "acl-user", "tls"])
def test_through_sentinel(tmp_path, monkeypatch, mode):
    """The master found through Sentinel; with an ACL user the credentials go to the master only
    (Sentinels are asked without them); with TLS, Sentinels and master speak TLS."""
    need_redis()
    tls = mode == "tls"
    master = tls_redis(str(tmp_path)) if tls else RedisServer()
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    lines = ["bind 127.0.0.1", f"dir {tmp_path}"]
    if tls:
        lines += ["port 0", f"tls-port {port}", f"tls-cert-file {tmp_path / 'server.crt'}",
                  f"tls-key-file {tmp_path / 'server.key'}", f"tls-ca-cert-file {tmp_path / 'ca.crt'}",
                  "tls-auth-clients no", "tls-replication yes"]
    else:
        lines += [f"port {port}"]
    lines += [f"sentinel monitor primary 127.0.0.1 {master.port} 1"]
    conf.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen(["redis-server", str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    tls_kw = {"ssl": True, "ssl_ca_certs": str(tmp_path / "ca.crt")} if tls else {}
    try:
        wait_for_sentinel(port, **tls_kw)
        settings: dict = {"sentinels": [f"127.0.0.1:{port}"], "sentinel_service": "primary"}
        if mode == "acl-user":
            admin = redis.Redis(host="127.0.0.1", port=master.port)
            admin.execute_command("ACL", "SETUSER", "cachescout", "on", ">sentinel-pw", "~cs:*", "+@all")
            admin.close()
            monkeypatch.setenv("CS_PW", "sentinel-pw")
            settings |= {"username": "cachescout", "password_env": "CS_PW"}
        if tls:
            settings |= {"sentinel_tls": True, "tls_ca_file": str(tmp_path / "ca.crt")}
        pa, _ = exchange(settings)
        assert set(pa) == {"y", "z"}
        assert redis.Redis(host="127.0.0.1", port=master.port, **tls_kw).exists(StateKeys("prod", "m").meta)
    finally:
        proc.terminate()
        proc.wait(5)
        master.stop()


def test_paused_sentinels_cost_what_the_timeouts_allow(tmp_path):
    """Sentinel connections are built from timeout_s and retries like every other client: with
    every Sentinel SIGSTOPped a round fails within about a second, and close() does not hang."""
    import signal
    need_redis()
    master = RedisServer()
    ports = [free_port(), free_port()]
    procs = []
    try:
        for i, port in enumerate(ports):
            conf = tmp_path / f"sentinel{i}.conf"
            conf.write_text(f"bind 127.0.0.1\nport {port}\ndir {tmp_path}\n"
                            f"sentinel monitor primary 127.0.0.1 {master.port} 1\n")
            procs.append(subprocess.Popen(["redis-server", str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        for port in ports:
            wait_for_sentinel(port)
        settings = {"sentinels": [f"127.0.0.1:{p}" for p in ports], "sentinel_service": "primary",
                    "timeout_s": 0.25, "retries": 1}
        policy, shared = pair(settings, "a")
        policy.learn_transition("x", "y")
        assert shared.sync_now(), shared.status()
        master.pause()                     # the master gone quiet: the pool asks the Sentinels again
        for proc in procs:
            proc.send_signal(signal.SIGSTOP)
        t0 = time.perf_counter()
        assert not shared.sync_now()
        assert time.perf_counter() - t0 < 3.0
        fresh = pair(settings, "b")[1]
        t0 = time.perf_counter()
        assert not fresh.sync_now()
        assert time.perf_counter() - t0 < 3.0
        t0 = time.perf_counter()
        shared.close()
        fresh.close()
        assert time.perf_counter() - t0 < 6.0
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            proc.wait(5)
        master.resume()
        master.stop()


def _cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free and valid too."""
    import random
    rng = random.Random()
    while True:
        p = rng.randrange(20000, 50000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 10000))
            return p
        except OSError:
            continue


def test_on_redis_cluster_every_key_of_a_deployment_is_in_one_slot(tmp_path):
    need_redis()
    ports = [_cluster_port() for _ in range(3)]
    procs = []
    try:
        for p in ports:
            d = tmp_path / str(p)
            d.mkdir()
            procs.append(subprocess.Popen(
                ["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", str(d / "nodes.conf"), "--dir", str(d), "--save", "",
                 "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for p in ports:
            deadline = time.monotonic() + 10
            while True:
                try:
                    redis.Redis(host="127.0.0.1", port=p, socket_timeout=0.5).ping()
                    break
                except redis.RedisError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + 15
        node = redis.Redis(host="127.0.0.1", port=ports[0])
        while b"cluster_state:ok" not in node.execute_command("CLUSTER", "INFO"):
            assert time.monotonic() < deadline, "cluster did not form"
            time.sleep(0.1)
        pa, pb = exchange({"url": f"redis://127.0.0.1:{ports[0]}", "cluster": True})
        assert set(pa) == set(pb) == {"y", "z"}
        from redis.cluster import RedisCluster
        rc = RedisCluster(host="127.0.0.1", port=ports[0])
        keys = list(rc.scan_iter(match="cs:*"))
        assert len(keys) >= 5 and len({rc.keyslot(k) for k in keys}) == 1
        _every_store_operation(rc)     # the scripts that name a departed blob's key themselves included
        rc.close()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(5)
