"""Learned state shared through a real redis-server: merging, idempotence, generations, faults."""

from __future__ import annotations

import logging
import time

import pytest
import redis
from conftest import RedisServer, need_redis

from cachescout.connector.shared_state import CircuitBreaker, SharedLearnedState, SharedStateSettings
from cachescout.bench.state_bench import plant
from cachescout.connector.state_store import SCHEMA, StateKeys
from cachescout.policy import CacheScoutPolicy, ConfigError, PolicyConfig

HALF_LIFE = 1e9   # no decay within a test: merged counts must then be exact sums


def make(url: str, name: str, *, half_life: float = HALF_LIFE, domain: str = "d0", **extra):
    settings = SharedStateSettings.from_mapping({"url": url, "replica": name, "deployment": "test",
                                                 "timeout_s": 0.2, **extra})
    policy = CacheScoutPolicy(PolicyConfig(transition_half_life=half_life))
    shared = SharedLearnedState(settings, half_life=half_life, model="m", hash_domain=domain)
    shared.attach(policy)
    return policy, shared


def learn(policy: CacheScoutPolicy, pairs: list[tuple[str, str]], times: int = 1) -> None:
    for _ in range(times):
        for src, dst in pairs:
            policy.learn_transition(src, dst)


def counts(policy: CacheScoutPolicy) -> dict[tuple[str, str], float]:
    return {(s, d): round(c, 3) for s, d, c in policy.transitions()}


def sync(*pairs) -> None:
    """Every replica flushes, then every replica reads and installs (two rounds: all see all)."""
    for _ in range(2):
        for policy, shared in pairs:
            assert shared.sync_now(), shared.status()
            shared.on_step(policy)


# -- settings ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, field", [
    ({"url": "redis://h", "flush": 1}, "unknown key"),
    ({"url": "http://h"}, "shared_state.url"),
    ({"url": "redis://:secret@h:6379"}, "must not hold a password"),
    ({"url": "redis://h", "password_env": "CACHESCOUT_NO_SUCH_VARIABLE"}, "shared_state.password_env"),
    ({"url": "redis://h", "timeout_s": -1}, "shared_state.timeout_s"),
    ({"url": "redis://h", "retries": 1.5}, "shared_state.retries"),
    ({"url": "redis://h", "replica": "a b{c}"}, "shared_state.replica"),
    ({"url": "redis://h", "flush_interval_s": 10, "fold_after_s": 20}, "fold_after_s"),
    ({"sentinels": ["h:26379"]}, "sentinel_service"),
    ({"sentinels": ["nope"], "sentinel_service": "m"}, "shared_state.sentinels"),
    ({}, "give 'url'"),
    ({"url": "redis://h", "tls_ca_file": "/no/such/ca.pem"}, "shared_state.tls_ca_file"),
    ({"url": "redis://127.0.0.1:65536/0"}, "invalid port"),
    ({"url": "redis://127.0.0.1:abc/0"}, "invalid port"),
    ({"url": "redis://127.0.0.1:0"}, "invalid port"),
    ({"url": "redis://:6379"}, "names no host"),
    ({"url": "redis://h:6379/zero"}, "database after the host"),
    ({"url": "unix://"}, "socket's path"),
    ({"url": "redis://h", "flush_interval_s": 10**400}, "shared_state.flush_interval_s"),
    ({"url": "redis://h", "departed_half_life_s": float("nan")}, "shared_state.departed_half_life_s"),
    ({"url": "redis://h", "timeout_s": None}, "shared_state.timeout_s"),
    ({"url": "redis://h", "cluster": None}, "shared_state.cluster"),
])
def test_bad_settings_fail_with_the_field_named(raw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        SharedStateSettings.from_mapping(raw)


def test_connector_settings_take_shared_state():
    from cachescout.connector import ConnectorSettings
    s = ConnectorSettings.from_extra_config({"shared_state": {"url": "redis://h:1", "deployment": "prod"}})
    assert s.shared_state.deployment == "prod" and s.shared_state.flush_interval_s == 5.0
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.shared_state\.deployment"):
        ConnectorSettings.from_extra_config({"shared_state": {"url": "redis://h:1", "deployment": ""}})


def test_keys_of_deployments_and_models_share_one_hash_tag_each():
    a, b = StateKeys("prod", "llama-8b"), StateKeys("prod", "llama-70b")
    tag = a.rep("x").split("{")[1].split("}")[0]
    assert all(k.split("{")[1].split("}")[0] == tag
               for k in (a.meta, a.replicas, a.gen("y"), a.blob("y"), a.departed_at, a.departed("y#1")))
    assert not set(map(a.rep, "xy")) & set(map(b.rep, "xy"))


def test_breaker_opens_after_failures_and_backs_off():
    now = [0.0]
    br = CircuitBreaker(3, 10.0, clock=lambda: now[0])
    for _ in range(3):
        assert br.allow()
        br.failure()
    assert not br.allow() and br.is_open
    now[0] = 0.6
    assert br.allow()
    br.failure()                # still failing: the cool-down doubles
    now[0] = 1.5
    assert not br.allow()
    now[0] = 1.7
    br.success()
    assert br.allow() and not br.is_open


# -- merging ----------------------------------------------------------------------------------------
def test_replicas_merge_exact_sums_and_repeated_rounds_never_double_count(redis_server):
    a = make(redis_server.url, "a")
    b = make(redis_server.url, "b")
    learn(a[0], [("x", "y")], 40)
    learn(b[0], [("x", "z")], 10)
    for _ in range(3):
        sync(a, b)
    want = {("x", "y"): 40.0, ("x", "z"): 10.0}
    assert counts(a[0]) == want and counts(b[0]) == want
    assert a[0].predict_next("x")[0] == ("y", pytest.approx(0.8))
    # Updates made after the merge was built are replayed onto it, not lost.
    a[1].sync_now()
    learn(a[0], [("x", "q")], 2)
    assert a[1].on_step(a[0])
    assert counts(a[0]) == {**want, ("x", "q"): 2.0}


def test_a_retried_or_out_of_order_flush_is_a_no_op(redis_server):
    a = make(redis_server.url, "a")
    learn(a[0], [("x", "y")], 5)
    a[1].sync_now()
    store = a[1]._store
    blob = store.r.get(a[1].keys.blob("a"))
    gen, seq = a[1]._gen, a[1]._flush_seq
    assert store.flush("a", a[1]._epoch, gen, seq, blob, 60_000)[0] == "dup"
    assert store.flush("a", a[1]._epoch, gen, seq, blob, 60_000)[0] == "dup"
    assert store.flush("a", a[1]._epoch, gen, seq - 1, b"older", 60_000)[0] == "dup"
    assert store.r.get(a[1].keys.blob("a")) == blob
    b = make(redis_server.url, "b")
    sync(b)
    assert counts(b[0]) == {("x", "y"): 5.0}


def test_restart_under_the_same_name_starts_warm_and_fences_the_old_copy(redis_server, caplog):
    old = make(redis_server.url, "a")
    learn(old[0], [("x", "y")], 30)
    sync(old)
    new = make(redis_server.url, "a")           # same name: a restarted pod of a StatefulSet
    sync(new)
    assert counts(new[0]) == pytest.approx({("x", "y"): 30.0}, rel=1e-3)  # warm: the previous life's, once
    learn(new[0], [("x", "z")], 5)
    learn(old[0], [("x", "y")], 100)             # the old copy keeps running...
    with caplog.at_level(logging.ERROR, "cachescout.shared_state"):
        assert not old[1].sync_now()             # ...but may not overwrite the newer one
    assert old[1].superseded and "another process registered" in caplog.text
    assert not old[1].sync_now()
    other = make(redis_server.url, "b")
    sync(new, other)
    # Once each, not twice (the old copy's later 100 never landed). The merge weights counts by their
    # age, so a slow machine reads a few thousandths less (29.999 seen under load).
    assert counts(other[0]) == pytest.approx({("x", "y"): 30.0, ("x", "z"): 5.0}, rel=1e-3)


def test_a_silent_replica_is_folded_in_and_rejoins_without_double_counting(redis_server):
    # Read in this process: starting the helper (a process spawn, up to a second on a loaded
    # machine) inside these sub-second windows would itself look like silence. The fold does not
    # depend on who reads.
    fast = {"flush_interval_s": 0.1, "fold_after_s": 0.3, "isolated_reader": False}
    a = make(redis_server.url, "a", **fast)
    b = make(redis_server.url, "b", **fast)
    learn(a[0], [("x", "y")], 7)
    learn(b[0], [("x", "z")], 3)
    sync(a, b)
    time.sleep(0.4)                               # b says nothing for longer than fold_after_s
    assert a[1].sync_now()
    assert a[1].stats["folds"] == 1 and a[1].departed_count == 0
    a[1].sync_now()
    a[1].on_step(a[0])
    assert a[1].departed_count == 1
    assert counts(a[0]) == {("x", "y"): 7.0, ("x", "z"): 3.0}   # folded, not lost
    learn(b[0], [("x", "z")], 2)                 # b was only paused; it comes back
    sync(b, a)
    assert b[1].stats["refolded"] == 1
    assert counts(a[0])[("x", "z")] == pytest.approx(3.0, abs=0.01)   # its 3 once; the 2 since its last
    # flush are the "at most one flush interval" it may lose
    learn(b[0], [("x", "z")], 4)
    sync(b, a)
    assert counts(a[0])[("x", "z")] == pytest.approx(7.0, abs=0.01)


def test_departed_counts_fade_and_are_dropped(redis_server):
    settings = {"flush_interval_s": 0.1, "fold_after_s": 1.0, "departed_half_life_s": 1.0}
    a = make(redis_server.url, "a", **settings)
    b = make(redis_server.url, "b", **settings)
    learn(b[0], [("x", "z")], 64)
    sync(a, b)
    time.sleep(1.1)
    a[1].sync_now()                               # folds b
    time.sleep(1.0)
    a[1].sync_now()
    a[1].on_step(a[0])
    assert 10 < counts(a[0])[("x", "z")] < 40     # about half, a second after folding
    store = a[1]._store
    store.prune_departed(int(time.time() * 1000) + 1)   # as if ten half-lives had passed
    a[1].sync_now()
    a[1].on_step(a[0])
    assert counts(a[0]) == {}


def test_a_reset_starts_everyone_over_and_refuses_old_flushes(redis_server):
    a = make(redis_server.url, "a")
    b = make(redis_server.url, "b")
    learn(a[0], [("x", "y")], 4)
    learn(b[0], [("x", "z")], 4)
    sync(a, b)
    old_epoch = a[1]._epoch
    deleted = a[1]._store.reset("fresh")
    assert deleted >= 3
    assert a[1]._store.flush("a", old_epoch, a[1]._gen, 99, b"x", 60_000)[0] == "epoch"
    sync(a, b)
    assert a[1].stats["resets_seen"] == 1 and b[1].stats["resets_seen"] == 1
    assert counts(a[0]) == {} and counts(b[0]) == {}
    learn(b[0], [("x", "w")], 1)
    sync(b, a)
    assert counts(a[0]) == {("x", "w"): 1.0}


def test_replicas_hashing_blocks_differently_refuse_to_share(redis_server, caplog):
    a = make(redis_server.url, "a", domain="seed-1")
    learn(a[0], [("x", "y")], 3)
    sync(a)
    b = make(redis_server.url, "b", domain="seed-2")
    learn(b[0], [("x", "z")], 3)
    with caplog.at_level(logging.ERROR, "cachescout.shared_state"):
        assert not b[1].sync_now()
    assert "hash_domain" in caplog.text and b[1].status()["degraded"] == 1
    b[1].on_step(b[0])
    assert counts(b[0]) == {("x", "z"): 3.0}     # local learning goes on
    c = make(redis_server.url, "c", domain="seed-1")
    sync(c)
    assert counts(c[0]) == {("x", "y"): 3.0}


def test_corrupt_oversized_and_wrong_type_entries_are_rejected_and_counted(redis_server):
    a = make(redis_server.url, "a", max_blob_bytes=4096)
    learn(a[0], [("x", "y")], 2)
    sync(a)
    k = a[1].keys
    r = redis.Redis.from_url(redis_server.url)
    now = int(time.time() * 1000)
    plant(r, k, "garbage", b"\xc1\xff not msgpack", gen=1, seq=1, at=now)
    plant(r, k, "huge", b"\x00" * 10_000, gen=1, seq=1, at=now)
    plant(r, k, "words", gen="one", seq=1, at=now)
    r.set(k.rep("string"), b"not a hash")
    plant(r, k, "blobhash", gen=1, seq=1, at=now)
    r.hset(k.blob("blobhash"), "not", "a string")
    r.set(k.departed("evil#1"), b"\x92\x01")
    r.set(k.departed("nogen"), b"\x92\x01")
    r.zadd(k.departed_at, {"evil#1": now, "nogen": now})
    r.zadd(k.replicas, {n: now for n in ("garbage", "huge", "words", "string", "blobhash")})
    assert a[1].sync_now()
    a[1].on_step(a[0])
    assert a[1].stats["rejected_blobs"] == 7
    assert counts(a[0]) == {("x", "y"): 2.0}
    a[1].sync_now()                               # rejected once each, not once per round
    assert a[1].stats["rejected_blobs"] == 7
    r.close()


# -- faults -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("aof", [False, True], ids=["no-persistence", "aof"])
def test_redis_killed_and_restarted_heals_with_nothing_lost_or_doubled(tmp_path, aof):
    need_redis()
    server = RedisServer(aof=aof, workdir=str(tmp_path))
    try:
        a = make(server.url, "a")
        b = make(server.url, "b")
        learn(a[0], [("x", "y")], 6)
        learn(b[0], [("x", "z")], 2)
        sync(a, b)
        server.kill9()
        learn(a[0], [("x", "y")], 1)
        t0 = time.perf_counter()
        assert not a[1].sync_now() and not b[1].sync_now()
        assert time.perf_counter() - t0 < 3.0            # fails fast, raises nothing
        a[1].on_step(a[0])
        assert counts(a[0])[("x", "y")] == 7.0            # local learning went on
        server.start()
        time.sleep(0.6)                                   # past the breaker's first cool-down
        sync(a, b)
        assert counts(a[0]) == counts(b[0]) == {("x", "y"): 7.0, ("x", "z"): 2.0}
        assert (a[1].stats["meta_lost"] > 0) == (not aof)
    finally:
        server.stop()


def test_redis_paused_with_sigstop_costs_little_and_heals(redis_server):
    a = make(redis_server.url, "a", breaker_failures=2)
    learn(a[0], [("x", "y")], 3)
    sync(a)
    redis_server.pause()
    try:
        t0 = time.perf_counter()
        for _ in range(5):
            assert not a[1].sync_now()
        elapsed = time.perf_counter() - t0
        assert a[1].breaker.is_open and a[1].stats["breaker_skips"] >= 2
        assert elapsed < 3.0, elapsed                      # two timed-out rounds, then the breaker answers
        assert a[1].status()["degraded"] == 1
    finally:
        redis_server.resume()
    time.sleep(0.6)
    learn(a[0], [("x", "y")], 1)
    sync(a)
    assert a[1].status()["degraded"] == 0 and counts(a[0]) == {("x", "y"): 4.0}


def test_a_network_timeout_is_contained(redis_server):
    from helpers import StallingProxy
    with StallingProxy(redis_server.port) as proxy:
        a = make(f"redis://127.0.0.1:{proxy.port}", "a")
        learn(a[0], [("x", "y")], 2)
        sync(a)
        proxy.stall = True
        t0 = time.perf_counter()
        assert not a[1].sync_now()
        assert time.perf_counter() - t0 < 2.0
        assert a[1].stats["errors"] == 1
        proxy.stall = False
        time.sleep(0.1)
        sync(a)
        assert counts(a[0]) == {("x", "y"): 2.0}


def test_a_background_thread_shares_while_the_serving_thread_only_swaps(redis_server):
    a = make(redis_server.url, "a", flush_interval_s=0.05, fold_after_s=1.0)
    b = make(redis_server.url, "b", flush_interval_s=0.05, fold_after_s=1.0)
    a[1].start()
    b[1].start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            learn(a[0], [("x", "y")])
            learn(b[0], [("x", "z")])
            a[1].on_step(a[0])
            b[1].on_step(b[0])
            if a[0].inspect().learner.probability("x", "z") > 0 and b[0].inspect().learner.probability("x", "y") > 0:
                break
            time.sleep(0.01)
        assert a[0].inspect().learner.probability("x", "z") > 0 and b[0].inspect().learner.probability("x", "y") > 0
    finally:
        a[1].close()
        b[1].close()
    # The final flush on close means nothing is lost at a clean shutdown.
    c = make(redis_server.url, "c")
    sync(c)
    own_a = sum(1 for op in a[1]._recent if op[1][1:3] == ("x", "y"))
    assert counts(c[0])[("x", "y")] == own_a


# -- several processes ------------------------------------------------------------------------------
def _replica_cmd(*args: str) -> list[str]:
    import os
    import sys
    return [sys.executable, os.path.join(os.path.dirname(__file__), "replica_proc.py"), *args]


@pytest.mark.parametrize("half_life", [1e9, 200.0], ids=["no-decay", "decay"])
def test_three_replica_processes_converge_to_what_one_process_learns(redis_server, tmp_path, half_life):
    import json
    import subprocess

    from replica_proc import sessions

    procs = [subprocess.Popen(_replica_cmd("converge", redis_server.url, f"r{i}", str(i), "3", str(half_life),
                                           str(tmp_path / f"r{i}.json")))
             for i in range(3)]
    for p in procs:
        assert p.wait(60) == 0
    single = CacheScoutPolicy(PolicyConfig(transition_half_life=half_life))
    for path in sessions():
        for src, dst in path:
            single.learn_transition(src, dst)
    views = []
    for i in range(3):
        merged = CacheScoutPolicy(PolicyConfig(transition_half_life=half_life))
        merged.inspect().learner.absorb({})
        for s, d, c in json.loads((tmp_path / f"r{i}.json").read_text()):
            merged.inspect().learner.absorb({s: {d: c}})
        views.append(merged.inspect().learner)
    for view in views:
        for src in single.inspect().learner.decayed_rows():
            want, got = single.inspect().learner.probabilities(src), view.probabilities(src)
            assert set(got) == set(want)
            for dst, p in want.items():
                # Exact without decay; with decay each replica forgets over its own third of the
                # traffic, so the weights of old and new transitions differ a little.
                assert got[dst] == pytest.approx(p, abs=1e-6 if half_life > 1e6 else 0.03), (src, dst)
        if half_life > 1e6:
            got_counts = {(s, d): c for s, d, c in view.edges()}
            assert got_counts == pytest.approx({(s, d): c for s, d, c in single.transitions()}, rel=1e-5)


def test_a_replica_killed_mid_flush_leaves_a_whole_blob_and_its_successor_starts_warm(redis_server):
    import random
    import signal
    import subprocess

    from cachescout.connector.state_store import StateStore
    from cachescout.policy import TransitionSnapshot

    rng = random.Random(3)
    r = redis.Redis.from_url(redis_server.url)
    keys = StateKeys("mp", "m")
    store = StateStore(r, keys, max_blob_bytes=1 << 20)
    folded = 0
    for _ in range(3):
        proc = subprocess.Popen(_replica_cmd("flush-forever", redis_server.url, "victim"),
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.1, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        proc.stdout.close()
        seq = int(r.hget(keys.rep("victim"), "seq"))
        snap = TransitionSnapshot.decode(r.get(keys.blob("victim")))
        assert seq > 0 and snap.decayed_rows()["x"]["y"] == pytest.approx(seq, rel=1e-5)   # whole, never torn
        folded += seq
    view = store.read()
    lives = sorted(b.name for b in view.departed)
    assert lives == ["victim#1", "victim#2"]     # each restart moved the previous life aside
    # A successor under the same name starts with every life's counts, each once.
    heir = make(redis_server.url, "victim", deployment="mp", domain="d")
    sync(heir)
    # (departed counts fade with a one-hour half-life: seconds cost a few parts in ten thousand)
    assert counts(heir[0]) == {("x", "y"): pytest.approx(folded, rel=1e-3)}
    r.close()


@pytest.mark.parametrize("family, seed", [("gaia", 1), ("mtbench", 0)])
def test_agents_named_differently_by_two_replicas_meet_under_shared_names(redis_server, family, seed):
    """A replica names an agent after what it saw first, so two replicas can give one agent two
    local names; the shared state carries names derived from the prompts' content instead."""
    import collections

    from cachescout.bench.policies import CacheScoutReplay
    from cachescout.bench.replay import Engine, EngineConfig
    from cachescout.bench.workloads import WorkloadSpec, generate

    sessions = generate(WorkloadSpec(family=family, sessions=80, seed=seed))
    replicas = []
    for name, part in (("a", sessions[:40]), ("b", sessions[40:])):
        policy, shared = make(redis_server.url, name, half_life=200.0)
        replay = CacheScoutReplay(PolicyConfig())
        replay.core = policy
        policy.clock = lambda replay=replay: replay.now
        Engine(EngineConfig(gpu_blocks=3000), replay).run(part)
        seen = collections.defaultdict(collections.Counter)
        for req, obs in replay.observations:
            if obs.agent:
                seen[req.agent][obs.agent] += 1
        local = {agent: c.most_common(1)[0][0] for agent, c in seen.items()}
        replicas.append((policy, shared, local))
    (pa, sa, la), (pb, sb, lb) = replicas
    distinct = [a for a in la if a in lb and list(la.values()).count(la[a]) == 1 == list(lb.values()).count(lb[a])]
    assert any(la[a] != lb[a] for a in distinct)                    # one agent, two local names
    names_a, names_b = pa.shared_names(), pb.shared_names()
    assert all(names_a[la[a]] == names_b[lb[a]] for a in distinct)   # one shared name each
    own = pb.inspect().learner.effective_count(lb["supervisor"])
    for _ in range(2):
        for policy, shared in ((pa, sa), (pb, sb)):
            shared.note_names(policy)
            assert shared.sync_now()
            shared.on_step(policy)
    merged = pb.inspect().learner.effective_count(lb["supervisor"])
    assert merged > 1.5 * own     # b's supervisor row now holds a's supervisor transitions too


def test_deployments_and_models_on_one_redis_never_mix(redis_server):
    prod = make(redis_server.url, "a", deployment="prod")
    staging = make(redis_server.url, "a", deployment="staging")      # same replica name, other deployment
    settings = SharedStateSettings.from_mapping({"url": redis_server.url, "replica": "a", "deployment": "prod",
                                                 "model": "other-model"})
    other_policy = CacheScoutPolicy(PolicyConfig(transition_half_life=HALF_LIFE))
    other = SharedLearnedState(settings, half_life=HALF_LIFE, model="ignored", hash_domain="d0")
    other.attach(other_policy)
    learn(prod[0], [("x", "prod")], 3)
    learn(staging[0], [("x", "staging")], 2)
    learn(other_policy, [("x", "other")], 1)
    sync(prod, staging, (other_policy, other))
    assert counts(prod[0]) == {("x", "prod"): 3.0}
    assert counts(staging[0]) == {("x", "staging"): 2.0}
    assert counts(other_policy) == {("x", "other"): 1.0}
    assert prod[1].status()["generation"] == staging[1].status()["generation"] == 1   # no fencing across them


def test_data_parallel_ranks_of_one_pod_write_apart(redis_server):
    """Two schedulers of one pod (vLLM data-parallel ranks) are two writers, not one fenced by the other."""
    settings = SharedStateSettings.from_mapping({"url": redis_server.url, "replica": "pod-0", "deployment": "dp"})
    ranks = []
    for rank in range(2):
        policy = CacheScoutPolicy(PolicyConfig(transition_half_life=HALF_LIFE))
        shared = SharedLearnedState(settings, half_life=HALF_LIFE, model="m", hash_domain="d0",
                                    replica_suffix=f"-dp{rank}")
        shared.attach(policy)
        learn(policy, [("x", f"rank{rank}")], 2)
        ranks.append((policy, shared))
    sync(*ranks)
    assert not any(s.superseded for _, s in ranks)
    assert counts(ranks[0][0]) == counts(ranks[1][0]) == {("x", "rank0"): 2.0, ("x", "rank1"): 2.0}


# -- hardening: what a broken or hostile Redis must not do --------------------------------------------
def test_a_round_that_fails_unexpectedly_never_raises_and_the_thread_lives_on(redis_server, monkeypatch, caplog):
    a = make(redis_server.url, "a", flush_interval_s=0.05, fold_after_s=1)
    learn(a[0], [("x", "y")])

    def broken(self, read):
        raise ValueError("a defect")
    monkeypatch.setattr(SharedLearnedState, "_round", broken)
    monkeypatch.setattr(SharedLearnedState, "_failed", lambda self, exc: (_ for _ in ()).throw(KeyError(exc)))
    with caplog.at_level(logging.ERROR, "cachescout.shared_state"):
        assert a[1].sync_now() is False
        a[1].start()
        time.sleep(0.3)
        assert a[1]._thread.is_alive()
    assert a[1].stats["internal_errors"] >= 3 and a[1].status()["degraded"] == 1
    assert sum("failed unexpectedly" in r.message for r in caplog.records) == 1   # logged once
    a[1].close()                                       # never raises: vLLM's shutdown goes on
    assert len(a[1]._ops) == 0 or a[1]._ops.maxlen <= 100_000


@pytest.mark.parametrize("key", ["meta", "replicas", "departed_at", "gen", "rep", "blob"])
def test_a_key_of_the_wrong_type_is_repaired_and_sharing_resumes(redis_server, key, caplog):
    a, b = make(redis_server.url, "a"), make(redis_server.url, "b")
    learn(a[0], [("x", "y")], 2)
    learn(b[0], [("x", "z")], 1)
    sync(a, b)
    k = a[1].keys
    target = {"meta": k.meta, "replicas": k.replicas, "departed_at": k.departed_at,
              "gen": k.gen("a"), "rep": k.rep("a"), "blob": k.blob("a")}[key]
    r = redis.Redis.from_url(redis_server.url)
    r.delete(target)
    r.rpush(target, "someone", "else's")              # a list where CacheScout keeps a hash/zset/string
    from cachescout.connector.state_admin import collect
    shown = collect(a[1]._store, 3600.0)             # `state show` works, and names the bad key
    if key in ("rep", "blob"):
        assert any(x["name"] == "a" for x in shown["rejected"])
    elif key != "gen":                               # (a generation is not part of what show reads)
        assert shown["wrong_type"] == {target: "list"}
    with caplog.at_level(logging.WARNING, "cachescout.shared_state"):
        for _ in range(3):
            a[1].sync_now()
            b[1].sync_now()
    if key != "blob":                                # (a's next flush overwrites its own blob whatever it held)
        assert a[1].stats["repaired_keys"] + b[1].stats["repaired_keys"] >= 1
        assert any("held a Redis list" in rec.message for rec in caplog.records)
    time.sleep(0.6)                                   # past a breaker cool-down, if one opened
    sync(a, b)
    a[0].learn_transition("x", "y")
    sync(a, b)
    assert counts(b[0]) == {("x", "y"): 3.0, ("x", "z"): 1.0}
    assert a[1].status()["degraded"] == 0
    r.close()


def test_state_reset_repairs_wrong_typed_keys(redis_server):
    a = make(redis_server.url, "a")
    learn(a[0], [("x", "y")])
    sync(a)
    k = a[1].keys
    r = redis.Redis.from_url(redis_server.url)
    for key in (k.meta, k.gen("a"), k.gen("ghost")):
        r.delete(key)
        r.sadd(key, "x")
    a[1]._store.reset("fresh2")
    assert all(r.type(key) in (b"none", b"hash", b"string") for key in (k.meta, k.gen("a"), k.gen("ghost")))
    time.sleep(0.6)
    for _ in range(3):
        a[1].sync_now()
    assert a[1].sync_now() and a[1].status()["degraded"] == 0
    r.close()


@pytest.mark.parametrize("score", ["+inf", "-inf"])
def test_a_departed_entry_stamped_at_infinity_is_dropped(redis_server, score):
    a = make(redis_server.url, "a")
    learn(a[0], [("x", "y")])
    sync(a)
    k = a[1].keys
    r = redis.Redis.from_url(redis_server.url)
    r.set(k.departed("ghost#1"), b"junk")
    r.execute_command("ZADD", k.departed_at, score, "ghost#1")
    from cachescout.connector.state_admin import collect
    assert any(x["name"] == "ghost#1" for x in collect(a[1]._store, 3600.0)["rejected"])
    assert a[1].sync_now() and a[1].sync_now()
    assert r.zscore(k.departed_at, "ghost#1") is None and not r.exists(k.departed("ghost#1"))
    r.close()


def test_a_huge_meta_value_stays_out_of_logs_and_status(redis_server, caplog):
    r = redis.Redis.from_url(redis_server.url)
    keys = StateKeys("test", "m")
    r.hset(keys.meta, mapping={"schema": SCHEMA, "half_life": "x" * 50_000_000, "hash_domain": "d0", "epoch": "e"})
    a = make(redis_server.url, "a", timeout_s=5.0)    # (moving 50 MB takes a while on this machine)
    with caplog.at_level(logging.WARNING, "cachescout.shared_state"):
        assert not a[1].sync_now()
    assert a[1].problem is not None and "half_life" in a[1].problem and len(a[1].problem) < 1000
    assert max(len(rec.getMessage()) for rec in caplog.records) < 2000
    r.close()


def _getranges(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_getrange", {}).get("calls", 0))


@pytest.mark.parametrize("isolated", [True, False], ids=["helper", "in-process"])
def test_a_refused_entry_is_not_fetched_or_decoded_again_until_it_changes(redis_server, isolated):
    a = make(redis_server.url, "a", isolated_reader=isolated)
    learn(a[0], [("x", "y")])
    sync(a)
    k = a[1].keys
    r = redis.Redis.from_url(redis_server.url)
    now = int(time.time() * 1000)
    plant(r, k, "evil", b"\x90" * 300_000, gen=1, seq=1, at=now)
    r.zadd(k.replicas, {"evil": now})
    before = _getranges(r)
    for _ in range(3):
        assert a[1].sync_now()
    fetched = _getranges(r) - before       # (in parts of 256 KiB: two)
    assert fetched == 2 and a[1].stats["rejected_blobs"] == 1
    r.hset(k.rep("evil"), "seq", 2)                  # rewritten: looked at again, once
    for _ in range(2):
        assert a[1].sync_now()
    assert _getranges(r) - before == 2 * fetched and a[1].stats["rejected_blobs"] == 2
    assert (a[1]._reader is not None) == isolated
    a[1].close(final_flush=False)
    r.close()


def test_an_entry_rewritten_every_round_is_logged_once_and_counted_each_time(redis_server, caplog):
    a = make(redis_server.url, "a")
    sync(a)
    k = a[1].keys
    r = redis.Redis.from_url(redis_server.url)
    with caplog.at_level(logging.WARNING, "cachescout.shared_state"):
        for seq in range(1, 6):
            now = int(time.time() * 1000)
            plant(r, k, "evil", b"junk", gen=1, seq=seq, at=now)
            r.zadd(k.replicas, {"evil": now})
            assert a[1].sync_now()
    assert a[1].stats["rejected_blobs"] == 5
    assert sum("'evil'" in rec.getMessage() for rec in caplog.records) == 1
    r.close()


def test_the_hostile_benchmark_measures_every_shape_and_each_is_refused(redis_server):
    # `python -m cachescout.bench.state_bench --sections hostile`, scaled down: each shape written
    # by another process and refused by the replica every round; the baselines refuse nothing.
    from cachescout.bench import state_bench

    logging.getLogger("cachescout.shared_state").setLevel(logging.ERROR)
    try:
        rows = state_bench.hostile(redis_server.url, entries=2, size=64 * 1024, seconds=0.2,
                                   apart=state_bench.can_run_apart())
    finally:
        logging.getLogger("cachescout.shared_state").setLevel(logging.NOTSET)
    shapes = [r["shape"] for r in rows]
    assert shapes[:2] == ["none", "decoys"] and set(shapes[2:]) == set(state_bench.hostile_blobs(1024))
    for r in rows:
        assert r["rounds"] > 0 and r["steps"] > 0 and r["step_max_ms"] >= r["step_p99_ms"] >= r["step_p50_ms"]
        assert r["lock_wait_max_ms"] <= r["step_max_unqueued_ms"] + 1e-9
        assert r["step_max_less_gc_ms"] <= r["step_max_ms"] + 1e-9 and r["gc_max_ms"] >= 0.0
        # ("distinct cells" is a valid snapshot, refused only beyond the cell limit: at 4 MiB, not here)
        if r["shape"] != "distinct cells":
            assert (r["rejected"] >= r["rounds"]) == (r["shape"] not in ("none", "decoys")), r
    table = "\n".join(state_bench._hostile_table({"hostile": rows}))
    assert table.count("\n| ") == len(rows) + 1
    some = state_bench.hostile(redis_server.url, entries=1, size=64 * 1024, seconds=0.1, shapes=["none", "empty maps"])
    assert [r["shape"] for r in some] == ["none", "empty maps"] and "back to back for 0.1 s" in "\n".join(
        state_bench._hostile_table({"hostile": some}))
    alone = state_bench.hostile(redis_server.url, entries=1, size=64 * 1024, seconds=0.1, shapes=["alone"])
    assert [(r["shape"], r["rounds"]) for r in alone] == [("alone", 0)] and alone[0]["steps"] > 0
    with pytest.raises(SystemExit):
        state_bench.main(["--sections", "hostile", "--hostile-shapes", "empty arrays,nosuch"])


@pytest.mark.parametrize("isolated", [True, False], ids=["helper", "in-process"])
def test_a_round_never_holds_every_peers_bytes_at_once(redis_server, isolated):
    # Eight hostile peers of 1 MiB each: fetched all at once, a round held 8 MiB of parts, faulted
    # in and handed back to the kernel each round with the interpreter lock held (waits of up to
    # 17 ms for vLLM's scheduler thread). Read in this process, fetched as they come up and freed
    # once decoded, a round holds about one peer's bytes; read by the helper, none of them.
    import tracemalloc

    from cachescout.bench.state_bench import hostile_blobs
    a = make(redis_server.url, "a", isolated_reader=isolated)
    learn(a[0], [("x", "y")])
    sync(a)
    k = a[1].keys
    r = redis.Redis.from_url(redis_server.url)
    blob = hostile_blobs(1 << 20)["empty arrays"]
    now = int(time.time() * 1000)
    for i in range(8):
        plant(r, k, f"evil-{i}", blob, gen=1, seq=1, at=now)
        r.zadd(k.replicas, {f"evil-{i}": now})
    tracemalloc.start()
    try:
        assert a[1].sync_now()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert a[1].stats["rejected_blobs"] == 8
    if isolated:
        assert peak < len(blob) // 2, peak     # the index and verdicts (about 0.26 MiB), none of the 8 MiB
    else:
        assert peak < 3 * len(blob), peak      # one peer's parts and what decoding them builds
    a[1].close(final_flush=False)
    r.close()


# -- the helper process that reads peers' entries ------------------------------------------------------
def _alive(pid: int) -> bool:
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:      # a zombie is gone too (not reaped yet)
        return f.read().split(")")[-1].split()[0] != "Z"


def test_peers_are_read_by_a_helper_process_that_restarts_when_killed_and_ends_with_the_state(redis_server):
    import os
    import signal
    a, b = make(redis_server.url, "a"), make(redis_server.url, "b")
    learn(a[0], [("x", "y")], 4)
    learn(b[0], [("x", "z")], 2)
    sync(a, b)
    assert counts(a[0]) == {("x", "y"): 4.0, ("x", "z"): 2.0}
    pid = a[1]._reader.pid
    assert pid is not None and pid != os.getpid() and _alive(pid) and a[1].stats["reader_starts"] == 1
    os.kill(pid, signal.SIGKILL)              # the helper dies between rounds (OOM killer, say)
    learn(b[0], [("x", "z")], 3)
    assert not a[1].sync_now() or a[1].stats["reader_starts"] == 2   # this round, or the next, restarts it
    sync(b, a)
    assert counts(a[0]) == {("x", "y"): 4.0, ("x", "z"): 5.0}
    assert a[1].stats["reader_starts"] == 2 and a[1]._reader.pid != pid
    pid = a[1]._reader.pid
    a[1].close()
    assert not _alive(pid) and a[1]._reader is None
    b[1].close()


def test_a_helper_that_hangs_is_killed_at_its_deadline_and_the_round_fails_quietly(tmp_path):
    import sys

    from cachescout.connector.peer_reader import PeerReader, PeerReaderError
    hangs = tmp_path / "hangs.py"
    hangs.write_text("import sys, time\nsys.stdin.buffer.read(4)\ntime.sleep(60)\n")
    reader = PeerReader({}, deadline_s=0.3, command=[sys.executable, str(hangs)])
    t0 = time.monotonic()
    with pytest.raises(PeerReaderError, match="did not start"):
        reader.exchange({"peers": []})
    assert reader.failed_starts == 1 and reader.pid is None
    answers_late = tmp_path / "late.py"
    answers_late.write_text(
        "import sys, time, msgpack\n"
        "def send(b):\n    sys.stdout.buffer.write(len(b).to_bytes(4, 'big') + b); sys.stdout.buffer.flush()\n"
        "n = int.from_bytes(sys.stdin.buffer.read(4), 'big'); sys.stdin.buffer.read(n)\n"
        "send(msgpack.packb({'ready': True}))\n"
        "n = int.from_bytes(sys.stdin.buffer.read(4), 'big'); sys.stdin.buffer.read(n)\n"
        "time.sleep(60)\n")
    reader = PeerReader({}, deadline_s=0.3, command=[sys.executable, str(answers_late)])
    with pytest.raises(PeerReaderError, match="did not answer in time"):
        reader.exchange({"peers": []})
    assert reader.pid is None and reader.failed_starts == 0
    assert time.monotonic() - t0 < 10          # two starts and two deadlines of 0.3 s, not a minute's sleep


def test_where_no_helper_can_start_peers_are_read_in_this_process(redis_server, caplog):
    from cachescout.connector.peer_reader import PeerReader
    a, b = make(redis_server.url, "a"), make(redis_server.url, "b")
    learn(b[0], [("x", "z")], 2)
    sync(b)
    a[1]._reader = PeerReader({}, deadline_s=1.0, command=["/nonexistent/python"])
    with caplog.at_level(logging.WARNING, "cachescout.shared_state"):
        for _ in range(3):
            assert not a[1].sync_now()        # counted as failed rounds, never raised
            a[1].breaker.success()            # (the breaker would pace the retries)
    assert "reading peers' entries in this process from now on" in caplog.text
    assert "could not be started (FileNotFoundError" in caplog.text
    assert a[1].stats["reader_fallbacks"] == 1 and a[1]._reader is None
    sync(a)
    assert counts(a[0]) == {("x", "z"): 2.0}
    a[1].close()
    b[1].close()


def test_closing_while_a_round_runs_leaves_no_helper_behind(redis_server):
    import threading
    a, b = make(redis_server.url, "a", flush_interval_s=0.05, fold_after_s=1.0), make(redis_server.url, "b")
    learn(b[0], [("x", "z")], 2)
    sync(b)
    a[1].start()                              # rounds back to back in the background thread
    deadline = time.monotonic() + 10
    while a[1]._reader is None or a[1]._reader.pid is None:
        assert time.monotonic() < deadline, a[1].status()
        time.sleep(0.01)
    pid = a[1]._reader.pid
    a[1].close()
    assert a[1]._reader is None and not _alive(pid)
    assert not [t for t in threading.enumerate() if t.name == "cachescout-state"]
    b[1].close()
