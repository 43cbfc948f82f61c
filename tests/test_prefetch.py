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


def test_a_context_takes_no_more_room_than_it_is_given():
    p, _ = planner(prefetch_max_actions=10)
    cpu = {k: "cpu" for k in range(10)}.get
    def ctx(room, keys=range(6), session="s"):
        return PrefetchCandidate(None, 0.9, list(keys), session=session, room=room)
    anchor_ = PrefetchCandidate("a", 0.9, list(range(6, 10)))
    actions = p.plan([ctx(4), anchor_], cpu)
    assert {(a.session, a.keys) for a in actions} == {("s", (0, 1, 2, 3)), (None, (6, 7, 8, 9))}
    assert p.plan([ctx(0)], cpu) == []
    assert p.plan([ctx(None)], cpu)[0].keys == tuple(range(6))          # no limit
    # Rooms nest: what the first took comes out of the second's.
    two = p.plan([ctx(5), ctx(7, range(6, 9), "t")], cpu)
    assert [(a.session, a.keys) for a in two] == [("s", (0, 1, 2, 3, 4)), ("t", (6, 7))]


def _conversations(min_confidence: float = 0.05):
    """Conversations with no agent (each its own prompt, as coding agents' are) whose calls end as
    "tool" (the next comes 5 s later) or "answer" (none comes). Then B's call ends "tool" and the
    last 12 of its 16 blocks go to the CPU tier; A's call ends "answer"; the blocks of both still
    cached are free, beside the last trained conversation's 6."""
    policy = CacheScoutPolicy(PolicyConfig(min_confidence=min_confidence), clock=lambda: 0.0)
    rid = 0

    def call(conv: str, n: int, t: float, ending: str) -> list:
        nonlocal rid
        rid += 1
        keys = chain([("conv", conv, i) for i in range(n)])
        policy.observe(rid, keys, now=t)
        policy.admit_blocks(rid, keys, 0)
        policy.finish(rid, now=t + 1.0, ending=ending)
        policy.blocks_freed(list(reversed(keys)), now=t + 1.0)
        return keys

    t = 0.0
    for c in range(40):
        for i in range(3):
            keys = call(f"c{c}", 2 + 2 * i, t, "tool" if i < 2 else "answer")
            if c < 39:     # the last conversation's 6 blocks stay: a free block stays ~1000 s
                policy.blocks_evicted(keys)
            t += 6.0
        t += 1.0
    t += 1000.0   # the trained conversations expire
    b = call("B", 16, t, "tool")
    policy.blocks_evicted(b[4:])
    a = call("A", 4, t, "answer")
    where = {**{k: "gpu" for k in b[:4]}, **{k: "cpu" for k in b[4:]}}.get
    return policy, b, a, where, t + 2.0


def test_a_conversation_with_no_agent_gets_its_context_back_into_room_ranked_below_it():
    policy, b, a, where, now = _conversations()
    order = policy.victims(100_000, now=now)
    # The expired conversation's blocks go first, then A's answered context, then B's.
    assert len(order) == 14 and set(order[6:10]) == set(a) and set(order[10:]) == set(b[:4])
    # B's context comes back as far as the room ranked below it goes: its next 10 blocks.
    actions = policy.plan_prefetch(where, now=now)
    assert [(x.agent, x.keys) for x in actions] == [(None, tuple(b[4:14]))]
    policy.blocks_prefetched(list(actions[0].keys), None, now=now, session=actions[0].session)
    index = policy.inspect().index
    assert {index.block(k).group for k in actions[0].keys} == {index.block(b[0]).group}   # filed with B's context


def test_no_context_comes_back_over_blocks_plain_lru_would_keep():
    policy, b, a, where, now = _conversations(min_confidence=1.0)   # never confident: LRU's order
    assert policy.dead_room(now) == 0
    assert policy.plan_prefetch(where, now=now) == []
