import dataclasses
import math
import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers import anchor, chain

from cachescout.bench.policies import make_policy
from cachescout.bench.replay import Engine, EngineConfig, chain_hashes
from cachescout.bench.run import calibrate_gpu_blocks
from cachescout.bench.workloads import WorkloadSpec, generate
from cachescout.policy import CacheScoutPolicy, Hints, PolicyConfig, TransitionSnapshot
from cachescout.policy.sessions import Session
from cachescout.policy.state import COUNT_SCALE
from cachescout.policy.transitions import END

AGENTS = ["sup", "coder", "search", "critic"]


def _drive(policy: CacheScoutPolicy, ops, hinted: bool):
    """Run random requests through the policy like a block pool would, checking every eviction
    against vLLM's LRU free queue (kept here as an OrderedDict). Each session's calls to an agent
    extend its previous prompt to it (nothing is left out: no block is spent, see test_spent.py)."""
    ref: dict[int, int] = {}
    free: OrderedDict = OrderedDict()
    live = {}
    contexts: dict = {}
    now = 0.0
    rid = 0
    for op, a, b in ops:
        now += 0.1
        if op == "call":
            agent = AGENTS[a % len(AGENTS)]
            context = contexts.setdefault((agent, b % 3), [])
            context += [("t", rid, k) for k in range(1 + b % 5)]
            prompt = chain(anchor(agent, 4) + context)
            hints = Hints(agent=agent, session=f"s{b % 3}") if hinted else None
            policy.observe(rid, prompt, hints=hints, now=now)
            hit = 0
            while hit < len(prompt) and prompt[hit] in ref:
                hit += 1
            for k in prompt[:hit]:
                if ref[k] == 0:
                    del free[k]
                ref[k] += 1
            for k in prompt[hit:]:
                ref[k] = ref.get(k, 0) + 1
            policy.admit_blocks(rid, prompt, hit)
            live[rid] = prompt
            rid += 1
        elif op == "finish" and live:
            r = sorted(live)[a % len(live)]
            prompt = live.pop(r)
            freed = []
            for k in reversed(prompt):
                ref[k] -= 1
                if ref[k] == 0:
                    freed.append(k)
                    free[k] = None
            policy.finish(r, now)
            policy.blocks_freed(freed, now)
        elif op == "evict":
            n = 1 + a % 4
            expected = list(free)[:n]
            before = policy.victims(n, now)
            assert before == expected
            assert policy.evict(n, now) == expected
            for k in expected:
                del free[k]
                del ref[k]


ops = st.lists(st.tuples(st.sampled_from(["call", "call", "finish", "evict"]), st.integers(0, 50),
                         st.integers(0, 50)), max_size=80)


@given(ops)
def test_empty_model_evicts_exactly_like_lru(seq):
    _drive(CacheScoutPolicy(PolicyConfig(min_confidence=0.05)), seq, hinted=False)


@given(ops)
def test_uniform_model_evicts_exactly_like_lru(seq):
    policy = CacheScoutPolicy(PolicyConfig())
    # A strong prior that any agent follows any agent (and any session may end) uniformly.
    uniform = {src: {dst: 10**6 * COUNT_SCALE for dst in AGENTS + ["<end>"]} for src in AGENTS + ["<start>"]}
    policy.absorb(TransitionSnapshot(policy.half_life, uniform))
    _drive(policy, seq, hinted=True)
    assert policy.confidence() == 0.0


def _policy_state(core: CacheScoutPolicy):
    parts = core.inspect()
    groups = sorted((repr(g.gid), tuple(b.key for b in g.free_blocks()), g.n_blocks) for g in parts.index.groups())
    sessions = [(s.sid, s.agent, s.calls, s.in_flight) for s in parts.sessions]
    return parts.learner.decayed_rows(), sessions, groups, parts.index.n_free


def test_choosing_victims_never_changes_state():
    sessions = generate(WorkloadSpec(family="gaia", sessions=40, seed=3))
    policy = make_policy("cachescout", PolicyConfig())
    checked = []

    class Probe(type(policy)):
        def evict(self, n, now):
            before = _policy_state(self.core)
            first = self.core.victims(n, now)
            assert self.core.victims(n, now) == first
            assert _policy_state(self.core) == before
            checked.append(n)
            out = super().evict(n, now)
            assert out == first
            return out

    probe = Probe(PolicyConfig())
    Engine(EngineConfig(gpu_blocks=1500), probe).run(sessions)
    assert len(checked) > 20


@settings(max_examples=1, deadline=None)
@given(st.just(None))
def test_learned_routing_beats_lru_and_random_routing_does_not_lose(_):
    figures = {}
    for routing in ("learned", "random"):
        sessions = generate(WorkloadSpec(family="gaia", sessions=150, routing=routing, seed=7))
        blocks = calibrate_gpu_blocks(sessions, 16)
        for name in ("lru", "cachescout"):
            result = Engine(EngineConfig(gpu_blocks=blocks), make_policy(name, PolicyConfig())).run(sessions)
            figures[(routing, name)] = result.summary()["token_hit_rate"]
    assert figures[("learned", "cachescout")] >= figures[("learned", "lru")] + 0.05, figures
    assert figures[("random", "cachescout")] >= figures[("random", "lru")] - 0.01, figures


def test_hints_from_params_keep_good_values_and_report_bad_ones():
    hints, bad = Hints.from_params({"cachescout.agent": "coder", "cachescout.session_id": 42,
                                    "cachescout.next_agent": ["x"], "other": 1})
    assert hints == Hints(agent="coder", session="42", next_agent=None)
    assert bad == ["cachescout.next_agent"]
    assert Hints.from_params(None) == (None, [])
    assert Hints.from_params({"cachescout.agent": "x" * 300}) == (None, ["cachescout.agent"])


def test_hinted_agent_names_replace_inferred_ids():
    policy = CacheScoutPolicy(PolicyConfig())
    a = anchor("coder", 6)
    for s in range(6):
        obs = policy.observe(s, chain(a + [("t", s)]), hints=Hints(agent="coder"), now=float(s))
    later = policy.observe(99, chain(a + [("t", 99)]), now=10.0)   # no hint: the alias applies
    assert obs.agent == "coder" and later.agent == "coder"


def test_submit_and_drain_bound_the_queue():
    policy = CacheScoutPolicy(PolicyConfig(), max_pending=2)
    assert policy.submit(1, chain([1, 2]), now=0.0) and policy.submit(2, chain([1, 3]), now=0.0)
    assert not policy.submit(3, chain([1, 4]), now=0.0)
    assert policy.stats["dropped_events"] == 1
    assert [o.request_id for o in policy.drain()] == [1, 2]


def test_snapshot_round_trip_between_replicas():
    a, b = CacheScoutPolicy(), CacheScoutPolicy()
    for s in range(20):
        a.observe(("a", s), chain(anchor("sup", 3) + [s]), hints=Hints(agent="sup", session=str(s)), now=s)
        a.observe(("b", s), chain(anchor("coder", 3) + [s]), hints=Hints(agent="coder", session=str(s)), now=s + 0.5)
    blob = a.snapshot().encode()
    b.absorb(TransitionSnapshot.decode(blob))
    assert b.predict_next("sup")[0][0] == "coder"
    with pytest.raises(ValueError, match="half_life"):
        b.absorb(dataclasses.replace(a.snapshot(), half_life=1.0))


def test_unlinked_sessions_are_detected_and_linked_ones_trusted():
    """Without token ids, one workflow's calls to different agents cannot be linked: context
    predictions must then stop counting; with token ids they must count fully."""
    sessions = generate(WorkloadSpec(family="swebench", sessions=80, seed=12))
    links = {}
    for name in ("cachescout", "cachescout-hashonly"):
        policy = make_policy(name, PolicyConfig(), sessions)
        Engine(EngineConfig(gpu_blocks=4000), policy).run(sessions)
        links[name] = policy.core.inspect().scorer.session_links()
    assert links["cachescout"] == 1.0
    assert links["cachescout-hashonly"] < 0.2


def test_two_sessions_with_the_same_task_keep_their_own_calls():
    """A task two sessions share (the same question asked twice) is evidence for neither: each
    session's next agent joins it through what only that session produced."""
    rng = random.Random(5)

    def text(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    sup, coder = text(16 * 8), text(16 * 8)
    policy = CacheScoutPolicy(PolicyConfig(block_size=16))
    clock = iter(range(1, 1000))

    def call(rid, tokens, output=None):
        now = float(next(clock))
        obs = policy.observe(rid, chain_hashes(tokens, 16), tokens=tokens, now=now)
        policy.finish(rid, now + 0.5, output_tokens=output)
        return obs

    for s in range(8):   # sessions with tasks of their own: the anchors are learned
        task, out = text(100), text(40)
        call((s, 0), sup + task, out)
        call((s, 1), coder + task + out)
    task, out_a, out_b = text(100), text(40), text(40)
    a0 = call(("A", 0), sup + task, out_a)
    b0 = call(("B", 0), sup + task, out_b)
    b1 = call(("B", 1), coder + task + out_b)
    a1 = call(("A", 1), coder + task + out_a)
    assert a0.session != b0.session
    assert (b1.session, a1.session) == (b0.session, a0.session)
    # Back to the supervisor: each continues the prompt both sent, with its own instruction.
    a2 = call(("A", 2), sup + task + out_a + text(40))
    b2 = call(("B", 2), sup + task + out_b + text(40))
    assert (a2.session, b2.session) == (a0.session, b0.session)


def test_the_chain_learns_where_workflows_end_long_before_sessions_expire():
    """A session idle far longer than its last agent's usual wait has ended: the chain learns
    that then, not when the session times out (minutes later)."""
    policy = CacheScoutPolicy(PolicyConfig(session_idle_timeout_s=300.0))
    sup, summ = anchor("sup", 6), anchor("summarizer", 6)
    now = 0.0
    for s in range(12):
        for i, part in enumerate((sup, summ)):
            policy.observe((s, i), chain(part + [("t", s)]), hints=Hints(session=str(s)), now=now)
            policy.finish((s, i), now + 0.5)
            now += 0.6
        now += 5.0
    summarizer = policy.observe(("x", 0), chain(summ + [("t", "x")]), now=now).agent
    assert policy.inspect().learner.probability(summarizer, END) > 0.5
    assert len(policy.inspect().sessions) > 10    # they have not expired


def _two_served_and_freed(n):
    """A never-confident policy (LRU order) after requests A and then B of `n` blocks each ran and
    freed their blocks: A's are the oldest."""
    policy = CacheScoutPolicy(PolicyConfig(min_confidence=1.0))
    a, b = chain([("a", i) for i in range(n)]), chain([("b", i) for i in range(n)])
    for t, (rid, keys) in enumerate((("A", a), ("B", b))):
        policy.observe(rid, keys, now=t)
        policy.admit_blocks(rid, keys, 0)
        policy.finish(rid, now=t + 0.5)
        policy.blocks_freed(list(reversed(keys)), now=t + 0.5)
    return policy, a, b


def test_a_queued_requests_cached_prefix_is_evicted_last_until_it_is_admitted():
    """Blocks a queued request will hit are not a prediction: they go after every other free block
    even when the policy trusts nothing (LRU otherwise), and in LRU order again once it is admitted."""
    policy, a, b = _two_served_and_freed(4)
    assert policy.victims(8, now=3.0) == list(reversed(a)) + list(reversed(b))   # LRU: A's first
    c = a + chain([("c", 0)])[-1:]
    policy.observe("C", c, now=3.0)                                              # queued: wants A's
    assert policy.victims(8, now=3.0) == list(reversed(b)) + list(reversed(a))
    assert policy.evict(4, now=3.0) == list(reversed(b))
    policy.blocks_reused(a[:2])
    policy.admit_blocks("C", a[:2] + [c[4]], 2)        # hit two; the other two are not wanted now
    assert policy.victims(8, now=3.0) == [a[3], a[2]]
    policy.finish("C", now=4.0)
    policy.blocks_freed([c[4], a[1], a[0]], now=4.0)
    assert policy.victims(8, now=4.0) == [a[3], a[2], c[4], a[1], a[0]]


def test_a_request_that_ends_while_queued_releases_what_it_wanted():
    policy, a, b = _two_served_and_freed(3)
    policy.observe("Q1", a, now=3.0)
    policy.observe("Q2", a[:2], now=3.0)              # two queued requests want A's first blocks
    policy.finish("Q1", now=3.5)                     # aborted before it was admitted
    assert policy.victims(6, now=4.0) == [a[2]] + list(reversed(b)) + [a[1], a[0]]
    policy.finish("Q2", now=3.6)
    assert policy.victims(6, now=4.0) == list(reversed(a)) + list(reversed(b))


def test_blocks_another_request_hits_stay_kept_for_the_queued_one():
    policy, a, b = _two_served_and_freed(3)
    policy.observe("Q", a, now=3.0)                 # queued
    r = a[:2] + chain([("r", 0)])[-1:]
    policy.observe("R", r, now=3.1)                 # admitted at once, hitting two of Q's blocks
    policy.blocks_reused(a[:2])
    policy.admit_blocks("R", r, 2)
    policy.finish("R", now=3.5)
    policy.blocks_freed(list(reversed(r)), now=3.5)
    assert policy.victims(7, now=4.0) == list(reversed(b)) + [r[2], a[2], a[1], a[0]]


def _context_model(old_branch: bool) -> float:
    """The `model` of probe session P's context 10 s after its last call, its agent's waits
    irregular. With `old_branch`, P's first call (100 s before) sent blocks its second call left
    out (a conversation edited), which stay in P's context group as its oldest free blocks."""
    clock = [0.0]
    policy = CacheScoutPolicy(PolicyConfig(min_confidence=0.0), clock=lambda: clock[0])  # use any confidence
    cached: set = set()

    def call(rid, prompt, session: str, t: float):
        """One call as a block pool runs it: hits on what is cached, the rest computed, all freed."""
        keys = chain(prompt)
        clock[0] = t
        obs = policy.observe(rid, keys, hints=Hints(agent="X", session=session), now=t)
        hit = next((k for k, key in enumerate(keys) if key not in cached), len(keys))
        policy.blocks_reused(keys[:hit])
        policy.admit_blocks(rid, keys, hit)
        cached.update(keys)
        clock[0] = t + 1.0
        policy.finish(rid, now=t + 1.0)
        policy.blocks_freed(list(reversed(keys)), now=t + 1.0)
        return obs.session

    x = anchor("X", 4)
    now = 0.0
    for s in range(8):                     # the chain learns X -> X
        ctx = [("s", s)]
        for i in range(3):
            ctx = ctx + [("s", s, i)]
            call((s, i), x + ctx, f"s{s}", now)
            now += 3.0
    prompts = [x + [("p", "old")], x + [("p", "new")]] if old_branch else [x + [("p", "new")]] * 2
    for i, prompt in enumerate(prompts):
        probe = call(("P", i), prompt, "P", now + 100.0 * i)
    now += 100.0
    # State set through the internals: waits as irregular as people's (reliability about 0.28),
    # and expired sessions' blocks often used again, so that both the recency stand-in and the
    # floor take part in the context's score.
    inside = policy.inspect()
    inside.traffic.think.spread["X"] = 4.0
    inside.traffic.dead_reuse = 0.5
    inside.scorer.invalidate()
    clock[0] = now + 11.0
    policy.victims(1, now=now + 11.0)
    (group,) = [g for g in inside.index.groups() if g.kind == "context" and g.session == probe]
    assert group.conf > 0                   # a prediction, not plain LRU order
    return group.model


def test_a_context_is_as_recent_as_the_blocks_its_session_last_used():
    """Blocks a conversation's later calls left out do not make its context look idle since they
    were freed: the group is scored from its session's last use (its youngest free block)."""
    assert _context_model(old_branch=True) == pytest.approx(_context_model(old_branch=False))


@pytest.mark.parametrize("waits, inverted", [([10.0] * 40, True), ([1.0, 100.0] * 20, False)])
def test_an_idle_session_is_due_sooner_the_longer_it_waited_only_where_waits_are_regular(waits, inverted):
    """After a call, a session of an agent whose waits are regular (a tool: 10 s every time) is due
    again in what remains of the wait; where they are spread like people's (1 s or 100 s, the same
    typical wait of 10 s), one that finished a moment ago is not judged far later than one that
    has waited most of the typical wait."""
    inside = CacheScoutPolicy(PolicyConfig()).inspect()
    for w in waits:
        inside.traffic.waited("X", w)
    assert inside.traffic.think.get("X") == pytest.approx(10.0, rel=0.3)

    def due_in(idle: float) -> float:
        session = Session("s", agent="X", last_call_at=0.0, last_finish_at=1.0)
        return inside.scorer.next_call_in(session, now=1.0 + idle)[0]

    ratio = due_in(0.5) / due_in(9.0)
    assert ratio > 5.0 if inverted else ratio < 2.5


def _contexts_by_depth(attention: float) -> dict[int, tuple[float, float, int]]:
    """Two sessions of agent X that call at the same times, one with a short context (2 blocks after
    the anchor), one with a long one (300 blocks): their context groups' (model, conf, next
    victim's depth) once both are idle, with `attention_s_per_token_context` as given."""
    policy = CacheScoutPolicy(PolicyConfig(min_confidence=0.0, attention_s_per_token_context=attention),
                              clock=lambda: 0.0)
    x = anchor("X", 4)
    cached: set = set()
    sessions = {}
    for t in range(6):
        for length in (2, 300):
            keys = chain(x + [("ctx", length, i) for i in range(length + t)])
            rid = (length, t)
            obs = policy.observe(rid, keys, hints=Hints(agent="X", session=f"s{length}"), now=10.0 * t)
            sessions[length] = obs.session
            hit = next((k for k, key in enumerate(keys) if key not in cached), len(keys))
            policy.blocks_reused(keys[:hit])
            policy.admit_blocks(rid, keys, hit)
            cached.update(keys)
            policy.finish(rid, now=10.0 * t + 1.0)
            policy.blocks_freed(list(reversed(keys)), now=10.0 * t + 1.0)
    policy.victims(1, now=60.0)
    groups = {g.session: g for g in policy.inspect().index.groups() if g.kind == "context"}
    return {n: (groups[s].model, groups[s].conf, groups[s].head.depth) for n, s in sessions.items()}


def test_where_attention_is_priced_a_deep_context_is_kept_by_what_its_recompute_costs():
    flat, priced = _contexts_by_depth(0.0), _contexts_by_depth(1.33e-9)
    cost = CacheScoutPolicy(PolicyConfig(attention_s_per_token_context=1.33e-9)).inspect().cost
    assert flat[300][2] == 4 + 305 - 1     # the next victim: the last call's deepest block
    for n in (2, 300):
        model, conf, depth = priced[n]
        assert conf > 0 and conf == flat[n][1]
        # Used as often, lost at a dearer recompute: scored as if used that many times more often.
        assert model == pytest.approx(flat[n][0] - math.log(cost.depth_factor(depth)))
    assert flat[2][0] == pytest.approx(flat[300][0])     # depth-blind: one score for both
    assert priced[300][0] < priced[2][0]                  # priced: the deep one goes later
