"""Speed and memory of the policy core's hot operations (figures for docs/policy.md).

    python -m cachescout.bench.microbench [--json PATH]

Each figure is the median over many repetitions, in microseconds of wall time on this machine:
- learner update: one observed transition (TransitionLearner.update);
- request observe: everything done per request (fingerprint walk, session, learner update) on a
  realistic workload (real anchors, 2-6k-token prompts);
- victim: choosing and evicting one block from 100,000 free cached blocks in 50 agents' anchors and
  2,000 session contexts, in batches as a block pool asks for them; plus the per-step rescoring;
- prefetch plan: one plan for 50 agents and 200 live sessions, every one due to call;
- memory per tracked agent: bytes held by the policy per agent (tracemalloc), with 50 and 1,000 agents.

    python -m cachescout.bench.microbench --replay

measures the replay engine instead: calls replayed per second per policy on the default workloads.

    python -m cachescout.bench.microbench --holds

what holding a queued request's prefix in LMCache's CPU tier costs a worker's background thread
(hashing the prompt into LMCache's chunk keys, pinning them; releasing them), per prompt length.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any, cast

from cachescout.policy import CacheScoutPolicy, Hints, PolicyConfig, TransitionLearner

from .policies import make_policy
from .replay import Engine, EngineConfig, PromptKeys, chain_hashes
from .report import machine
from .run import calibrate_gpu_blocks
from .workloads import FAMILIES, WorkloadSpec, generate

REPLAY_POLICIES = ("lru", "continuum", "kvflow", "cachescout", "cachescout-hints",
                   "cachescout-hashonly", "belady")


def _median_us(samples_ns: Sequence[float]) -> float:
    return statistics.median(samples_ns) / 1e3


def bench_learner_update(n: int = 200_000) -> float:
    rng = random.Random(1)
    learner = TransitionLearner(200.0)
    agents = [f"agent{i}" for i in range(50)]
    pairs = [(rng.choice(agents), rng.choice(agents)) for _ in range(n)]
    samples = []
    batch = 1000
    for i in range(0, n, batch):
        chunk = pairs[i:i + batch]
        t0 = time.perf_counter_ns()
        for a, b in chunk:
            learner.update(a, b)
        samples.append((time.perf_counter_ns() - t0) / batch)
    return _median_us(samples)


def bench_observe() -> dict:
    sessions = generate(WorkloadSpec(family="mixed", sessions=200, seed=2))
    calls = []
    for s in sessions:
        for c in s.calls:
            tokens = c.prompt()
            calls.append((s.session_id, c, tokens, cast(list[int], chain_hashes(tokens, 16))))   # ints, typed Hashable
    policy = CacheScoutPolicy(PolicyConfig(), clock=lambda: 0.0)
    samples = []
    for i, (_, call, tokens, hashes) in enumerate(calls):
        t0 = time.perf_counter_ns()
        policy.observe(i, hashes, tokens=tokens, now=i * 0.05)
        samples.append(time.perf_counter_ns() - t0)
        policy.finish(i, now=i * 0.05 + 0.01, output_tokens=call.output)
    hinted = CacheScoutPolicy(PolicyConfig(), clock=lambda: 0.0)
    hsamples = []
    for i, (sid, call, _, hashes) in enumerate(calls):
        t0 = time.perf_counter_ns()
        hinted.observe(i, hashes, hints=Hints(agent=call.agent, session=sid), now=i * 0.05)
        hsamples.append(time.perf_counter_ns() - t0)
        hinted.finish(i, now=i * 0.05 + 0.01)
    warm = len(samples) // 5
    return {"observe_median_us": _median_us(samples[warm:]),
            "observe_p99_us": sorted(samples[warm:])[int(0.99 * (len(samples) - warm))] / 1e3,
            "observe_hinted_median_us": _median_us(hsamples[warm:]),
            "prompt_blocks_mean": statistics.mean(len(h) for *_, h in calls)}


def _filled_policy(agents: int = 50, blocks: int = 100_000, sessions: int = 2000) -> CacheScoutPolicy:
    """A policy tracking `blocks` free cached blocks: 50 anchors of 40 blocks and session contexts."""
    rng = random.Random(3)
    policy = CacheScoutPolicy(PolicyConfig(), clock=lambda: 0.0)
    names = [f"agent{i}" for i in range(agents)]
    for _ in range(20 * agents):  # a learned chain with a few likely successors per agent
        a = rng.choice(names)
        policy.learn_transition(a, names[(names.index(a) + rng.choice((1, 1, 2, 3))) % agents])
    anchors = {a: [rng.getrandbits(62) for _ in range(40)] for a in names}
    ctx_blocks = (blocks - agents * 40) // sessions
    rid = 0
    now = 0.0
    for s in range(sessions):
        agent = rng.choice(names)
        keys = anchors[agent] + [rng.getrandbits(62) for _ in range(ctx_blocks)]
        policy.observe(rid, keys, hints=Hints(agent=agent, session=f"s{s}"), now=now)
        cached = 40 if s >= agents else 0
        policy.admit_blocks(rid, keys, cached)
        policy.finish(rid, now)
        policy.blocks_freed(list(reversed(keys[cached:] if cached else keys)), now)
        rid += 1
        now += 0.01
    # Anchors' blocks were freed by the first request of each agent; later hits re-free nothing new.
    return policy


def bench_victims() -> dict:
    parts = _filled_policy().inspect()
    free = parts.index.n_free
    out: dict[str, float] = {"free_blocks": free, "groups": sum(1 for _ in parts.index.groups())}
    t0 = time.perf_counter_ns()
    parts.scorer.invalidate()
    parts.scorer.score(parts.index)
    out["rescore_ms"] = (time.perf_counter_ns() - t0) / 1e6
    for batch in (1, 16, 64):
        p = _filled_policy()
        parts = p.inspect()
        parts.scorer.score(parts.index)
        now = 1e3
        p.evict(1, now)  # build the per-step heap once, as the first eviction of a step does
        samples = []
        for _ in range(min(3000, free // batch - 2)):
            t0 = time.perf_counter_ns()
            got = p.evict(batch, now)
            samples.append((time.perf_counter_ns() - t0) / max(1, len(got)))
        out[f"victim_batch{batch}_median_us"] = _median_us(samples)
    p = _filled_policy()
    parts = p.inspect()
    parts.scorer.score(parts.index)
    t0 = time.perf_counter_ns()
    p.evict(1, 2e3)
    out["first_victim_of_a_step_ms"] = (time.perf_counter_ns() - t0) / 1e6
    return out


def bench_prefetch() -> float:
    policy = _filled_policy(sessions=200, blocks=200 * 40 + 50 * 40)
    where = {}
    for rec in policy.inspect().fingerprints.agents():
        for k in rec.anchor_path:
            where[k] = "cpu"
    # Planned at a time when every session's next call is due within the lead time (the 200
    # sessions called 10 ms apart over 2 s): the most candidates a plan weighs.
    now = 2.5
    samples = []
    for _ in range(300):
        t0 = time.perf_counter_ns()
        policy.plan_prefetch(where.get, now=now)
        samples.append(time.perf_counter_ns() - t0)
    return _median_us(samples)


def bench_memory(agents: int) -> float:
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    policy = CacheScoutPolicy(PolicyConfig(max_agents=max(1024, agents)), clock=lambda: 0.0)
    rng = random.Random(4)
    names = [f"agent{i}" for i in range(agents)]
    anchors = {a: [rng.getrandbits(62) for _ in range(60)] for a in names}   # ~1k-token anchors
    rid = 0
    for rnd in range(6):
        for s in range(agents):
            a = names[s]
            keys = anchors[a] + [rng.getrandbits(62) for _ in range(4)]
            policy.observe(rid, keys, hints=Hints(session=f"w{rnd}-{s // 4}"), now=float(rid))
            policy.admit_blocks(rid, keys, 0 if rnd == 0 else 60)
            policy.finish(rid, float(rid))
            rid += 1
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(policy.inspect().fingerprints.agents()) >= agents * 0.9, "agents were not recognised"
    return used / agents


def bench_replay_speed(policies: Sequence[str], repeats: int = 3) -> dict[str, dict[str, float]]:
    """Calls replayed per second of wall time, per policy and default workload (the same calls,
    cache size and single process as `cachescout bench`; best of `repeats`, as timing noise only
    ever slows a run down). The prompts' block keys are computed once per workload and shared, as
    in `cachescout bench` (a trace file gives them, too): the figure is the replay itself. For
    `cachescout`, also `cachescout-without-decisions`: the same best run less the time its eviction
    decisions took (rescoring and victim choice), i.e. the speed its per-call bookkeeping alone
    would allow."""
    out: dict[str, dict[str, float]] = {}
    for family in FAMILIES:
        sessions = generate(WorkloadSpec(family=family, sessions=300))
        calls = sum(len(s.calls) for s in sessions)
        prompt_keys = PromptKeys(16)   # filled by the calibration's runs
        cfg = EngineConfig(gpu_blocks=calibrate_gpu_blocks(sessions, 16, prompt_keys=prompt_keys), block_size=16)
        for name in policies:
            best, best_deciding = math.inf, 0.0
            for _ in range(repeats):
                policy = make_policy(name, PolicyConfig(block_size=16), sessions)
                deciding = _time_evictions(policy) if name == "cachescout" else None
                t0 = time.perf_counter()
                Engine(cfg, policy, prompt_keys).run(sessions)
                elapsed = time.perf_counter() - t0
                if elapsed < best:
                    best, best_deciding = elapsed, deciding[0] if deciding else 0.0
            out.setdefault(name, {})[family] = calls / best
            if name == "cachescout":
                out.setdefault("cachescout-without-decisions", {})[family] = calls / (best - best_deciding)
    return out


def _time_evictions(policy: Any) -> list[float]:
    """Wrap the policy's `evict` so that the seconds spent in it add up in the returned list."""
    spent = [0.0]
    evict = policy.evict

    def timed(n: int, now: float) -> list:
        t0 = time.perf_counter()
        try:
            return evict(n, now)
        finally:
            spent[0] += time.perf_counter() - t0

    policy.evict = timed
    return spent


def bench_queued_holds(prompt_tokens: Sequence[int] = (10_000, 100_000), repeats: int = 5) -> dict[str, float]:
    """What a queued request's CPU-tier hold costs a worker's background thread (lmcache_tier.QueuedHolds)
    on LMCache's own engine, its CPU tier holding the prompt (stored through vLLM's CPU KV layout):
    hashing the prompt into LMCache's chunk keys and pinning them, then releasing them; and, for
    scale, LMCache's own lookup of the same prompt. Milliseconds, median of `repeats`, per prompt
    length; chunks of 256 tokens."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from cachescout.connector import lmcache_tier
    from cachescout.connector.lmcache_cpu import CpuPagedConnector

    layers, heads, head, block, chunk = 2, 2, 64, 16, 256
    out: dict[str, float] = {}
    for n in prompt_tokens:
        per_token = 2 * layers * heads * head * 2
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=chunk, local_cpu=True,
                                                max_local_cpu_size=4 * n * per_token / 2**30)
        meta = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=torch.float16, kv_shape=(layers, 2, chunk, heads, head), chunk_size=chunk)
        instance = f"cachescout-bench-holds-{n}"
        engine = LMCacheEngineBuilder.get_or_create(instance, cfg, meta, CpuPagedConnector(layers, heads, head),
                                                    lambda *a: None, lambda *a: None)
        try:
            engine.post_init()
            kv = [torch.zeros(n // block + 1, heads, block, 2 * head, dtype=torch.float16) for _ in range(layers)]
            tokens = torch.randint(0, 100_000, (n,), generator=torch.Generator().manual_seed(n))
            engine.store(tokens, kvcaches=kv, slot_mapping=torch.arange(n))
            holds = lmcache_tier.QueuedHolds(engine)
            ids = tokens.tolist()
            hold_ns, release_ns = [], []
            for i in range(repeats):   # the thread's own work, timed in this thread
                t0 = time.perf_counter_ns()
                holds._add(f"r{i}", ids, {})
                t1 = time.perf_counter_ns()
                holds._drop(f"r{i}")
                release_ns.append(time.perf_counter_ns() - t1)
                hold_ns.append(t1 - t0)
            expected = repeats * (n // chunk)
            if holds.stats["hold_chunks"] != expected:
                raise RuntimeError(f"holds pinned {holds.stats['hold_chunks']} chunks, expected {expected}")
            holds.close()
            lookup_ns = []   # for scale: LMCache's own lookup of the same prompt (vLLM asks it once per request)
            for i in range(repeats):
                t0 = time.perf_counter_ns()
                engine.lookup(tokens, lookup_id=f"l{i}", pin=True)
                lookup_ns.append(time.perf_counter_ns() - t0)
                engine.lookup_unpin(f"l{i}")
            out[f"hold_{n}_tokens_ms"] = statistics.median(hold_ns) / 1e6
            out[f"release_{n}_tokens_ms"] = statistics.median(release_ns) / 1e6
            out[f"lmcache_lookup_{n}_tokens_ms"] = statistics.median(lookup_ns) / 1e6
        finally:
            lmcache_tier.close_engine(instance)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--replay", action="store_true",
                    help="instead: the replay engine's speed per policy and workload (about 5 minutes)")
    ap.add_argument("--holds", action="store_true",
                    help="instead: what holding a queued request's CPU-tier prefix costs a worker (needs LMCache)")
    args = ap.parse_args(argv)
    if args.holds:
        _report({"machine": machine(), **bench_queued_holds()}, args.json)
        return 0
    if args.replay:
        speeds = bench_replay_speed(REPLAY_POLICIES)
        print(f"calls replayed per second ({machine()})")
        width = max(map(len, speeds)) + 2
        print("policy".ljust(width) + "".join(f"{f:>10s}" for f in FAMILIES))
        for name, row in speeds.items():
            print(name.ljust(width) + "".join(f"{row[f]:10,.0f}" for f in FAMILIES))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(speeds, fh, indent=1)
        return 0
    figures: dict[str, Any] = {"machine": machine()}
    figures["learner_update_median_us"] = bench_learner_update()
    figures.update(bench_observe())
    figures.update(bench_victims())
    figures["prefetch_plan_median_us"] = bench_prefetch()
    figures["memory_per_agent_bytes_50"] = bench_memory(50)
    figures["memory_per_agent_bytes_1000"] = bench_memory(1000)
    _report(figures, args.json)
    return 0


def _report(figures: dict[str, Any], json_path: str | None) -> None:
    """Print one figure a line; also write them to `json_path` if given."""
    for k, v in figures.items():
        print(f"{k:36s} {v:,.2f}" if isinstance(v, float) else f"{k:36s} {v}")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(figures, fh, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
