import tracemalloc

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachescout.policy import StateDecodeError, TransitionLearner, TransitionSnapshot
from cachescout.policy.state import MAX_BLOB_BYTES

names = st.text(min_size=1, max_size=12)
rows = st.dictionaries(names, st.dictionaries(names, st.integers(1, 10**12), max_size=6), max_size=6)
snapshots = st.builds(TransitionSnapshot, half_life=st.just(200.0), rows=rows)


@given(snapshots)
def test_round_trip_is_exact(snap):
    again = TransitionSnapshot.decode(snap.encode())
    assert again == snap
    assert again.encode() == snap.encode()


@given(snapshots, snapshots)
def test_merge_is_commutative(a, b):
    assert a.merge(b) == b.merge(a)


@given(snapshots, snapshots, snapshots)
def test_merge_is_associative(a, b, c):
    assert a.merge(b).merge(c) == a.merge(b.merge(c))


def test_merge_sums_decayed_counts_and_feeds_a_learner():
    a, b = TransitionLearner(100), TransitionLearner(100)
    for _ in range(3):
        a.update("sup", "coder")
    b.update("sup", "critic")
    merged = TransitionSnapshot.of(a).merge(TransitionSnapshot.of(b))
    learner = merged.to_learner()
    assert learner.probability("sup", "coder") == pytest.approx(
        a.effective_count("sup") / (a.effective_count("sup") + 1.0), rel=1e-6)
    with pytest.raises(ValueError, match="half_life"):
        merged.merge(TransitionSnapshot(50.0, {}))


def _payload(**over):
    base = {"kind": "cachescout.transitions", "schema": 1, "half_life": 200.0, "rows": [["a", [["b", 5]]]]}
    base.update(over)
    return msgpack.packb(base)


@pytest.mark.parametrize("blob,needle", [
    (b"", "not valid msgpack"),
    (b"\xc1", "not valid msgpack"),
    (msgpack.packb([1, 2]), "must be a map"),
    (_payload(kind="other"), "'kind'"),
    (_payload(schema=99), "'schema' must be 1"),
    (_payload(half_life=-1.0), "'half_life'"),
    (_payload(half_life=float("nan")), "'half_life'"),
    (_payload(rows={"a": 1}), "'rows' must be a list"),
    (_payload(rows=[["a", [["b", -5]]]]), "integer count"),
    (_payload(rows=[["a", [["b", 1.5]]]]), "integer count"),
    (_payload(rows=[["a", [["b", True]]]]), "integer count"),
    (_payload(rows=[["", [["b", 1]]]]), "agent name"),
    (_payload(rows=[["a" * 300, [["b", 1]]]]), "agent name"),
    (_payload(rows=[[7, [["b", 1]]]]), "agent name"),
    (_payload(rows=[["a", [["b", 1]]], ["a", []]]), "repeats agent"),
    (_payload(rows=[["a", [["b", 1], ["b", 2]]]]), "repeats agent"),
    (_payload(rows=[["a"]]), "rows[0]"),
    (msgpack.packb({"kind": "cachescout.transitions", "schema": 1, "half_life": 1.0, "rows": [],
                    "x": b"\x00" * 10}), "not valid msgpack"),  # binary fields are refused outright
    (_payload() + b"\x00", "not valid msgpack"),
    ("text", "must be bytes"),
])
def test_bad_bytes_are_rejected_with_a_clear_error(blob, needle):
    with pytest.raises(StateDecodeError) as err:
        TransitionSnapshot.decode(blob)
    assert needle in str(err.value)


def test_hostile_headers_do_not_allocate_what_they_claim():
    # A map/array header announcing 2**32-1 entries, followed by nothing.
    hostile = [b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
               b"\x91" * 100_000,  # deep nesting
               _payload(rows=[["a", [["b", 1]] * 1]] * 1)[:-3]]
    tracemalloc.start()
    for blob in hostile:
        with pytest.raises(StateDecodeError):
            TransitionSnapshot.decode(blob)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 4 * 1024 * 1024


def test_oversized_blob_is_refused_unread():
    with pytest.raises(StateDecodeError, match="over the limit"):
        TransitionSnapshot.decode(b"\x00" * (MAX_BLOB_BYTES + 1))
