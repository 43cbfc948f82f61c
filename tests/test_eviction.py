import math
from collections import OrderedDict

from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cachescout.policy import EvictionIndex


def _state(index: EvictionIndex):
    """Everything observable about the index, for before/after comparisons."""
    groups = {}
    for g in index.groups():
        groups[g.gid] = ([b.key for b in g.free_blocks()], g.n_free, g.n_blocks, g.n_backed_free, g.model, g.conf)
    return groups, index.n_free, len(index)


class LruEquivalence(RuleBasedStateMachine):
    """With zero confidence everywhere the index must evict exactly like vLLM's LRU free queue,
    however blocks are spread over groups."""

    def __init__(self):
        super().__init__()
        self.index = EvictionIndex()
        self.groups = [self.index.group(("g", i), "context") for i in range(4)]
        self.ref_free: OrderedDict = OrderedDict()  # key -> None, in free order
        self.in_use: set = set()
        self.next_key = 0
        self.now = 0.0

    @rule(group=st.integers(0, 3), n=st.integers(1, 5))
    def allocate(self, group, n):
        for _ in range(n):
            key = self.next_key
            self.next_key += 1
            self.index.add(key, self.groups[group])
            self.in_use.add(key)

    @rule(data=st.data(), dt=st.sampled_from([0.0, 0.5, 3.0]))
    def free_some(self, data, dt):
        if not self.in_use:
            return
        keys = data.draw(st.lists(st.sampled_from(sorted(self.in_use)), unique=True, max_size=6))
        self.now += dt
        self.index.release(keys, self.now)
        for k in keys:
            self.in_use.discard(k)
            self.ref_free[k] = None

    @rule(data=st.data())
    def reuse(self, data):
        if not self.ref_free:
            return
        keys = data.draw(st.lists(st.sampled_from(list(self.ref_free)), unique=True, max_size=4))
        self.index.acquire(keys)
        for k in keys:
            del self.ref_free[k]
            self.in_use.add(k)

    @rule(data=st.data(), group=st.integers(0, 3))
    def regroup(self, data, group):
        keys = sorted(self.in_use) + list(self.ref_free)
        if keys:
            key = data.draw(st.sampled_from(keys))
            self.index.add(key, self.groups[group])

    @rule(n=st.integers(1, 6), dt=st.sampled_from([0.0, 1.0]))
    def evict(self, n, dt):
        self.now += dt
        before = _state(self.index)
        chosen = self.index.victims(n, self.now)
        assert _state(self.index) == before, "choosing victims changed state"
        expected = list(self.ref_free)[:n]
        assert chosen == expected
        assert self.index.lru_victims(n) == expected
        assert self.index.evict(n, self.now) == expected
        for k in expected:
            del self.ref_free[k]

    @invariant()
    def counts_agree(self):
        assert self.index.n_free == len(self.ref_free)
        assert len(self.index) == len(self.ref_free) + len(self.in_use)


TestLruEquivalence = LruEquivalence.TestCase


def _exact_order(index: EvictionIndex, now: float) -> list:
    """Every free block by its eviction key at `now` (highest first, ties to the first freed),
    computed block by block: what the index's group-head heaps must reproduce."""
    def key(g, b):
        age = math.log(max(now - b.freed_at, 0.0) + 1e-3)
        return age if g.conf <= 0.0 else g.conf * g.model + (1.0 - g.conf) * age
    free = [(key(g, b), b.seq, b.key) for g in index.groups() for b in g.free_blocks()]
    return [k for _, _, k in sorted(free, key=lambda t: (-t[0], t[1]))]


class ScoredOrder(RuleBasedStateMachine):
    """With any scores, `victims` and `evict` take blocks in the exact key order at the time asked,
    across calls at advancing times (which `evict` serves from a heap keyed ahead of time)."""

    def __init__(self):
        super().__init__()
        self.index = EvictionIndex()
        self.groups = [self.index.group(("g", i), "context") for i in range(5)]
        self.in_use: set = set()
        self.next_key = 0
        self.now = 0.0

    @rule(group=st.integers(0, 4), n=st.integers(1, 4))
    def allocate(self, group, n):
        for _ in range(n):
            self.index.add(self.next_key, self.groups[group])
            self.in_use.add(self.next_key)
            self.next_key += 1

    @rule(data=st.data(), dt=st.sampled_from([-0.5, 0.0, 0.01, 0.04, 0.3, 2.0]))
    def free_some(self, data, dt):   # a clock may step back: free times are held, never reversed
        if self.in_use:
            keys = data.draw(st.lists(st.sampled_from(sorted(self.in_use)), unique=True, max_size=5))
            self.now += dt
            self.index.release(keys, self.now)
            self.in_use.difference_update(keys)

    @rule(data=st.data())
    def reuse(self, data):
        free = [b.key for g in self.index.groups() for b in g.free_blocks()]
        if free:
            keys = data.draw(st.lists(st.sampled_from(free), unique=True, max_size=3))
            self.index.acquire(keys)
            self.in_use.update(keys)

    @rule(data=st.data(), group=st.integers(0, 4))
    def regroup(self, data, group):
        keys = [b for b in range(self.next_key) if b in self.index]
        if keys:
            self.index.add(data.draw(st.sampled_from(keys)), self.groups[group])

    @rule(scores=st.lists(st.tuples(st.floats(-8, 8), st.sampled_from([0.0, 0.2, 0.5, 0.9, 1.0])),
                          min_size=5, max_size=5))
    def rescore(self, scores):
        for g, (model, conf) in zip(self.groups, scores, strict=True):
            g.model, g.conf = model, conf
        self.index.scores_changed()

    @rule(group=st.integers(0, 4), model=st.floats(-8, 8), conf=st.sampled_from([0.0, 0.5, 1.0]))
    def rescore_one(self, group, model, conf):   # one group between full rescorings (KVFlow's way)
        g = self.groups[group]
        g.model, g.conf = model, conf
        self.index.rescored(g)

    @rule(n=st.integers(1, 6), dt=st.sampled_from([0.0, 0.005, 0.03, 0.08, 0.5]))
    def evict(self, n, dt):
        self.now += dt
        expected = _exact_order(self.index, self.now)[:n]
        assert self.index.victims(n, self.now) == expected
        assert self.index.evict(n, self.now) == expected

    @invariant()
    def counts_agree(self):
        assert self.index.n_free == len(_exact_order(self.index, self.now))


TestScoredOrder = ScoredOrder.TestCase


def test_evict_follows_an_order_that_time_changed():
    # A's head is old and predicted to be needed soon; B's was freed just now, and its age term
    # overtakes A's key within 10 ms: the second eviction, from the same heap, must take B.
    index = EvictionIndex()
    a, b = index.group("a", "context"), index.group("b", "context")
    for key, g in ((1, a), (2, a), (3, b), (4, b)):
        index.add(key, g)
    index.release([1, 2], now=0.0)
    index.release([3, 4], now=10.0)
    a.model, a.conf = -16.0, 0.5
    index.scores_changed()
    assert index.evict(1, now=10.0) == [1]
    assert _exact_order(index, 10.01)[:1] == [3]
    assert index.evict(1, now=10.01) == [3]


def test_a_clock_stepping_back_keeps_free_order():
    index = EvictionIndex()
    g, h = index.group("g", "context"), index.group("h", "context")
    for key, grp in ((1, g), (2, g), (3, g), (4, h)):
        index.add(key, grp)
    index.release([1, 2], now=5.0)
    index.release([4], now=4.9)
    index.release([3], now=4.0)   # an earlier time than the blocks freed before it
    assert index.block(3).freed_at == 5.0
    g.model, g.conf = 0.0, 0.5
    index.scores_changed()
    assert index.victims(4, now=5.5) == _exact_order(index, 5.5) == [1, 2, 3, 4]


def _filled(scores):
    index = EvictionIndex()
    groups = []
    key = 0
    for i, (model, conf) in enumerate(scores):
        g = index.group(("g", i), "anchor")
        g.model, g.conf = model, conf
        groups.append(g)
        for _ in range(3):
            index.add(key, g)
            key += 1
    index.release(range(key), now=0.0)
    index.scores_changed()
    return index, groups


def test_confident_scores_override_recency():
    # group 0 freed first (LRU would take it) but is predicted to be needed soon
    index, _ = _filled([(-5.0, 1.0), (5.0, 1.0)])
    assert index.victims(3, now=1.0) == [3, 4, 5]
    assert index.evict(4, now=1.0) == [3, 4, 5, 0]


def test_half_confidence_blends_age_and_model():
    index, groups = _filled([(0.0, 0.5), (0.0, 0.5)])
    # same model term: the older group goes first, within a group the first freed goes first
    assert index.victims(6, now=10.0) == [0, 1, 2, 3, 4, 5]


@given(st.lists(st.tuples(st.floats(-10, 10), st.floats(0, 1)), min_size=1, max_size=6), st.integers(0, 20))
def test_victims_is_pure_and_evict_agrees(scores, n):
    index, _ = _filled(scores)
    before = _state(index)
    first = index.victims(n, now=2.0)
    assert index.victims(n, now=2.0) == first
    assert _state(index) == before
    assert index.evict(n, now=2.0) == first
    assert len(index) == 3 * len(scores) - len(first)


def test_evict_heap_follows_changes_between_calls():
    index, groups = _filled([(1.0, 1.0), (0.0, 1.0)])
    assert index.evict(1, now=1.0) == [0]
    index.acquire([1])                     # group 0's next head is reused: skip it
    assert index.evict(2, now=1.0) == [2, 3]
    index.release([1], now=1.0)
    assert index.evict(10, now=1.0) == [1, 4, 5]
    assert index.n_free == 0


def test_backed_counts_follow_free_state():
    index = EvictionIndex()
    g = index.group("x", "anchor")
    index.add(1, g)
    index.set_backed(1, True)
    assert g.n_backed_free == 0
    index.release([1], 0.0)
    assert g.n_backed_free == 1
    index.acquire([1])
    assert g.n_backed_free == 0
    index.discard(1)
    assert index.get_group("x") is g and g.n_blocks == 0
    assert index.prune_groups() == 1
    assert index.get_group("x") is None


def test_a_group_rescored_alone_is_re_keyed_in_evict_s_heap():
    index = EvictionIndex()
    a, b = index.group("a", "context"), index.group("b", "context")
    for g in (a, b):
        for k in range(3):
            index.add((g.gid, k), g)
        index.release([(g.gid, k) for k in range(3)], 0.0)
    a.model, a.conf, b.model, b.conf = 1.0, 1.0, 5.0, 1.0
    index.scores_changed()
    assert index.evict(1, 0.01) == [("b", 0)]      # the heap is built: b is colder
    a.model = 9.0                                  # now a is, and only a was rescored
    index.rescored(a)
    assert index.victims(1, 0.02) == index.evict(1, 0.02) == [("a", 0)]
