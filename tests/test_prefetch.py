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
    """A policy that learned `sup` is always followed by `coder` 0.9 s after it ends, and a time
    `t` 0.6 s after a new `sup` call ended (its `coder` call is then due within 0.5 s)."""
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
    policy.finish(rid, now=t + 0.1)
    policy.clock = lambda: t + 0.7
    return policy, sup, coder, t + 0.7


def test_policy_prefetches_the_predicted_next_agents_anchor():
    policy, sup, coder, t = _supervisor_then_coder()
    coder_keys = chain(coder)
    where = {k: "cpu" for k in coder_keys}
    actions = policy.plan_prefetch(where.get)
    assert actions and actions[0].agent == "coder" and actions[0].keys == tuple(coder_keys)


def test_an_anchor_is_prefetched_only_for_calls_due_within_the_lead_time():
    """The `coder` call comes 0.9 s after `sup` ends: its anchor is not brought back as `sup`
    ends (0.9 s away, over `prefetch_lead_s`), nor for a session idle far beyond its think time,
    only in the last 0.5 s before the call is due."""
    policy, sup, coder, t = _supervisor_then_coder()
    where = {k: "cpu" for k in chain(coder)}.get
    assert policy.cfg.prefetch_lead_s == 0.5
    assert policy.plan_prefetch(where, now=t - 0.6) == []     # the sup call just ended
    assert policy.plan_prefetch(where, now=t + 30.0) == []    # idle for 30 think times
    assert [x.agent for x in policy.plan_prefetch(where, now=t)] == ["coder"]


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


def test_a_context_takes_no_more_room_than_it_is_given():
    p, _ = planner(prefetch_max_actions=10)
    cpu = {k: "cpu" for k in range(10)}.get
    def ctx(room, keys=range(6), session="s"):
        return PrefetchCandidate("coder", 0.9, list(keys), session=session, room=room)
    anchor_ = PrefetchCandidate("a", 0.9, list(range(6, 10)))
    actions = p.plan([ctx(4), anchor_], cpu)
    assert {(a.session, a.keys) for a in actions} == {("s", (0, 1, 2, 3)), (None, (6, 7, 8, 9))}
    assert p.plan([ctx(0)], cpu) == []
    assert p.plan([ctx(None)], cpu)[0].keys == tuple(range(6))          # no limit
    # Rooms nest: what the first took comes out of the second's.
    two = p.plan([ctx(5), ctx(7, range(6, 9), "t")], cpu)
    assert [(a.session, a.keys) for a in two] == [("s", (0, 1, 2, 3, 4)), ("t", (6, 7))]


def test_a_context_larger_than_the_inflight_budget_brings_its_leading_blocks():
    block = PolicyConfig().block_size * PolicyConfig().kv_bytes_per_token
    p, _ = planner(prefetch_max_inflight_bytes=3 * block)
    cpu = {k: "cpu" for k in range(6)}.get
    (action,) = p.plan([PrefetchCandidate("coder", 0.9, list(range(6)), session="s")], cpu)
    assert action.keys == (0, 1, 2)
    assert p.plan([PrefetchCandidate("coder", 0.9, list(range(6)))], cpu) == []   # an anchor: all or nothing


def test_a_sessions_context_comes_back_into_the_room_ranked_below_it():
    """Sessions go sup, coder, sup, coder. Session S called sup with a long task (its leading 6
    blocks still cached, the next 36 in the CPU tier), then coder, which just finished: its next
    call goes to sup and reuses that context. No free block is predicted dead, so a context may
    take only what the eviction order gives up before S's own cached sup context: the last
    trained session's 16 blocks and the two anchors' 4."""
    policy = CacheScoutPolicy(PolicyConfig(), clock=lambda: 0.0)
    sup, coder = anchor("sup", 2), anchor("coder", 2)
    rid = 0

    def call(name: str, a: list, session: str, body: list, t: float) -> list:
        nonlocal rid
        rid += 1
        keys = chain(a + body)
        policy.observe(rid, keys, hints=Hints(agent=name, session=session), now=t)
        policy.admit_blocks(rid, keys, 0)
        policy.finish(rid, now=t + 0.5)
        policy.blocks_freed(list(reversed(keys)), now=t + 0.5)
        return keys

    t = 0.0
    for s in range(30):
        for r in range(2):
            for name, a in (("sup", sup), ("coder", coder)):
                keys = call(name, a, str(s), [("task", s, name, r, i) for i in range(4)], t)
                if s < 29:      # the last session's blocks stay cached
                    policy.blocks_evicted(keys[2:])
                t += 1.0
        t += 1.0
    task = call("sup", sup, "S", [("task", "S", i) for i in range(40)], t + 1.0)
    policy.blocks_evicted(task[6:])
    call("coder", coder, "S", [("task", "S", "c", i) for i in range(3)], t + 2.0)
    now = t + 2.6
    assert policy.dead_room(now) == 0
    order = policy.victims(100_000, now=now)
    assert set(order[20:24]) == set(task[2:6])     # S's cached sup context goes after 20 others
    where = {**{k: "gpu" for k in task[:6]}, **{k: "cpu" for k in task[6:]}}.get
    actions = policy.plan_prefetch(where, now=now)
    assert [(x.agent, x.src, x.keys) for x in actions] == [("sup", "cpu", tuple(task[6:26]))]
