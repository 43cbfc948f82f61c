import random

from cachescout.policy import PolicyConfig, SessionTracker, content_chunks


def words(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def test_chunks_do_not_depend_on_the_offset():
    text = words(1, 300)
    a = content_chunks([1, 2, 3] + text, 3, 400)
    b = content_chunks(words(9, 57) + text, 57, 400)
    assert len(a) > 10
    assert set(a[1:]) <= set(b)  # same text, same cuts; only the first partial chunk may differ


def test_content_joins_calls_of_one_session_across_agents():
    tracker = SessionTracker(PolicyConfig())
    task_a, task_b = words(1, 150), words(2, 150)
    s1 = tracker.assign(0.0, "sup", tokens=words(10, 40) + task_a, content_start=40)
    s2 = tracker.assign(0.1, "sup", tokens=words(10, 40) + task_b, content_start=40)
    assert s1.new and s2.new and s1.session is not s2.session
    again = tracker.assign(1.0, "coder", tokens=words(20, 77) + task_a + words(3, 50), content_start=77)
    assert again.session is s1.session and again.evidence == "content" and again.previous_agent == "sup"


def test_boilerplate_shared_by_sessions_is_not_evidence():
    tracker = SessionTracker(PolicyConfig())
    boiler = words(7, 60)
    for k in range(3):
        tracker.assign(float(k), "a", tokens=boiler + words(100 + k, 100), content_start=0)
    fresh = tracker.assign(5.0, "a", tokens=boiler + words(999, 100), content_start=0)
    assert fresh.new


def test_hint_wins_and_continuation_is_used():
    tracker = SessionTracker(PolicyConfig())
    a = tracker.assign(0.0, "sup", hint="wf-1")
    b = tracker.assign(1.0, "coder", hint="wf-1")
    assert a.session is b.session and b.evidence == "hint" and b.previous_agent == "sup"
    c = tracker.assign(2.0, "coder", continues=a.session.sid)
    assert c.session is a.session and c.evidence == "continuation"


def test_idle_sessions_expire_and_are_reported():
    tracker = SessionTracker(PolicyConfig(session_idle_timeout_s=10.0))
    a = tracker.assign(0.0, "sup", hint="x")
    assert tracker.expire(50.0) == []            # a call is in flight: not idle
    tracker.finished(a.session.sid, 1.0)
    assert tracker.expire(5.0) == []
    assert tracker.expire(12.0) == [a.session]
    assert len(tracker) == 0 and not tracker.agent_counts


def test_a_sketch_gives_the_same_chunks_as_the_tokens():
    from cachescout.policy import content_sketch, sketch_window
    tokens = words(3, 40) + words(4, 400)
    sketch = content_sketch(tokens)
    for start in (0, 1, 40, 97, 300):
        assert sketch_window(sketch, start, 192) == content_chunks(tokens, start, 192)


def test_a_long_call_in_flight_does_not_hold_back_expiry_of_others():
    tracker = SessionTracker(PolicyConfig(session_idle_timeout_s=10.0))
    busy = tracker.assign(0.0, "coder", hint="long")          # oldest, its call never ends here
    done = tracker.assign(1.0, "sup", hint="short")
    tracker.finished(done.session.sid, 2.0)
    assert tracker.expire(13.0) == [done.session]
    assert tracker.get(busy.session.sid) is busy.session


def test_sessions_idle_past_their_patience_are_reported_once_and_reopened_by_a_call():
    tracker = SessionTracker(PolicyConfig())
    a = tracker.assign(0.0, "sup", hint="a")
    b = tracker.assign(0.0, "coder", hint="b")
    tracker.finished(a.session.sid, 1.0)
    tracker.finished(b.session.sid, 1.0)
    patience = {"sup": 2.0, "coder": 20.0}.get
    assert tracker.overdue(2.5, patience, 2.0) == []
    assert tracker.overdue(4.0, patience, 2.0) == [a.session] and a.session.over
    assert tracker.overdue(5.0, patience, 2.0) == []          # reported once
    again = tracker.assign(6.0, "coder", hint="a")           # it was not over after all
    assert again.session is a.session and not a.session.over


def test_cross_agent_share_counts_live_and_ended_sessions():
    """The share is kept up to date call by call: it must equal a recount over the live sessions
    plus the decayed tally of the ended ones, through calls, finishes, expiry and the cap."""
    tracker = SessionTracker(PolicyConfig(session_idle_timeout_s=30.0, max_sessions=25))
    rng = random.Random(3)
    now = 0.0
    checked = 0
    for _ in range(600):
        now += rng.random()
        a = tracker.assign(now, rng.choice(["sup", "coder", "critic"]), hint=rng.randrange(60))
        tracker.finished(a.session.sid, now + 0.2)
        tracker.expire(now)
        live = [s for s in tracker if s.calls >= 2]
        multi = tracker.multi_call + len(live)
        mixed = tracker.multi_agent + sum(len(s.called) >= 2 for s in live)
        share = tracker.cross_agent_share()
        if multi < 20:
            assert share is None
        else:
            assert abs(share - mixed / multi) < 1e-9
            checked += 1
    assert checked > 500 and 0.0 < tracker.cross_agent_share() < 1.0
