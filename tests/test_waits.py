"""How long sessions without a known agent wait after a call, by how the call ended
(`traffic.WaitSurvival`), and the eviction order it gives their contexts (`scorer.py`)."""

import math

import pytest
from helpers import chain

from cachescout.policy import CacheScoutPolicy, PolicyConfig, output_ending
from cachescout.policy.traffic import WaitSurvival


def _learned(waits: dict, gave_up: dict | None = None) -> WaitSurvival:
    w = WaitSurvival()
    for ending, seconds in waits.items():
        for s in seconds:
            w.waited(ending, s)
    for ending, n in (gave_up or {}).items():
        for _ in range(n):
            w.gave_up(ending)
    return w


def test_nothing_is_predicted_before_enough_waits_were_seen():
    w = _learned({"tool": [5.0] * 31})
    assert w.next_call("tool", 0.0, 60.0) is None
    for _ in range(9):
        w.waited("tool", 5.0)
    p, wait = w.next_call("tool", 0.0, 60.0)
    assert p == pytest.approx(1.0) and 3.0 < wait < 7.0


def test_each_ending_has_its_own_waits():
    """A tool answers in seconds, a person in minutes: a session is judged by how its call ended."""
    w = _learned({"tool": [5.0] * 100, "answer": [600.0] * 100})
    p_tool, wait_tool = w.next_call("tool", 1.0, 60.0)
    p_answer, _ = w.next_call("answer", 1.0, 60.0)
    assert p_tool > 0.9 and 2.0 < wait_tool < 6.0
    assert p_answer < 0.1
    # Within a horizon that reaches the person's wait, the answer's session calls too, later.
    p_answer, wait_answer = w.next_call("answer", 1.0, 1200.0)
    assert p_answer > 0.9 and 400.0 < wait_answer < 800.0


def test_the_chance_of_a_call_is_conditioned_on_the_time_already_waited():
    """Waits of 2 s or 100 s: just after the call, half call within 10 s; once 10 s have passed,
    none does in the next 10 s, and all do within the next 200 s (the long waits are what is left)."""
    w = _learned({"x": [2.0, 100.0] * 50})
    assert w.next_call("x", 0.0, 10.0)[0] == pytest.approx(0.5, abs=0.05)
    assert w.next_call("x", 10.0, 10.0)[0] == pytest.approx(0.0, abs=0.01)
    assert w.next_call("x", 10.0, 200.0)[0] == pytest.approx(1.0, abs=0.01)


def test_sessions_that_expired_without_calling_count_as_never_calling():
    w = _learned({"tool": [5.0] * 50}, gave_up={"answer": 50})
    assert w.next_call("answer", 0.0, 1e6)[0] < 0.15      # only the pool's share drawn in (8 of 58)
    assert w.next_call("tool", 0.0, 60.0)[0] > 0.9       # the pool's share drawn in: 4 of 58 never call


def test_an_ending_seen_rarely_or_never_is_judged_by_all_waits():
    w = _learned({"tool": [5.0] * 60, "answer": [600.0] * 60})
    pool = w.next_call(None, 0.0, 60.0)
    assert pool[0] == pytest.approx(0.5, abs=0.05)
    assert w.next_call("unseen", 0.0, 60.0) == pool
    w.waited("rare", 600.0)   # one wait of its own against the pool's weight of eight
    assert w.next_call("rare", 0.0, 60.0)[0] == pytest.approx(pool[0] * 8 / 9, abs=0.05)


def test_bad_waits_are_ignored_and_endings_are_bounded():
    w = _learned({"tool": [5.0] * 40})
    before = w.next_call("tool", 0.0, 60.0)
    for bad in (-1.0, math.nan, math.inf):
        w.waited("tool", bad)
    assert w.next_call("tool", 0.0, 60.0) == before
    for k in range(1000):
        w.waited(("many", k), 1.0)
    assert len(w._by_ending) <= 256


def test_an_ending_is_read_from_the_last_two_output_tokens():
    assert output_ending([1, 2, 3, 128008]) == (3, 128008)
    assert output_ending([7]) == (7,)
    assert output_ending([]) is None


def _conversation_order(min_confidence: float) -> list[str]:
    """Conversations with no agent in common (each its own prompt, as coding agents' are) whose
    calls end as "tool" (the next comes 5 s later) or "answer" (none comes). Then two more: B's
    last call ended "tool" at t, A's "answer" at t + 2. Which one's context goes first at t + 4?"""
    policy = CacheScoutPolicy(PolicyConfig(min_confidence=min_confidence), clock=lambda: 0.0)
    cached: set = set()
    rid = 0

    def call(conv: str, n: int, t: float, ending: str) -> list[int]:
        nonlocal rid
        rid += 1
        keys = chain([("conv", conv, i) for i in range(n)])
        policy.observe(rid, keys, now=t)
        hit = next((k for k, key in enumerate(keys) if key not in cached), len(keys))
        policy.blocks_reused(keys[:hit])
        policy.admit_blocks(rid, keys, hit)
        cached.update(keys)
        policy.finish(rid, now=t + 1.0, ending=ending)
        policy.blocks_freed(list(reversed(keys)), now=t + 1.0)
        return keys

    t = 0.0
    for c in range(40):
        for i in range(3):
            call(f"c{c}", 4 + 2 * i, t, "tool" if i < 2 else "answer")
            t += 6.0
        t += 1.0
    t += 1000.0   # the trained conversations expire (their last calls' sessions gave up)
    call("B", 4, t - 6.0, "tool")
    b = set(call("B", 6, t, "tool"))
    a = set(call("A", 6, t + 2.0, "answer"))
    order = []
    for key in policy.victims(100_000, now=t + 4.0):
        who = "A" if key in a else "B" if key in b else None
        if who is not None and who not in order:
            order.append(who)
    return order


def test_a_conversation_whose_call_ended_as_those_that_end_goes_before_one_a_tool_keeps_going():
    assert _conversation_order(min_confidence=0.05) == ["A", "B"]
    # Never confident: LRU's order (B's blocks were freed first).
    assert _conversation_order(min_confidence=1.0) == ["B", "A"]
