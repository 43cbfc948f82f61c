from helpers import anchor, chain

from cachescout.policy import (CacheScoutPolicy, Hints, PolicyConfig, PrefetchCandidate, PrefetchPlanner)
from cachescout.policy.costs import RebuildCost


def planner(**over):
    cfg = PolicyConfig(**over)
    return PrefetchPlanner(cfg, RebuildCost(cfg)), cfg


def test_plans_cpu_to_gpu_and_redis_to_cpu_within_limits():
    p, cfg = planner(prefetch_max_actions=10)
    where = {**{k: "cpu" for k in range(0, 5)}, **{k: "redis" for k in range(5, 8)}, 8: "gpu"}
    actions = p.plan([PrefetchCandidate("coder", 0.9, list(range(9)), 0.8)], where.get)
    assert [(a.src, a.dst, a.keys) for a in actions] == [("cpu", "gpu", (0, 1, 2, 3, 4)), ("redis", "cpu", (5, 6, 7))]
    assert actions[0].bytes == 5 * cfg.block_size * cfg.kv_bytes_per_token
    assert actions[0].load_s < actions[0].recompute_s


def test_stops_at_the_first_block_that_is_nowhere():
    p, _ = planner()
    where = {0: "cpu", 2: "cpu"}
    actions = p.plan([PrefetchCandidate("a", 0.9, [0, 1, 2])], where.get)
    assert [a.keys for a in actions] == [(0,)]


def test_thresholds_confidence_budget_and_cost():
    p, cfg = planner()
    cpu = {k: "cpu" for k in range(4)}.get
    assert p.plan([PrefetchCandidate("a", 0.4, range(4))], cpu) == []            # unlikely
    assert p.plan([PrefetchCandidate("a", 0.9, range(4), 0.1)], cpu) == []       # unsure model
    assert p.plan([PrefetchCandidate("a", 0.9, range(4))], cpu) != []
    block = cfg.block_size * cfg.kv_bytes_per_token
    tight, _ = planner(prefetch_max_inflight_bytes=3 * block)
    assert tight.plan([PrefetchCandidate("a", 0.9, range(4))], cpu) == []        # over budget
    assert tight.plan([PrefetchCandidate("a", 0.9, range(3))], cpu, inflight_bytes=block) == []
    assert tight.plan([PrefetchCandidate("a", 0.9, range(3))], cpu) != []
    slow, _ = planner(cpu_load_gbps=0.01)                                         # slower than recompute
    assert slow.plan([PrefetchCandidate("a", 0.9, range(4))], cpu) == []
    assert slow.plan([PrefetchCandidate("a", 0.9, range(4))], {k: "redis" for k in range(4)}.get) == []
    few, _ = planner(prefetch_max_actions=1)
    two = [PrefetchCandidate("a", 0.9, [0]), PrefetchCandidate("b", 0.95, [1])]
    assert [a.agent for a in few.plan(two, {0: "cpu", 1: "cpu"}.get)] == ["b"]


def _supervisor_then_coder():
    """A policy that learned `sup` is always followed by `coder`, with a new `sup` call in flight."""
    policy = CacheScoutPolicy(PolicyConfig())
    sup, coder = anchor("sup", 5), anchor("coder", 7)
    t = 0.0
    for s in range(30):  # every session: supervisor then coder
        for name, a in (("sup", sup), ("coder", coder)):
            rid = (s, name)
            policy.observe(rid, chain(a + [("task", s), name]), hints=Hints(agent=name, session=str(s)), now=t)
            policy.finish(rid, now=t + 0.1)
            t += 1.0
    rid = ("new", "sup")
    policy.observe(rid, chain(sup + [("task", "new")]), hints=Hints(agent="sup", session="new"), now=t)
    return policy, sup, coder, t


def test_policy_prefetches_the_predicted_next_agents_anchor():
    policy, sup, coder, t = _supervisor_then_coder()
    coder_keys = chain(coder)
    where = {k: "cpu" for k in coder_keys}
    actions = policy.plan_prefetch(where.get)
    assert actions and actions[0].agent == "coder" and actions[0].keys == tuple(coder_keys)


def test_no_prefetch_and_no_cpu_ranking_while_the_guard_keeps_to_lru():
    """Where acting on the model loses to LRU (trust 0), what is built on its predictions stops too:
    no prefetch, agent scores of 0 (the CPU tier's plain LRU); a hinted next agent still counts."""
    policy, sup, coder, t = _supervisor_then_coder()
    where = {k: "cpu" for k in chain(coder)}.get
    assert policy.plan_prefetch(where) and policy.next_agent_probabilities()["coder"][1] > 0
    policy.inspect().guard.trust = 0.0
    assert policy.plan_prefetch(where) == []
    assert all(conf == 0.0 for _, conf in policy.next_agent_probabilities().values())
    policy.observe(("hinted", "sup"), chain(sup + [("task", "h")]),
                   hints=Hints(agent="sup", session="h", next_agent="coder"), now=t + 1)
    assert policy.next_agent_probabilities()["coder"] == (1.0, 1.0)


def test_prefetching_stops_while_prefetched_blocks_go_unused_and_resumes_when_they_are_used():
    policy, sup, coder, t = _supervisor_then_coder()
    where = {k: "cpu" for k in chain(coder)}.get
    keys = tuple(chain(coder))
    assert policy.prefetch_precision() is None
    for _ in range(6):                                 # 42 prefetched blocks evicted unread
        assert policy.plan_prefetch(where)
        policy.blocks_prefetched(keys, "coder", now=t)
        policy.blocks_evicted(keys)
    assert policy.prefetch_precision() == 0.0
    assert sum(bool(policy.plan_prefetch(where)) for _ in range(64)) == 1   # one probe round in 64
    for _ in range(12):                                # then read before eviction
        policy.blocks_prefetched(keys, "coder", now=t)
        policy.blocks_reused(keys)
    assert policy.prefetch_precision() > 0.5 and policy.plan_prefetch(where)
