"""CacheScout in LMCache's own engine (LMCache 0.5.6 on CPU) with a real redis-server.

The only stand-in is the GPU: `CpuKV` copies between a CPU tensor shaped like a paged KV cache
([2, layers, tokens, hidden]) and LMCache's memory objects, where vLLM would use GPU kernels.
"""

import itertools
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")   # no usage telemetry from tests

from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector import GPUConnectorInterface  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

from cachescout.connector import lmcache_tier  # noqa: E402
from cachescout.connector.lmcache_tier import AgentRanking, CacheScoutCachePolicy, Prefetcher  # noqa: E402

LAYERS, HIDDEN, CHUNK = 2, 64, 256
CHUNK_BYTES = 2 * LAYERS * CHUNK * HIDDEN * 2       # float16
CPU_CHUNKS = 80                                     # CPU tier capacity used below
_ids = itertools.count()


class CpuKV(GPUConnectorInterface):
    """Stands in for the GPU KV cache (no GPU here): a CPU tensor [2, layers, tokens, hidden]."""

    def get_shape(self, num_tokens):
        return torch.Size([2, LAYERS, num_tokens, HIDDEN])

    def from_gpu(self, memory_obj, start, end, **kw):
        memory_obj.tensor.copy_(kw["kvcaches"][:, :, start:end, :])

    def to_gpu(self, memory_obj, start, end, **kw):
        kw["kvcaches"][:, :, start:end, :].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs, starts, ends, **kw):
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(m, s, e, **kw)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kw):
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(m, s, e, **kw)


_built: list[str] = []


@pytest.fixture(autouse=True)
def _close_engines():
    """Every engine a test builds is closed with the destroy-hang workaround."""
    yield
    while _built:
        lmcache_tier.close_engine(_built.pop(), timeout=3.0)


def build_engine(redis_url: str | None, policy: str):
    lmcache_tier.register()
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=CPU_CHUNKS * CHUNK_BYTES / 2**30,
        remote_url=redis_url, remote_serde="naive" if redis_url else None, cache_policy=policy)
    meta = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.float16, kv_shape=(LAYERS, 2, CHUNK, 1, HIDDEN), chunk_size=CHUNK)
    instance = f"cachescout-test-{next(_ids)}"
    _built.append(instance)
    engine = LMCacheEngineBuilder.get_or_create(instance, cfg, meta, CpuKV(), lambda *a: None, lambda *a: None)
    engine.post_init()
    return engine


class Agent:
    """A prompt prefix of `chunks` LMCache chunks, tagged with its agent, and its KV."""

    def __init__(self, name: str, chunks: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.name = name
        self.tokens = torch.randint(0, 50_000, (chunks * CHUNK,), generator=g)
        self.kv = torch.randn(2, LAYERS, chunks * CHUNK, HIDDEN, generator=g).to(torch.float16)
        self.configs = {"lmcache.tag.agent": name}

    def keys(self, engine):
        return [k for _, _, k in engine.token_database.process_tokens(self.tokens, request_configs=self.configs)]


def cpu_tier(engine):
    return engine.storage_manager.storage_backends["LocalCPUBackend"]


def wait_for_redis(engine, agents, timeout=10.0):
    """Stores are written through to Redis asynchronously: wait until every chunk is there."""
    remote = engine.storage_manager.storage_backends["RemoteBackend"]
    deadline = time.monotonic() + timeout
    while not all(remote.contains(k) for a in agents for k in a.keys(engine)):
        assert time.monotonic() < deadline, "chunks never reached Redis"
        time.sleep(0.05)


def store_in_order(engine, agents, redis=True):
    for a in agents:
        engine.store(a.tokens, kvcaches=a.kv, request_configs=a.configs)
        if redis:
            wait_for_redis(engine, [a])   # LMCache drops stores while the CPU tier waits on Redis


def in_cpu(engine, agent):
    cpu = cpu_tier(engine)
    return sum(cpu.contains(k) for k in agent.keys(engine))


@pytest.fixture
def agents():
    # 20 + 20 + 60 chunks through an 80-chunk CPU tier: 20 must go.
    return Agent("coder", 20, 1), Agent("critic", 20, 2), Agent("searcher", 60, 3)


def test_cachescout_policy_is_built_by_name(redis_server):
    engine = build_engine(redis_server.url, "cachescout")
    assert isinstance(cpu_tier(engine).cache_policy, CacheScoutCachePolicy)


@pytest.mark.parametrize("ranked", [False, True])
def test_policy_keeps_the_predicted_agents_chunks(redis_server, agents, ranked):
    coder, critic, searcher = agents
    lmcache_tier.RANKING.update({"coder": 0.9, "critic": 0.05, "searcher": 0.5} if ranked else {})
    try:
        engine = build_engine(redis_server.url, "cachescout")
        store_in_order(engine, agents)
        policy = cpu_tier(engine).cache_policy
        assert policy.stats["evictions"] >= 20
        if ranked:
            # The oldest chunks are coder's, but coder is predicted next: critic's go instead.
            assert in_cpu(engine, coder) == 20 and in_cpu(engine, critic) == 0
            assert policy.stats["steered"] > 0
        else:
            # No ranking: exactly LRU, the oldest (coder's) go first.
            assert in_cpu(engine, coder) == 0 and in_cpu(engine, critic) == 20
            assert policy.stats["steered"] == 0
        assert in_cpu(engine, searcher) == 60
    finally:
        lmcache_tier.RANKING.update({})


def test_evicted_chunks_come_back_from_redis_bit_exact(redis_server, agents):
    coder, critic, searcher = agents
    engine = build_engine(redis_server.url, "lru")
    store_in_order(engine, agents)
    assert in_cpu(engine, coder) == 0
    out = torch.zeros_like(coder.kv)
    mask = engine.retrieve(coder.tokens, kvcaches=out, request_configs=coder.configs)
    assert int(mask.sum()) == len(coder.tokens)
    assert torch.equal(out, coder.kv)


def test_prefetch_moves_predicted_chunks_from_redis_into_cpu(redis_server, agents):
    coder, critic, searcher = agents
    engine = build_engine(redis_server.url, "lru")
    store_in_order(engine, agents)
    assert in_cpu(engine, coder) == 0
    prefetcher = Prefetcher(engine, max_chunks=64)
    try:
        assert prefetcher.submit(coder.tokens.tolist(), {"agent": "coder"})
        assert prefetcher.wait_idle(20)
        assert prefetcher.stats["chunks_loaded"] == 20 and prefetcher.stats["errors"] == 0
        assert in_cpu(engine, coder) == 20
        out = torch.zeros_like(coder.kv)
        engine.retrieve(coder.tokens, kvcaches=out, request_configs=coder.configs)
        assert torch.equal(out, coder.kv)
        # Already there: nothing is loaded twice.
        assert prefetcher.submit(coder.tokens.tolist(), {"agent": "coder"}) and prefetcher.wait_idle(20)
        assert prefetcher.stats["chunks_loaded"] == 20 and prefetcher.stats["already_in_cpu"] >= 20
    finally:
        prefetcher.close()


def test_prefetch_respects_the_cost_model_and_its_queue(redis_server, agents):
    coder, _, _ = agents
    engine = build_engine(redis_server.url, "lru")
    store_in_order(engine, agents)
    slow = Prefetcher(engine, worth_it=lambda tokens, start: False)
    try:
        slow.submit(coder.tokens.tolist(), {"agent": "coder"})
        assert slow.wait_idle(20)
        assert slow.stats["skipped_slower_than_recompute"] == 1 and in_cpu(engine, coder) == 0
    finally:
        slow.close()
    stopped = Prefetcher(engine, max_queue=1)
    stopped.close()
    assert not stopped.submit(coder.tokens.tolist())


def test_redis_stopped_mid_run_raises_nothing(redis_server, agents):
    coder, critic, searcher = agents
    engine = build_engine(redis_server.url, "cachescout")
    store_in_order(engine, [coder, critic])
    prefetcher = Prefetcher(engine)
    try:
        redis_server.stop()
        late = Agent("summarizer", 8, 4)
        engine.store(late.tokens, kvcaches=late.kv, request_configs=late.configs)   # no exception
        store_in_order(engine, [searcher], redis=False)
        out = torch.zeros_like(critic.kv)
        mask = engine.retrieve(critic.tokens, kvcaches=out, request_configs=critic.configs)
        # What is still in the CPU tier is served from there; the rest is recomputed, not an error.
        hit = int(mask.sum())
        assert torch.equal(out[:, :, :hit], critic.kv[:, :, :hit])
        assert prefetcher.submit(coder.tokens.tolist(), {"agent": "coder"})
        assert prefetcher.wait_idle(30)
    finally:
        prefetcher.close()


def test_ranking_rejects_bad_values():
    ranking = AgentRanking()
    ranking.update({"a": 0.5, "b": 2.0, "c": "high", "d": -1})
    assert dict(ranking.scores()) == {"a": 0.5}


def test_close_never_hangs_the_process(tmp_path):
    """LMCache's destroy() hangs with a redis:// tier; close_engine() returns and the process exits."""
    from conftest import need_redis

    need_redis()   # the child process starts a redis-server of its own
    code = f"""
import sys, time
sys.path.insert(0, {os.path.dirname(__file__)!r})
import test_lmcache_tier as T
from conftest import RedisServer
from cachescout.connector import lmcache_tier
server = RedisServer()
engine = T.build_engine(server.url, "cachescout")
T.store_in_order(engine, [T.Agent("x", 4, 1)])
t0 = time.monotonic()
clean = lmcache_tier.close_engine(T._built.pop(), timeout=3.0)
server.stop()
print("closed", clean, round(time.monotonic() - t0, 1))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "closed" in proc.stdout


@pytest.mark.parametrize("cpu_load_gbps", [None, 1e-6])
def test_worker_connector_prefetches_what_the_scheduler_predicts(redis_server, agents, cpu_load_gbps):
    """The worker side of CacheScoutConnector, given the scheduler's metadata, prefetches the
    predicted agent's anchor from Redis into this process's LMCache CPU tier."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from cachescout.bench.vllm_replay import build_scheduler
    from cachescout.connector.vllm_connector import CacheScoutConnector, CacheScoutMetadata

    coder, _, _ = agents
    engine = build_engine(redis_server.url, "cachescout")
    store_in_order(engine, agents)
    assert in_cpu(engine, coder) == 0
    # With a CPU tier slower than recomputing (per the policy's cost figures) nothing is prefetched.
    settings = {} if cpu_load_gbps is None else {"policy": {"cpu_load_gbps": cpu_load_gbps}}
    sched = build_scheduler(64, connector=settings)
    worker = CacheScoutConnector(sched.connector._vllm_config, KVConnectorRole.WORKER, sched.kv_cache_config)
    try:
        worker.bind_connector_metadata(CacheScoutMetadata({"coder": 0.9}, [(coder.tokens.tolist(), coder.configs)]))
        assert worker.worker_side.prefetcher is not None and worker.worker_side.prefetcher.wait_idle(20)
        assert engine.storage_manager._cachescout_store_wait_s == 0.05   # store_wait_ms's default, bound
        stats = worker.get_kv_connector_stats().data     # what vLLM adds to the scheduler's counts
        assert stats["prefetch_submitted"] == 1
        assert stats["cpu_evictions"] >= 20               # storing the three agents filled the CPU tier
        if cpu_load_gbps is not None:
            assert in_cpu(engine, coder) == 0
            assert worker.worker_side.prefetcher.stats["skipped_slower_than_recompute"] == 1
            assert stats["prefetch_skipped_slower"] == 1 and "prefetch_chunks_loaded" not in stats
            return
        assert in_cpu(engine, coder) == 20
        assert stats["prefetch_chunks_loaded"] == 20
        assert worker.get_kv_connector_stats() is None    # at most once a second
        assert dict(lmcache_tier.RANKING.scores()) == {"coder": 0.9}
    finally:
        lmcache_tier.RANKING.update({})
        worker.shutdown()


def _store_burst(engine, agents):
    """Store one agent after another without waiting for their Redis writes (a burst)."""
    for a in agents:
        engine.store(a.tokens, kvcaches=a.kv, request_configs=a.configs)


def _fill_with_pending_writes(engine, redis_server, agents):
    """Every chunk of the 80-chunk CPU tier pinned by a Redis write that has not finished: coder
    is written, then Redis pauses and critic + searcher (80 chunks) are stored."""
    coder, critic, searcher = agents
    store_in_order(engine, [coder])
    redis_server.pause()
    _store_burst(engine, [critic, searcher])


def test_lmcache_alone_cuts_a_store_short_while_writes_are_pending(redis_server, agents):
    """The defect the next tests work around: LMCache drops the store at once."""
    engine = build_engine(redis_server.url, "cachescout")
    try:
        _fill_with_pending_writes(engine, redis_server, agents)
        late = Agent("math", 20, 4)
        engine.store(late.tokens, kvcaches=late.kv, request_configs=late.configs)
        assert in_cpu(engine, late) == 0
    finally:
        redis_server.resume()


def test_a_store_waits_for_pending_redis_writes_instead_of_dropping(redis_server, agents):
    engine = build_engine(redis_server.url, "cachescout")
    assert lmcache_tier.bound_store_waits(engine, 3.0)
    assert not lmcache_tier.bound_store_waits(engine, 3.0)   # once per engine
    before = dict(lmcache_tier.STORE_STATS)
    resume = threading.Timer(0.3, redis_server.resume)       # the writes finish 0.3 s from now
    try:
        _fill_with_pending_writes(engine, redis_server, agents)
        resume.start()
        late = Agent("math", 20, 4)
        engine.store(late.tokens, kvcaches=late.kv, request_configs=late.configs)
        assert in_cpu(engine, late) == 20                     # every chunk kept, none dropped
        assert lmcache_tier.STORE_STATS["waited"] > before.get("waited", 0)
        assert lmcache_tier.STORE_STATS["dropped"] == before.get("dropped", 0)
    finally:
        resume.join()
        redis_server.resume()
    out = torch.zeros_like(late.kv)
    mask = engine.retrieve(late.tokens, kvcaches=out, request_configs=late.configs)
    assert int(mask.sum()) == 20 * CHUNK and torch.equal(out, late.kv)


def test_a_stalled_redis_delays_a_store_by_the_bound_only(redis_server, agents):
    """Redis stops answering with every CPU chunk pinned by its writes: the store gives up after
    the bound (counted), where LMCache's own wait would last as long as Redis's timeout."""
    engine = build_engine(redis_server.url, "cachescout")
    lmcache_tier.bound_store_waits(engine, 0.05)
    before = lmcache_tier.STORE_STATS["dropped"]
    try:
        _fill_with_pending_writes(engine, redis_server, agents)
        late = Agent("math", 20, 4)
        t0 = time.monotonic()
        engine.store(late.tokens, kvcaches=late.kv, request_configs=late.configs)
        assert time.monotonic() - t0 < 1.0
        assert lmcache_tier.STORE_STATS["dropped"] > before and in_cpu(engine, late) == 0
    finally:
        redis_server.resume()


def test_a_cpu_tier_with_every_chunk_pinned_is_counted():
    """LMCache drops a store when no CPU chunk can be evicted (all pinned by in-flight Redis
    writes); the policy counts each such miss so it shows in vLLM's metrics."""
    from collections import OrderedDict
    from types import SimpleNamespace

    policy = lmcache_tier.CacheScoutCachePolicy(lmcache_tier.AgentRanking())
    pinned = OrderedDict((f"k{i}", SimpleNamespace(can_evict=False)) for i in range(5))
    assert policy.get_evict_candidates(pinned, 1) == []
    assert policy.stats["no_evictable"] == 1 and lmcache_tier.cpu_tier_stats()["no_evictable"] >= 1
    pinned["k9"] = SimpleNamespace(can_evict=True)
    assert policy.get_evict_candidates(pinned, 1) == ["k9"] and policy.stats["no_evictable"] == 1


def test_prefetched_chunks_are_counted_used_when_read_and_wasted_when_evicted_unread(redis_server, agents):
    from collections import OrderedDict
    from types import SimpleNamespace

    coder, _, _ = agents
    engine = build_engine(redis_server.url, "cachescout")
    store_in_order(engine, agents)
    policy = cpu_tier(engine).cache_policy
    assert in_cpu(engine, coder) == 0 and policy.stats["prefetch_used"] == 0
    prefetcher = Prefetcher(engine, max_chunks=64)
    try:
        assert prefetcher.submit(coder.tokens.tolist(), {"agent": "coder"}) and prefetcher.wait_idle(20)
        assert prefetcher.stats["chunks_loaded"] == 20
        # As under vLLM: the scheduler's lookup pins (a hit, for the CPU-tier policy), then the load.
        for n in range(2):
            assert engine.lookup(coder.tokens, lookup_id=f"r{n}", pin=True,
                                 request_configs=coder.configs) == len(coder.tokens)
            out = torch.zeros_like(coder.kv)
            engine.retrieve(coder.tokens, kvcaches=out, request_configs=coder.configs)
            engine.lookup_unpin(f"r{n}")
            assert torch.equal(out, coder.kv)
            # each prefetched chunk is used once, however often it is hit
            assert policy.stats["prefetch_used"] == 20 and policy.stats["prefetch_wasted"] == 0
    finally:
        prefetcher.close()
    lmcache_tier.PREFETCHED.add("never-read")
    unread = OrderedDict([("never-read", SimpleNamespace(can_evict=True))])
    assert policy.get_evict_candidates(unread, 1) == ["never-read"]
    assert policy.stats["prefetch_wasted"] == 1


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_kv_tier_as_the_helm_chart_sets_it_up(tmp_path, agents, tls):
    """LMCache's own Redis connector on a redis-server configured like the chart's KV tier: the
    `lmcache` ACL user with the chart's rule, the URL in the form the chart's Secret holds (password
    inside, `?ssl_ca_certs=` with TLS). Evicted chunks come back from Redis bit-exact."""
    import pathlib
    import re
    import redis as redis_py
    from conftest import RedisServer, need_redis, tls_redis

    need_redis()
    helpers = (pathlib.Path(__file__).parent.parent / "deploy" / "helm" / "cachescout" / "templates" / "_helpers.tpl")
    rule = re.search(r'define "cachescout.kvAcl" -}}\n(.*)\n', helpers.read_text()).group(1).split()
    server = tls_redis(str(tmp_path)) if tls else RedisServer()
    try:
        tls_kw = {"ssl": True, "ssl_ca_certs": str(tmp_path / "ca.crt")} if tls else {}
        admin = redis_py.Redis(host="127.0.0.1", port=server.port, **tls_kw)
        admin.execute_command("ACL", "SETUSER", "lmcache", "on", ">kv-pw", *rule)
        admin.close()
        query = f"?ssl_ca_certs={tmp_path / 'ca.crt'}" if tls else ""
        url = f"{'rediss' if tls else 'redis'}://lmcache:kv-pw@127.0.0.1:{server.port}/0{query}"
        coder, _, _ = agents
        engine = build_engine(url, "cachescout")
        store_in_order(engine, agents)
        assert in_cpu(engine, coder) == 0
        out = torch.zeros_like(coder.kv)
        mask = engine.retrieve(coder.tokens, kvcaches=out, request_configs=coder.configs)
        assert int(mask.sum()) == len(coder.tokens) and torch.equal(out, coder.kv)
    finally:
        server.stop()


@pytest.mark.parametrize("looked_up", [False, True])
def test_the_replays_cpu_tier_keeps_what_lmcaches_keeps(agents, looked_up):
    """The benchmark's model of LMCache's CPU tier (bench/replay.py: LRU; a lookup touches the
    prompt's whole stored prefix, blocks vLLM holds on its GPU too; a store skips what the tier holds,
    leaving its place) against LMCache's own engine, chunk for chunk: coder's chunks are the oldest;
    storing coder again does not save them, a lookup of coder's prompt (as vLLM's scheduler makes
    for every request) does."""
    from cachescout.connector.lmcache_model import TierStore, lmcache_lookup

    coder, critic, searcher = agents
    engine = build_engine(None, "lru")
    model = TierStore("cpu", CPU_CHUNKS)
    for a in (coder, critic, coder):
        engine.store(a.tokens, kvcaches=a.kv, request_configs=a.configs)
        model.put([k for k in a.keys(engine) if k not in model])
    if looked_up:
        hit = engine.lookup(coder.tokens, lookup_id="r1", pin=True, request_configs=coder.configs)
        engine.lookup_unpin("r1")
        assert hit == len(coder.tokens)
        assert lmcache_lookup(coder.keys(engine), model, None) == (20, 20)
    engine.store(searcher.tokens, kvcaches=searcher.kv, request_configs=searcher.configs)
    model.put(searcher.keys(engine))
    kept = {a.name: in_cpu(engine, a) for a in agents}
    assert kept == ({"coder": 20, "critic": 0, "searcher": 60} if looked_up else
                    {"coder": 0, "critic": 20, "searcher": 60})
    assert {a.name: sum(k in model for k in a.keys(engine)) for a in agents} == kept


# -- queued requests' CPU-tier holds (lmcache_tier.QueuedHolds) -------------------------------------
def pins(engine, agent):
    """Pin counts of `agent`'s chunks in the CPU tier (absent chunks left out)."""
    cpu = cpu_tier(engine)
    return [cpu.hot_cache[k].meta.pin_count for k in agent.keys(engine) if k in cpu.hot_cache]


@pytest.mark.parametrize("held", [False, True])
def test_a_queued_requests_held_prefix_outlives_the_stores_ahead_of_it(agents, held):
    """coder's chunks are the oldest; a request needing them waits while critic and searcher are
    stored. LMCache's LRU evicts coder's (its lookup pins nothing until the request is admitted);
    held from the request's arrival, critic's go instead, and LMCache's lookup then loads coder's
    bit-exact. Released and loaded, they are ordinary chunks again (every pin given back)."""
    coder, critic, searcher = agents
    engine = build_engine(None, "lru")
    holds = lmcache_tier.QueuedHolds(engine)
    try:
        store_in_order(engine, [coder, critic], redis=False)
        if held:
            assert holds.hold("q", coder.tokens.tolist(), coder.configs)
            assert holds.wait_idle()
            assert pins(engine, coder) == [1] * 20
        engine.store(searcher.tokens, kvcaches=searcher.kv, request_configs=searcher.configs)
        kept = {a.name: in_cpu(engine, a) for a in agents}
        assert kept == ({"coder": 20, "critic": 0, "searcher": 60} if held else
                        {"coder": 0, "critic": 20, "searcher": 60})
        hit = engine.lookup(coder.tokens, lookup_id="q", pin=True, request_configs=coder.configs)
        assert hit == (len(coder.tokens) if held else 0)
        if held:   # admitted: LMCache's lookup pinned the chunks, then the hold is released
            holds.release("q")
            assert holds.wait_idle() and pins(engine, coder) == [1] * 20
            out = torch.zeros_like(coder.kv)
            assert int(engine.retrieve(coder.tokens, kvcaches=out, request_configs=coder.configs).sum()) == 5120
            assert torch.equal(out, coder.kv)
            engine.lookup_unpin("q")
            assert pins(engine, coder) == [0] * 20 and holds.held_bytes == 0
            assert holds.stats["holds"] == 1 and holds.stats["hold_chunks"] == 20
    finally:
        holds.close()


def test_holds_take_at_most_half_the_tier_and_move_up_the_queue():
    """An 80-chunk tier holds at most 40 chunks: the first queued request (30 chunks) is held whole,
    the second (30) as far as the limit allows, and whole once the first is admitted. A chunk held
    by two requests counts once."""
    a, b = Agent("a", 30, 11), Agent("b", 30, 12)
    engine = build_engine(None, "lru")
    holds = lmcache_tier.QueuedHolds(engine)
    try:
        store_in_order(engine, [a, b], redis=False)
        assert holds.limit_bytes == 40 * CHUNK_BYTES
        holds.hold("r1", a.tokens.tolist(), a.configs)
        holds.hold("r2", b.tokens.tolist(), b.configs)
        holds.hold("r3", a.tokens.tolist(), a.configs)   # a's chunks again: already held, free of charge
        assert holds.wait_idle()
        assert pins(engine, a) == [2] * 30 and pins(engine, b) == [1] * 10 + [0] * 20   # a pin per request
        assert holds.held_bytes == 40 * CHUNK_BYTES and holds.stats["holds_cut_by_limit"] == 1
        holds.release("r1")                              # r3 still holds a's chunks
        assert holds.wait_idle() and pins(engine, a) == [1] * 30 and pins(engine, b) == [1] * 10 + [0] * 20
        holds.release("r3")                              # room: r2 is held whole
        assert holds.wait_idle()
        assert pins(engine, a) == [0] * 30 and pins(engine, b) == [1] * 30
        assert holds.held_bytes == 30 * CHUNK_BYTES
        holds.release("r2")
        holds.release("never-held")                      # a request admitted before it was held
        assert holds.wait_idle() and pins(engine, b) == [0] * 30 and holds.held_bytes == 0
    finally:
        holds.close()


def test_a_hold_never_unpins_what_lmcache_pinned_or_a_chunk_stored_again():
    """Holds pin apart from LMCache's lookups; a cache cleared by force drops the held chunks and
    their pins, and chunks stored again after it are LMCache's alone."""
    coder = Agent("coder", 4, 21)
    engine = build_engine(None, "lru")
    holds = lmcache_tier.QueuedHolds(engine, max_queued=1)
    try:
        store_in_order(engine, [coder], redis=False)
        holds.hold("q", coder.tokens.tolist(), coder.configs)
        assert not holds.hold("q2", coder.tokens.tolist(), coder.configs)   # the queue is full
        assert holds.stats["holds_dropped"] == 1
        assert holds.wait_idle()
        engine.lookup(coder.tokens, lookup_id="lm", pin=True, request_configs=coder.configs)
        assert pins(engine, coder) == [2] * 4
        engine.lookup_unpin("lm")
        assert pins(engine, coder) == [1] * 4
        engine.clear(locations=["LocalCPUBackend"])
        store_in_order(engine, [coder], redis=False)
        engine.lookup(coder.tokens, lookup_id="lm2", pin=True, request_configs=coder.configs)
        holds.release("q")
        assert holds.wait_idle() and pins(engine, coder) == [1] * 4 and holds.stats["hold_errors"] == 0
        engine.lookup_unpin("lm2")
        assert pins(engine, coder) == [0] * 4
    finally:
        holds.close()
    assert holds.refresh_s == engine.config.pin_timeout_sec / 4 and holds.max_hold_s == 3600
    # LMCache unpins by force what has not been pinned for pin_timeout_sec: a hold pins again (a net
    # nothing) every quarter of it, and one held past max_hold_s is let go, undoing nobody's pin.
    from lmcache.v1.pin_monitor import PinMonitor
    brief = lmcache_tier.QueuedHolds(engine, max_hold_s=0.6, refresh_s=0.1)
    try:
        brief.hold("q", coder.tokens.tolist(), coder.configs)
        assert brief.wait_idle() and pins(engine, coder) == [1] * 4
        obj = cpu_tier(engine).hot_cache[coder.keys(engine)[0]]
        first = PinMonitor.GetOrCreate()._pinned_objects[id(obj)][1]
        time.sleep(0.4)
        assert brief.stats["hold_refreshes"] >= 4 and pins(engine, coder) == [1] * 4
        assert PinMonitor.GetOrCreate()._pinned_objects[id(obj)][1] > first
        deadline = time.monotonic() + 5
        while brief.stats["holds_expired"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert brief.stats["holds_expired"] == 1 and pins(engine, coder) == [0] * 4 and brief.held_bytes == 0
        engine.lookup(coder.tokens, lookup_id="lm3", pin=True, request_configs=coder.configs)
        brief.release("q")                               # admitted at last: LMCache's pin stays
        assert brief.wait_idle() and pins(engine, coder) == [1] * 4
        engine.lookup_unpin("lm3")
    finally:
        brief.close()


@pytest.mark.parametrize("turned_off", [False, True])
def test_the_connector_holds_a_queued_requests_prefix_from_arrival_to_admission(turned_off):
    """vLLM's scheduler with CacheScoutConnector (LMCache's CPU tier beside it), each step's metadata
    handed to a worker-role CacheScoutConnector over LMCache's engine, as vLLM's workers get it. A
    request admitted in the step it arrived in is never held; one left waiting behind it (for
    coder's prefix, tagged with its agent as LMCache keys it) has that prefix pinned after the step,
    released in the step that admits it; the counts reach vLLM's connector stats. If CacheScout
    turns itself off meanwhile (a failure), the next step lets every hold go."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from cachescout.bench.vllm_replay import build_scheduler
    from cachescout.connector.vllm_connector import CacheScoutConnector

    coder = Agent("coder", 4, 31)
    engine = build_engine(None, "lru")
    store_in_order(engine, [coder], redis=False)
    # CacheScout told the tier's size and this KV's bytes per token (a hold sends up to half the tier's tokens).
    sched = build_scheduler(200, max_num_seqs=1, connector={
        "lmcache_cpu_gib": CPU_CHUNKS * CHUNK_BYTES / 2**30, "policy": {"kv_bytes_per_token": CHUNK_BYTES // CHUNK}})
    worker = CacheScoutConnector(sched.connector._vllm_config, KVConnectorRole.WORKER, sched.kv_cache_config)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)

    def add(rid, tokens, max_tokens, params=None):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None)
        sched.add_request(Request(rid, tokens, sp, None, block_hasher=hasher))

    def step():
        out = sched.schedule()
        meta = out.kv_connector_metadata
        worker.bind_connector_metadata(meta)
        ids = list(out.num_scheduled_tokens)
        sampled = [[] if sched.requests[r].is_prefill_chunk else [5] for r in ids]
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                        sampled_token_ids=sampled))
        return ids, meta

    try:
        add("R", list(range(7, 39)), max_tokens=4)
        add("Q", coder.tokens.tolist() + list(range(7, 23)), max_tokens=1, params=coder.configs)
        ids, meta = step()
        assert ids == ["R"] and [(rid, cfg) for rid, _, cfg in meta.holds] == [("Q", coder.configs)]
        holds = worker.worker_side.holds
        assert holds.wait_idle() and pins(engine, coder) == [1] * 4
        if turned_off:
            sched.connector.scheduler_side.failed = True   # as its first failure does
            ids, meta = step()
            assert meta.release_all and pins(engine, coder) == [0] * 4 and holds.held_bytes == 0
            ids, meta = step()
            assert not meta.release_all and not meta.holds and not meta.releases
            return
        released = []
        while sched.requests:
            ids, meta = step()
            released += meta.releases or []
            assert not meta.holds
            if "Q" in ids:
                assert released == ["Q"]
                break
            assert pins(engine, coder) == [1] * 4           # still waiting: still held
        assert holds.wait_idle() and pins(engine, coder) == [0] * 4
        stats = worker.get_kv_connector_stats().data
        assert stats["queued_holds"] == 1 and stats["hold_chunks"] == 4
    finally:
        worker.shutdown()
