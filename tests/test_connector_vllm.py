"""CacheScoutConnector inside vLLM's real v1 Scheduler, KVCacheManager and BlockPool (on CPU).

The scheduler is vLLM's own, loaded with the connector through `kv_transfer_config`; only the
model is replaced, by hand-made `ModelRunnerOutput`s carrying each call's recorded output tokens
(no GPU here). Importing vLLM costs about 8 s, so runs are shared per module.
"""

import subprocess
import sys

import pytest
from pathlib import Path

from cachescout.bench.policies import make_policy
from cachescout.bench.replay import Engine, EngineConfig
from cachescout.bench.run import calibrate_gpu_blocks
from cachescout.bench.vllm_replay import VllmReplay, build_scheduler
from cachescout.bench.workloads import WorkloadSpec, generate
from cachescout.connector import CacheScoutConnector
from cachescout.policy import ConfigError, PolicyConfig


@pytest.fixture(scope="module")
def short_workload():
    sessions = generate(WorkloadSpec(family="gsm8k", sessions=40, rate=2.0, seed=1))
    return sessions, EngineConfig(gpu_blocks=calibrate_gpu_blocks(sessions, 16))


@pytest.fixture(scope="module")
def runs(short_workload):
    """The same sessions and cache size on both engines, with and without CacheScout."""
    sessions, cfg = short_workload
    out = {}
    for policy in ("lru", "cachescout"):
        fast = Engine(cfg, make_policy(policy, PolicyConfig())).run(sessions).summary()
        replay = VllmReplay(cfg, policy)
        out[policy] = (fast, replay, replay.run(sessions))
    return out


def test_loaded_through_kv_transfer_config():
    sched = build_scheduler(64, connector={})
    assert isinstance(sched.connector, CacheScoutConnector)
    assert sched.connector.steering.pool is sched.kv_cache_manager.block_pool
    assert build_scheduler(64).connector is None


def test_vllm_reads_requires_kv_delivery_as_false():
    """vLLM declares it a property and stores what it reads; a method would be a truthy flag, and vLLM
    would drop a preempted request's output as if CacheScout had KV to hand off."""
    sched = build_scheduler(64, connector={})
    assert sched.requires_kv_delivery is False
    assert sched.connector.requires_kv_delivery is False


def test_multiconnector_rebuilds_cachescout_stats_once_vllms_plugins_have_run():
    """Beside LMCache, MultiConnector looks CacheScout up in vLLM's registry by name to rebuild its
    stats from the plain dict they cross processes as; vLLM runs our plugin entry point first. A
    fresh interpreter, as a vLLM process is: nothing else registered it."""
    code = ("from importlib.metadata import entry_points\n"
            "eps = [e.value for e in entry_points(group='vllm.general_plugins')]\n"
            "assert 'cachescout.connector.vllm_plugin:register' in eps, eps\n"
            "from vllm.plugins import load_general_plugins\n"
            "load_general_plugins()\n"
            "from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector\n"
            "stats = MultiConnector.build_kv_connector_stats({'CacheScoutConnector': {'requests': 3, 'steps': 2}})\n"
            "child = stats.data['CacheScoutConnector']\n"
            "print(type(child).__name__, child.reduce()['requests'])\n"
            "load_general_plugins.__globals__['plugins_loaded'] = False\n"
            "load_general_plugins()  # run again (vLLM may): no error\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["CacheScoutStats", "3"]


def test_connector_raises_prefix_cache_hits(runs):
    lru = runs["lru"][2].summary()
    ours = runs["cachescout"][2].summary()
    assert lru["calls"] == ours["calls"] > 300
    assert ours["gpu_token_hit_rate"] > lru["gpu_token_hit_rate"] + 0.01
    stats = runs["cachescout"][2].connector_stats
    assert stats["steered_blocks"] > 0 and stats["evictions_seen"] > 0
    assert stats["recognised"] >= 0.9 * stats["requests"]


@pytest.mark.parametrize("policy", ["lru", "cachescout"])
def test_engines_agree_within_two_points(runs, policy):
    fast, _, result = runs[policy]
    assert abs(fast["gpu_token_hit_rate"] - result.summary()["gpu_token_hit_rate"]) <= 0.02


@pytest.mark.parametrize("policy", ["lru", "cachescout"])
def test_pool_ends_all_free_and_unpinned(runs, policy):
    replay = runs[policy][1]
    assert replay.pool_all_free()
    pool = replay.scheduler.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)


def test_mirror_holds_every_block_vllm_caches(runs):
    """Prompt blocks are filed at allocation, decode-filled ones when their request finishes: at the
    end of the run every block in vLLM's prefix cache is known to the policy, under a named group."""
    from cachescout.policy import block_keys

    replay = runs["cachescout"][1]
    pool = replay.scheduler.kv_cache_manager.block_pool
    cached = set(block_keys([b.block_hash for b in pool.blocks if b.block_hash is not None]))
    index = replay.connector.policy.inspect().index
    assert len(cached) > 500
    assert not [key for key in cached if key not in index]
    assert all(index.block(key).group is not index.default_group for key in cached)


def test_every_requests_counts_reach_vllm_by_the_time_the_server_goes_idle(runs):
    """Reports are throttled to about one a second, but an idle server takes no steps: the report
    after the last request in flight finished must carry what the throttle held back."""
    replay = runs["cachescout"][1]
    policy = replay.connector.policy
    assert replay.reported_stats["requests"] == policy.stats["requests"] == runs["cachescout"][2].summary()["calls"]
    assert replay.reported_stats["steps"] == replay.connector.scheduler_side.steps


def test_stats_reach_vllm_as_connector_stats(runs):
    connector = runs["cachescout"][1].connector
    connector.scheduler_side.report.restart()   # the report is throttled to once a second
    stats = connector.get_kv_connector_stats()
    assert stats is not None and not stats.is_empty()
    reduced = stats.reduce()
    assert reduced["steps"] > 0 and reduced["decision_us_per_step"] > 0
    assert 0 < reduced["prediction_accuracy"] <= 1
    # The guard's comparison with plain LRU: what an operator reads to see the order's effect.
    guard = connector.policy.guard_counters()
    assert 0 < reduced["guard_compared"] == guard["guard_compared"]
    assert reduced["guard_hits"] == guard["guard_hits"] and reduced["guard_lru_hits"] == guard["guard_lru_hits"]
    assert reduced["guard_gain"] == round((guard["guard_hits"] - guard["guard_lru_hits"]) / guard["guard_compared"], 4)
    merged = type(connector).build_kv_connector_stats(dict(stats.data)).aggregate(stats)
    assert merged.data["steps"] == 2 * stats.data["steps"]


@pytest.mark.parametrize("where", ["step", "finished"])
def test_steering_failure_falls_back_to_vllm_order(short_workload, caplog, where):
    """A failure in the step's work or in a finished request's filing: vLLM carries on in its own
    order, and the connector stops queueing events nobody will drain."""
    sessions, cfg = short_workload
    replay = VllmReplay(cfg, "cachescout")
    steering = replay.connector.steering
    calls = {"n": 0}

    class Flaky:
        """The steering, failing once in `where` (a compiled class cannot be patched in place)."""

        def __getattr__(self, name):
            real = getattr(steering, name)
            if name != where:
                return real

            def flaky(*args):
                calls["n"] += 1
                if calls["n"] == 20:
                    raise RuntimeError("injected")
                return real(*args)
            return flaky

    replay.connector.scheduler_side.steering = Flaky()
    result = replay.run(sessions[:10])
    assert calls["n"] == 20                     # never called again after the failure
    assert len(result.calls) == sum(len(s.calls) for s in sessions[:10])
    assert replay.pool_all_free()
    assert "steering failed" in caplog.text
    assert not steering._new and not steering._allocated and not steering._hit_tokens


def test_hints_from_kv_transfer_params():
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    sched = build_scheduler(256, connector={})
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    params = [{"cachescout.agent": "coder"}, {"cachescout.agent": ""}]
    for i, kv in enumerate(params):
        sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": kv})
        sched.add_request(Request(f"r{i}", list(range(i, 64 + i)), sp, None, block_hasher=hasher))
    sched.schedule()
    policy = sched.connector.policy
    assert sched.connector.steering.stats["bad_hints"] == 1
    assert "coder" in policy.inspect().learner.agents()


def test_room_for_waiting_requests_counts_only_their_uncached_blocks():
    """The steering prepares room for a waiting request's blocks past its prefix hit: its count of
    cached leading blocks matches vLLM's own prefix-cache lookup."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from cachescout.policy import block_keys

    sched = build_scheduler(256, connector={})
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    sp = SamplingParams(max_tokens=1)
    sched.add_request(Request("first", list(range(100, 164)), sp, None, block_hasher=hasher))
    sched.schedule()   # allocates and caches its 4 full blocks; the connector files them
    steering = sched.connector.steering
    prompts = {"shares 3": list(range(100, 148)) + list(range(900, 932)), "shares 0": list(range(500, 580)),
               "repeats": list(range(100, 164)) + [7]}
    for name, tokens in prompts.items():
        req = Request(name, tokens, sp, None, block_hasher=hasher)
        hit_tokens = sched.kv_cache_manager.get_computed_blocks(req)[1]
        assert steering._cached_prefix(block_keys(req.block_hashes)) == hit_tokens // 16, name
    assert hit_tokens == 64


@pytest.mark.parametrize("extra, field", [
    ({"bogus": 1}, "bogus"),
    ({"steer_ahead_blocks": -1}, "steer_ahead_blocks"),
    ({"steer_gpu": "on"}, "steer_gpu"),
    ({"policy": {"transition_half_life": "fast"}}, "transition_half_life"),
])
def test_bad_config_fails_when_vllm_builds_the_connector(extra, field):
    with pytest.raises(ConfigError, match=field):
        build_scheduler(64, connector=extra)


def test_bad_config_exits_the_process():
    """A bad setting ends the process with the message; nothing is left hanging."""
    code = ("from cachescout.bench.vllm_replay import build_scheduler\n"
            "build_scheduler(64, connector={'steer_ahead_blocks': 0})\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "steer_ahead_blocks" in proc.stderr and "ConfigError" in proc.stderr


def test_prometheus_counters_follow_the_stats(runs):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()

    def bound(cls):   # vLLM hands the metric classes in; these register into a private registry
        return lambda *a, **k: cls(*a, registry=registry, **{x: y for x, y in k.items() if x != "multiprocess_mode"})

    connector = runs["cachescout"][1].connector
    prom = type(connector).build_prom_metrics(
        connector._vllm_config, {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)},
        ["model_name", "engine"], {0: ["m", "0"]})
    connector.scheduler_side.report.restart()
    data = connector.get_kv_connector_stats().to_dict()
    prom.observe(data, 0)
    prom.observe(data, 0)
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:cachescout_requests_total", labels) == 2 * data["requests"]
    assert registry.get_sample_value("vllm:cachescout_gpu_hit_tokens_total", labels) == 2 * data["gpu_hit_tokens"]
    assert 0 < data["gpu_hit_tokens"] < data["prompt_tokens"]
    assert registry.get_sample_value("vllm:cachescout_fallback_to_lru", labels) == 0
    assert registry.get_sample_value("vllm:cachescout_guard_compared_total", labels) == 2 * data["guard_compared"] > 0
    # Workers' counts (summed by vLLM into the same stats) and the shared state's level.
    prom.observe({"cpu_no_evictable": 3, "prefetch_chunks_loaded": 20, "state_degraded": 1}, 0)
    assert registry.get_sample_value("vllm:cachescout_cpu_no_evictable_total", labels) == 3
    assert registry.get_sample_value("vllm:cachescout_prefetch_chunks_loaded_total", labels) == 20
    assert registry.get_sample_value("vllm:cachescout_shared_state_degraded", labels) == 1
    prom.observe({"state_degraded": 0}, 0)
    assert registry.get_sample_value("vllm:cachescout_shared_state_degraded", labels) == 0


def test_workers_get_agent_scores_for_the_lmcache_tier(short_workload):
    from lmcache.v1.storage_backend.cache_policy import POLICY_MAPPING
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from cachescout.connector import lmcache_tier
    from cachescout.connector.lmcache_tier import CacheScoutCachePolicy

    sessions, cfg = short_workload
    replay = VllmReplay(cfg, "cachescout")
    sent = []
    real = replay.connector.build_connector_meta

    prefetch = []

    def spy(out):
        meta = real(out)
        if meta.agent_scores is not None:
            sent.append(meta.agent_scores)
            prefetch.extend(meta.prefetch)
        return meta
    replay.connector.build_connector_meta = spy
    replay.run(sessions)
    assert 0 < len(sent) < replay.scheduler.connector.scheduler_side.steps   # only when rescored, not every step
    assert any(sent) and all(0.0 <= p <= 1.0 for scores in sent for p in scores.values())
    # Anchors of agents predicted next go to the workers for prefetching, not on every rescoring.
    assert 0 < len(prefetch) < len(sent) * 6
    assert all(tokens and len(tokens) % 16 == 0 and configs == {} for tokens, configs in prefetch)

    worker = CacheScoutConnector(replay.connector._vllm_config, KVConnectorRole.WORKER,
                                 replay.scheduler.kv_cache_config)
    assert POLICY_MAPPING["CACHESCOUT"] is CacheScoutCachePolicy
    try:
        worker.bind_connector_metadata(type(replay.connector.build_connector_meta(
            replay.scheduler.schedule()))({"coder": 0.75}))
        assert dict(lmcache_tier.RANKING.scores()) == {"coder": 0.75}
    finally:
        lmcache_tier.RANKING.update({})
    worker.shutdown()


def test_steer_gpu_false_observes_but_leaves_vllms_order(runs, short_workload):
    sessions, cfg = short_workload
    replay = VllmReplay(cfg, "cachescout", {"steer_gpu": False})
    result = replay.run(sessions)
    lru = runs["lru"][2]
    assert [c.hit_tokens for c in result.calls] == [c.hit_tokens for c in lru.calls]   # exactly vLLM's LRU
    stats = replay.connector.policy.stats
    assert stats["requests"] == len(result.calls) and stats["recognised"] > 0.9 * stats["requests"]
    assert replay.connector.steering.stats["steered_blocks"] == 0


def test_preemptions_keep_the_mirror_exact():
    """A cache so small that vLLM preempts requests (and recomputes them): steering carries on."""
    sessions = generate(WorkloadSpec(family="swebench", sessions=30, rate=4.0, seed=2))
    replay = VllmReplay(EngineConfig(gpu_blocks=1200), "cachescout")
    result = replay.run(sessions)
    assert result.preemptions > 0
    assert not replay.connector.scheduler_side.failed and replay.connector.steering.stats["steered_blocks"] > 0
    assert replay.pool_all_free()
    assert len(result.calls) == sum(len(s.calls) for s in sessions)


def test_replicas_share_what_they_learned_through_redis(short_workload, redis_server):
    """Two connectors on vLLM's scheduler, one after the other: the second starts from the first's
    transitions (read from a real redis-server by its background thread) before its own traffic."""
    import time

    sessions, cfg = short_workload
    shared = {"url": redis_server.url, "deployment": "ci", "flush_interval_s": 0.05, "fold_after_s": 30}
    first = VllmReplay(cfg, "cachescout", {"shared_state": {**shared, "replica": "first"}})
    first.run(sessions[:20])
    learned = sum(c for _, _, c in first.connector.policy.transitions())
    assert learned >= 50
    first.connector.shutdown()                       # the final flush
    second = VllmReplay(cfg, "cachescout", {"shared_state": {**shared, "replica": "second"}})
    state = second.connector.scheduler_side.shared
    deadline = time.monotonic() + 10
    while state.stats["merges"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    result = second.run(sessions[20:24])
    assert state.stats["installs"] >= 1
    # Its model holds the first replica's counts beside its own (agents it has not seen yet are left
    # out until it has: their shared names cannot be mapped to its own names before). The first's
    # counts in a merged model decay with each of this replica's transitions after that merge was
    # built, so how much is left depends on when the background thread last merged (on a busy
    # machine, early): measure a merge built now, installed as the next scheduler step would.
    assert state.sync_now() and state.on_step(second.connector.policy)
    with state._lock:
        state._drain()                         # own counts up to the last update
    own = sum(c for _, _, c in state._shadow.edges())
    merged = sum(c for _, _, c in second.connector.policy.transitions())
    assert merged - own >= 0.5 * learned, (merged, own, learned)
    assert len(result.calls) > 0 and state.stats["flush_ok"] >= 1 and state.status()["degraded"] == 0
    reported = second.connector.scheduler_side.report.last   # what vLLM has collected for its metrics so far
    assert reported["state_flushes"] >= 1 and reported["state_merges"] >= 1 and reported["state_errors"] == 0
    second.connector.shutdown()
    assert second.pool_all_free()


def test_bad_shared_state_settings_fail_when_vllm_builds_the_connector():
    with pytest.raises(ConfigError, match=r"shared_state\.flush_interval_s"):
        build_scheduler(64, connector={"shared_state": {"url": "redis://h:1", "flush_interval_s": 0}})


def test_lower_tiers_modelled_beside_the_connector_agree_with_the_fast_replay(short_workload):
    """`--engine vllm` with LMCache's CPU and Redis tiers modelled by a connector beside ours (in
    vLLM's MultiConnector): vLLM's scheduler takes the tiers' tokens as external hits, and the hit
    rate over all tiers agrees with the fast replay's on the same run."""
    import dataclasses

    sessions, cfg = short_workload
    cfg = dataclasses.replace(cfg, cpu_blocks=cfg.gpu_blocks // 2, redis_blocks=cfg.gpu_blocks)
    # Inside vLLM CacheScout prefetches into LMCache's CPU tier, not into the GPU: its fast-replay
    # counterpart is the policy without GPU prefetch.
    for policy, fast_policy in (("lmcache-lru", "lmcache-lru"), ("cachescout", "cachescout-noprefetch")):
        fast = Engine(cfg, make_policy(fast_policy, PolicyConfig(), sessions)).run(sessions).summary()
        replay = VllmReplay(cfg, policy)
        assert (replay.connector is not None) == (policy == "cachescout") and replay.tiers is not None
        if replay.connector is not None:   # it follows LMCache's CPU tier at the tier's size
            cpu_tier = replay.connector.steering.cpu_tier
            assert cpu_tier is not None and cpu_tier.tier.capacity == cfg.cpu_blocks
        got = replay.run(sessions).summary()
        assert got["cpu_token_hit_rate"] + got["redis_token_hit_rate"] > 0.01, got
        if replay.connector is not None:
            assert len(cpu_tier.tier.keys) == cfg.cpu_blocks   # full: the run stored more than it holds
            # The LRU guard prices misses by that model's copies: it follows them block for block.
            guard = replay.connector.scheduler_side.policy.inspect().guard
            sampled = {k for k in cpu_tier.tier.keys if not hash(k) % guard.sample}
            assert {k for k in guard._backed if not hash(k) % guard.sample} == sampled != set()
        assert got["token_hit_rate"] > got["gpu_token_hit_rate"]
        assert abs(got["token_hit_rate"] - fast["token_hit_rate"]) <= 0.02, (policy, got, fast)
        assert replay.pool_all_free()
    with pytest.raises(ValueError, match="with lower tiers"):
        VllmReplay(cfg, "lru")


def test_on_vllms_scheduler_a_queued_calls_cpu_copy_is_held_beside_cachescout_only():
    """The modelled tiers hold a queued request's CPU prefix from vLLM's `on_new_request` to its
    allocation when CacheScout runs beside them, as the fast replay does (test_trace.py has the
    scenario: a call queued while two other prompts are stored over its copy)."""
    from helpers import queued_behind_two_stores

    cfg = EngineConfig(gpu_blocks=8, block_size=16, cpu_blocks=8)
    got = {}
    for policy in ("lmcache-lru", "cachescout"):
        replay = VllmReplay(cfg, policy)
        assert replay.tiers is not None and replay.tiers.hold_queued == (policy == "cachescout")
        got[policy] = replay.run(queued_behind_two_stores()).summary()["cpu_token_hit_rate"]
        assert not replay.tiers._held   # every hold released
    assert got == {"lmcache-lru": 0.0, "cachescout": 64 / 304}


def test_a_trace_replays_on_vllms_scheduler_with_tokens_made_from_its_ids(short_workload, tmp_path):
    """`--engine vllm --trace`: vLLM hashes tokens, a trace names blocks by id; tokens made from the
    ids give vLLM's scheduler the trace's block equalities. LRU agrees with the fast replay, and
    CacheScout with its hash-only twin (ids cannot link one workflow's calls across agents)."""
    from cachescout.bench.trace import export_trace, read_trace

    sessions, cfg = short_workload
    unbounded = Engine(EngineConfig(gpu_blocks=1 << 30), make_policy("lru", PolicyConfig())).run(sessions)
    export_trace(unbounded, tmp_path / "t.jsonl", cfg.block_size)
    traced, report = read_trace(tmp_path / "t.jsonl", block_size=cfg.block_size)
    assert report.skipped == 0 and traced[0].calls[0].prompt_tokens() is None
    for policy, twin in (("lru", "lru"), ("cachescout", "cachescout-hashonly")):
        fast = Engine(cfg, make_policy(twin, PolicyConfig(), traced)).run(traced).summary()
        replay = VllmReplay(cfg, policy)
        got = replay.run(traced).summary()
        assert got["calls"] == fast["calls"] == sum(len(s.calls) for s in sessions)
        assert abs(got["gpu_token_hit_rate"] - fast["gpu_token_hit_rate"]) <= 0.02, (policy, got, fast)
        assert replay.pool_all_free()


def test_tokens_made_from_trace_ids_keep_the_traces_equalities():
    from cachescout.bench.trace import TraceCall

    def call(ids, n, out_ids=(), out=0, line=1):
        return TraceCall(None, tuple(ids), n, out, 0.0, 16, tuple(out_ids), line=line)

    a_prompt, a_out = call([1, 2, 3], 40, out_ids=[7, 8], out=20).synthetic_tokens()
    assert len(a_prompt) == 40 and len(a_out) == 20
    # A later call repeating that prompt and output (ids and all) starts with the same tokens.
    b_prompt, _ = call([1, 2, 7, 8, 9], 70, line=2).synthetic_tokens()
    assert b_prompt[:60] == (a_prompt + a_out)[:60]
    # Equal ids, equal blocks; other ids, other blocks; unnamed content is this record's own.
    c_prompt, c_out = call([1, 5], 32, out=16, line=3).synthetic_tokens()
    assert c_prompt[:16] == a_prompt[:16] and c_prompt[16:32] != a_prompt[16:32]
    assert c_out != call([1, 5], 32, out=16, line=4).synthetic_tokens()[1]


def test_trace_sessions_without_think_times_and_conversations_replay_on_vllms_scheduler():
    """Open-loop sessions (a `session_id`, no `think_ms`) keep their ids, and each call gets a request
    id of its own; a conversation file with sub-agents runs there too, long prompts included."""
    import json as _json

    from cachescout.bench.trace import TraceOptions, load_trace, parse_trace

    lines = [_json.dumps({"timestamp": 10 * i, "input_length": 16 * (4 + i), "output_length": 3,
                          "hash_ids": list(range(1, 5 + i)), "block_size": 16, "session_id": "s"}) for i in range(6)]
    traced, _ = parse_trace(lines, block_size=16)
    assert len(traced) == 1 and traced[0].offsets_s
    cfg = EngineConfig(gpu_blocks=400)
    got = VllmReplay(cfg, "lru").run(traced).summary()
    fast = Engine(cfg, make_policy("lru", PolicyConfig(), traced)).run(traced).summary()
    assert got["calls"] == 6 and got["gpu_token_hit_rate"] == pytest.approx(fast["gpu_token_hit_rate"], abs=0.02)

    data = Path(__file__).parent / "data" / "claude-code" / "trace_0014.json.gz"
    sessions, _ = load_trace(data, TraceOptions())
    cfg = EngineConfig(gpu_blocks=6000, block_size=64)
    replay = VllmReplay(cfg, "cachescout")
    got = replay.run(sessions).summary()
    assert got["calls"] == sum(len(s.calls) for s in sessions) and got["gpu_token_hit_rate"] > 0.8
    assert replay.pool_all_free()


@pytest.mark.parametrize("served,expected", [("m1", "m1"), (["a", "b"], "a"), ([], "org/path"), (None, "org/path")])
def test_the_shared_state_keys_take_the_served_model_name(served, expected):
    from types import SimpleNamespace

    from cachescout.connector.vllm_connector import _model_name
    cfg = SimpleNamespace(model_config=SimpleNamespace(served_model_name=served, model="org/path"))
    assert _model_name(cfg) == expected


def _queued_request_hit(connector):
    """Inside vLLM's scheduler (one running request at a time): A and then D run and free their
    blocks; C runs and decodes while B, A's prompt continued, waits behind it. C's decode needs
    cached blocks evicted. Returns the tokens B hits when it is finally admitted."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    sched = build_scheduler(15, max_num_seqs=1, connector=connector)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)

    def request(rid, tokens, max_tokens=1):
        return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                       block_hasher=hasher)

    def step():
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        hit = {rid: sched.requests[rid].prefill_stats for rid in ids if sched.requests[rid].prefill_stats}
        sampled = [[] if sched.requests[r].is_prefill_chunk else [5] for r in ids]
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                        sampled_token_ids=sampled))
        return hit

    a = list(range(100, 164))
    for rid, tokens in (("A", a + [1]), ("D", list(range(1000, 1064)) + [1])):
        sched.add_request(request(rid, tokens))
        while sched.requests:
            step()
    sched.add_request(request("C", list(range(2000, 2065)), max_tokens=80))   # 5 blocks, 9 when done
    sched.add_request(request("B", a + list(range(3000, 3017))))
    hits = {}
    while sched.requests:
        hits.update({rid: s.num_local_cached_tokens for rid, s in step().items()})
    return hits["B"]


def test_a_queued_requests_cached_prefix_outlives_the_running_requests_decode():
    """vLLM's LRU evicts the oldest free blocks, A's, while B (which will hit them) waits; with
    CacheScout the blocks of a queued request go last, and D's are evicted instead."""
    assert _queued_request_hit(None) < 64
    assert _queued_request_hit({}) == 64


def test_every_report_carries_the_shared_state_level_until_it_clears(tmp_path):
    """The degraded gauge is a level: each report says it, so no single lost report leaves the gauge
    stale (a real SharedLearnedState, first against a port with no server, then one started there)."""
    from conftest import RedisServer, free_port, need_redis

    from cachescout.connector.scheduler_side import SchedulerSide
    from cachescout.connector.settings import ConnectorSettings
    from cachescout.connector.shared_state import SharedLearnedState
    need_redis()
    port = free_port()
    settings = ConnectorSettings.from_extra_config(
        {"shared_state": {"url": f"redis://127.0.0.1:{port}", "replica": "r", "timeout_s": 0.2,
                          "flush_interval_s": 60}}, block_size=16)
    side = SchedulerSide(settings, budget_tokens=2048, max_seqs=8, shared=lambda: SharedLearnedState(
        settings.shared_state, half_life=settings.policy.transition_half_life, model="m", hash_domain="d"))
    now = [0.0]
    side.set_clock(lambda: now[0])

    def report() -> dict:
        now[0] += 2.0
        return side.counters() or {}
    server = None
    try:
        side.shared.sync_now()
        assert [report().get("state_degraded") for _ in range(3)] == [1, 1, 1]
        server = RedisServer(port=port)
        assert side.shared.sync_now()
        assert [report().get("state_degraded") for _ in range(3)] == [0, 0, 0]
        from cachescout.connector.vllm_connector import CacheScoutStats
        summed = CacheScoutStats(data={"state_degraded": 1}).aggregate(CacheScoutStats(data={"state_degraded": 1}))
        assert summed.reduce()["state_degraded"] == 1
    finally:
        side.shutdown()
        if server is not None:
            server.stop()


def _driven_scheduler(gpu_blocks, connector, block_size=16):
    """vLLM's scheduler with CacheScout, and a function that runs a request to its end in it."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    sched = build_scheduler(gpu_blocks, block_size=block_size, max_num_seqs=4, connector=connector)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)

    def run(rid, tokens, params=None):
        extra = {"kv_transfer_params": params} if params else None
        sp = SamplingParams(max_tokens=1, ignore_eos=True, extra_args=extra)
        sched.add_request(Request(rid, tokens, sp, None, block_hasher=hasher))
        while sched.requests:
            out = sched.schedule()
            ids = list(out.num_scheduled_tokens)
            sampled = [[] if sched.requests[r].is_prefill_chunk else [5] for r in ids]
            sched.update_from_output(out, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled))
        sched.schedule()   # the step that files what the last request freed
    return sched, run


def test_a_warm_up_brings_the_anchor_back_as_a_prefetch_and_teaches_nothing():
    """A warm-up request (`cachescout.warmup` in kv_transfer_params) inside vLLM's scheduler: the
    policy does not count it as a call or learn from it, its blocks are filed as a prefetch of the
    agent's anchor, and the agent's next call finds the whole anchor in the GPU cache."""
    sched, run = _driven_scheduler(24, {})
    steering, policy = sched.connector.steering, sched.connector.policy
    anchor = list(range(100, 164))                       # 4 blocks of 16 tokens
    for i in range(4):                                   # calls of one agent: its anchor is learned
        run(f"call{i}", anchor + list(range(1000 + 40 * i, 1040 + 40 * i)))
    (agent,) = steering.anchor_keys
    assert len(steering.anchor_keys[agent]) == 4 and steering.anchors[agent][0] == anchor
    for i in range(3):                                   # other traffic evicts it
        run(f"other{i}", list(range(5000 + 400 * i, 5000 + 400 * i + 320)))
    assert steering.anchor_missing(agent) == 4
    requests = policy.stats["requests"]
    learned = policy.transitions()

    run("warm", anchor, {"cachescout.warmup": agent})
    assert policy.stats["requests"] == requests           # not a call
    assert policy.transitions() == learned and learned
    assert steering.stats["warmup_tokens"] == 64 and steering.stats["warmup_blocks"] == 4
    assert steering.anchor_missing(agent) == 0
    assert steering.stats["prompt_tokens"] == 4 * 104 + 3 * 320   # the calls' alone

    steering.warmed.add(agent)                           # as the scheduler side does when it sends one
    on_gpu = steering.stats["anchor_on_gpu"]
    run("next", anchor + list(range(9000, 9040)))
    assert steering.stats["anchor_on_gpu"] == on_gpu + 1
    assert steering.stats["warmed_calls"] == 1 and steering.stats["warmed_on_gpu"] == 1
    assert agent not in steering.warmed                  # a warm-up serves one call


def test_a_warm_up_marker_naming_no_known_agent_is_an_ordinary_call():
    sched, run = _driven_scheduler(24, {})
    steering, policy = sched.connector.steering, sched.connector.policy
    run("x", list(range(100, 164)), {"cachescout.warmup": "nobody"})
    assert policy.stats["requests"] == 1 and steering.stats["bad_hints"] == 1
    assert steering.stats["warmup_tokens"] == 0


class _CapturingServer:
    """An HTTP server on 127.0.0.1 that answers every POST with `status` (once `gate` is set) and
    keeps the paths and JSON bodies."""

    def __init__(self, status=200):
        import http.server
        import json
        import threading

        bodies = self.bodies = []
        gate = self.gate = threading.Event()
        gate.set()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                bodies.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
                gate.wait(10)
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_predicted_anchor_missing_from_the_gpu_is_warmed_up_through_the_servers_api():
    """With `gpu_warmup_url`: sessions all start with one agent, so it is predicted next; once its
    anchor has left the GPU cache (here vLLM's cache is reset: all its blocks are empty, room that
    displaces nothing) the next idle step sends its anchor to the server's completions API as a
    one-token request marked for the connector; run through the scheduler, it brings the anchor back."""
    import time

    server = _CapturingServer()
    try:
        sched, run = _driven_scheduler(64, {"gpu_warmup_url": server.url + "/"})
        side = sched.connector.scheduler_side
        anchor = list(range(100, 164))
        for i in range(8):
            run(f"call{i}", anchor + list(range(1000 + 40 * i, 1040 + 40 * i)))
        (agent,) = side.steering.anchors
        assert side.policy.next_agent_probabilities()[agent][0] >= side.policy.cfg.prefetch_min_probability
        assert not server.bodies and side.warm_stats["warmups_offered"] == 0    # it is on the GPU
        assert sched.reset_prefix_cache()
        time.sleep(0.25)                    # warm-ups are considered at most every 0.2 s
        sched.schedule()                    # an idle step: the mirror learns the anchor is gone, and warms it
        deadline = time.monotonic() + 10
        while side.warmup.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert side.warm_stats["warmups_offered"] == 1 and side.warmup.stats["warmups_sent"] == 1
        ((path, body),) = server.bodies
        assert path == "/v1/completions" and body["max_tokens"] == 1 and "priority" not in body
        assert body["prompt"] == anchor and body["model"] == sched.vllm_config.model_config.model
        assert body["kv_transfer_params"] == {"cachescout.warmup": agent}
        time.sleep(0.25)
        sched.schedule()
        assert len(server.bodies) == 1      # one warm-up per agent until it is called
        run("warm", body["prompt"], body["kv_transfer_params"])     # what the server would do with it
        assert side.steering.anchor_missing(agent) == 0 and side.steering.stats["warmup_blocks"] == 4
        run("next", anchor + list(range(9000, 9040)))
        assert side.steering.stats["warmed_on_gpu"] == 1
    finally:
        server.close()


def test_the_warm_up_sender_sends_one_at_a_time_and_counts_failures(caplog):
    import time

    from cachescout.connector.gpu_warmup import WarmupSender

    server = _CapturingServer(status=500)
    server.gate.clear()                          # the server holds its answer
    sender = WarmupSender(server.url, "m", timeout_s=5, priority=7, api_key="k")
    try:
        assert sender.offer("a", [1, 2, 3], {"lmcache.tag.agent": "a"})
        assert sender.busy and not sender.offer("b", [4], {})            # one in flight at most
        server.gate.set()
        deadline = time.monotonic() + 10
        while sender.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sender.stats == {"warmups_sent": 0, "warmups_failed": 1}
        ((path, body),) = server.bodies
        assert body["priority"] == 7 and body["model"] == "m" and body["prompt"] == [1, 2, 3]
        assert body["kv_transfer_params"] == {"lmcache.tag.agent": "a", "cachescout.warmup": "a"}
        assert "warm-up request" in caplog.text and "HTTP Error 500" in caplog.text
    finally:
        sender.close()
        server.close()


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://h:1", "http://h:0", "http://h:99999", "http://h:8000/v1",
                                 "http://:8000"])
def test_a_bad_warm_up_address_fails_at_start_up(url):
    with pytest.raises(ConfigError, match="gpu_warmup_url"):
        build_scheduler(64, connector={"gpu_warmup_url": url})


def test_vllms_scheduler_prices_attention_as_the_fast_replay_does():
    # One 20,000-token call, prefilled in chunks by vLLM's scheduler: the attention term adds the
    # same time to its first token as in the fast replay (tests/test_trace.py), whatever the chunks.
    import dataclasses
    import json

    from cachescout.bench.replay import CostProfile
    from cachescout.bench.trace import parse_trace

    record = {"timestamp": 0, "input_length": 20000, "output_length": 2, "hash_ids": list(range(1, 40))}
    sessions, _ = parse_trace([json.dumps(record)], block_size=512)
    plain = CostProfile()
    ttft = {}
    for coef in (0.0, 1e-9):
        cost = dataclasses.replace(plain, attention_s_per_token_context=coef)
        cfg = EngineConfig(gpu_blocks=100, block_size=512, cost=cost)
        (call,) = VllmReplay(cfg, "lru").run(sessions).calls
        ttft[coef] = call.first_token_at - call.issued_at
    assert ttft[1e-9] - ttft[0.0] == pytest.approx(1e-9 * 20000 * 19999 / 2)


def test_the_connector_passes_how_each_call_ended_to_the_policy():
    """Inside vLLM's scheduler the policy learns a session's wait keyed by the call's last output
    tokens (`output_ending`): here a conversation with no agent, whose calls end in token 5."""
    sched, run = _driven_scheduler(64, {})
    policy = sched.connector.policy
    prompt = list(range(100, 164))
    run("c0", prompt)
    run("c1", prompt + [5] + list(range(2000, 2040)))   # continues it: the same session
    waits = policy.inspect().traffic.waits
    assert waits.seen > 0.99
    assert list(waits._by_ending) == [(5,)]


def test_queued_requests_go_to_be_held_earliest_first_within_the_bounds(monkeypatch):
    """Beside LMCache's CPU tier, each request still waiting after a step is sent to the workers to
    have its CPU prefix held (lmcache_tier.QueuedHolds), in arrival order, its tokens cut to what a
    hold may pin (half the tier), within a per-step token budget and a cap on holds at once; the
    rest go as the queue moves. A request admitted in the step it arrived in is never sent, and one
    admitted later is released in the step that admits it."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from cachescout.connector import scheduler_side

    monkeypatch.setattr(scheduler_side, "_HOLD_TOKENS_PER_STEP", 100)
    monkeypatch.setattr(scheduler_side, "_HOLDS_OUTSTANDING", 2)
    cpu_gib = 8 * 16 * PolicyConfig().kv_bytes_per_token / 2**30          # 8 blocks: a hold pins 4 at most
    sched = build_scheduler(64, max_num_seqs=1, connector={"lmcache_cpu_gib": cpu_gib})
    assert sched.connector.scheduler_side._hold_tokens == 64
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    prompts = {rid: list(range(1000 * i, 1000 * i + 80)) for i, rid in enumerate(("R", "Q1", "Q2", "Q3"), 1)}
    for rid, tokens in prompts.items():
        sp = SamplingParams(max_tokens=3 if rid == "R" else 1, ignore_eos=True)
        sched.add_request(Request(rid, tokens, sp, None, block_hasher=hasher))
    log = []
    while sched.requests:
        out = sched.schedule()
        meta = out.kv_connector_metadata
        ids = list(out.num_scheduled_tokens)
        log.append((ids, [(rid, tokens) for rid, tokens, _ in meta.holds or ()], meta.releases or []))
        sampled = [[] if sched.requests[r].is_prefill_chunk else [5] for r in ids]
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                        sampled_token_ids=sampled))
    first_ids, first_holds, _ = log[0]
    assert first_ids == ["R"]
    # Q1 (64 tokens) leaves 36 of the step's 100: Q2 goes too, and two are held at once: Q3 waits.
    assert first_holds == [("Q1", prompts["Q1"][:64]), ("Q2", prompts["Q2"][:64])]
    admitted_q1 = next(i for i, (ids, _, _) in enumerate(log) if "Q1" in ids)
    assert log[admitted_q1][2] == ["Q1"] and log[admitted_q1][1] == [("Q3", prompts["Q3"][:64])]
    assert [r for _, _, rel in log for r in rel] == ["Q1", "Q2", "Q3"]
    assert sum(len(h) for _, h, _ in log) == 3
    assert not sched.connector.scheduler_side._hold_sent
