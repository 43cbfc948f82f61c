import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachescout.policy import END, START, TransitionLearner

agents = st.sampled_from(["sup", "coder", "search", "math", "critic", "sum", END])
transitions = st.lists(st.tuples(agents, agents), max_size=300)


def test_probabilities_follow_counts():
    tl = TransitionLearner(half_life=1e9)
    for _ in range(3):
        tl.update("sup", "coder")
    tl.update("sup", "critic")
    p = tl.probabilities("sup")
    assert p["coder"] == pytest.approx(0.75) and p["critic"] == pytest.approx(0.25)
    assert tl.effective_count("sup") == pytest.approx(4.0)
    assert tl.probabilities("unknown") == {}


def test_decay_follows_a_workflow_change_within_a_few_half_lives():
    tl = TransitionLearner(half_life=20)
    for _ in range(500):
        tl.update("sup", "coder")
    for _ in range(100):  # five half-lives of the new routing
        tl.update("sup", "critic")
    assert tl.probability("sup", "critic") > 0.95
    # an old transition is worth half after one half-life
    tl2 = TransitionLearner(half_life=10)
    tl2.update("a", "x")
    for _ in range(10):
        tl2.update("a", "y")
    assert tl2.effective_count("a") == pytest.approx(0.5 + sum(0.5 ** (k / 10) for k in range(10)))


def test_rows_decay_independently():
    tl = TransitionLearner(half_life=5)
    tl.update("rare", "x")
    for _ in range(1000):
        tl.update("busy", "y")
    assert tl.effective_count("rare") == pytest.approx(1.0)


def test_confidence_empty_uniform_and_deterministic():
    tl = TransitionLearner(half_life=1e6)
    assert tl.confidence("sup") == 0.0
    names = ["a", "b", "c", "d", "e", "sup"]
    for _ in range(200):
        for n in names:
            tl.update("u", n)
            tl.update(n, "sup")
    assert tl.confidence("u") < 0.01          # uniform over every agent: nothing to predict
    assert tl.confidence("a") > 0.9           # always back to the supervisor
    few = TransitionLearner(half_life=1e6)
    few.update("a", "sup")
    few.update("b", "x")
    assert few.confidence("a") < 0.2          # one observation: little trust


def test_reach_is_first_passage_within_k():
    tl = TransitionLearner(half_life=1e9)
    for _ in range(2):
        tl.update("sup", "coder")
        tl.update("sup", "search")
    for _ in range(4):
        tl.update("coder", "sup")
        tl.update("search", "critic")
    r1 = tl.reach("sup", 1)
    r2 = tl.reach("sup", 2)
    assert r1 == pytest.approx({"coder": 0.5, "search": 0.5})
    assert r2["critic"] == pytest.approx(0.5)
    assert r2["sup"] == pytest.approx(0.5)    # via coder
    with pytest.raises(ValueError):
        tl.reach("sup", 0)


def test_rename_folds_an_old_version_into_the_new_one():
    tl = TransitionLearner(half_life=1e9)
    tl.update("sup", "coder_v1")
    tl.update("coder_v1", "sup")
    tl.rename("coder_v1", "coder")
    assert tl.probability("sup", "coder") == 1.0
    assert tl.probability("coder", "sup") == 1.0
    assert "coder_v1" not in tl.agents()
    tl.forget("coder")
    assert tl.probabilities("sup") == {}


@given(transitions, st.floats(min_value=1, max_value=1000))
def test_probabilities_are_distributions(seq, half_life):
    tl = TransitionLearner(half_life=half_life)
    for a, b in seq:
        tl.update(a, b)
    for src in tl.agents():
        p = tl.probabilities(src)
        if p:
            assert all(0.0 <= v <= 1.0 for v in p.values())
            assert math.fsum(p.values()) == pytest.approx(1.0)
        assert 0.0 <= tl.confidence(src) <= 1.0
        for v in tl.reach(src, 3).values():
            assert 0.0 <= v <= 1.0


def test_start_state_is_an_ordinary_row():
    tl = TransitionLearner()
    tl.update(START, "sup")
    assert tl.probability(START, "sup") == 1.0


def test_rescale_keeps_probabilities():
    tl = TransitionLearner(half_life=1.0)  # the weight doubles per update: rescales often
    for i in range(2000):
        tl.update("a", "x" if i % 4 else "y")
    p = tl.probabilities("a")
    assert math.fsum(p.values()) == pytest.approx(1.0)
    assert tl.effective_count("a") == pytest.approx(2.0, rel=1e-6)
