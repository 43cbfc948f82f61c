import random
import tracemalloc
import zlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachescout.bench.state_bench import hostile_blobs
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


def _sealed(body: bytes) -> bytes:
    """Bytes with the CRC-32 trailer a snapshot carries (the checks after the checksum's)."""
    return body + zlib.crc32(body).to_bytes(4, "big")


def _payload(**over):
    base = {"kind": "cachescout.transitions", "schema": 2, "half_life": 200.0, "rows": [["a", [["b", 5]]]]}
    base.update(over)
    return _sealed(msgpack.packb(base))


@pytest.mark.parametrize("blob,needle", [
    (b"", "too short"),
    (b"\x00\x00\x00\x00", "too short"),
    (msgpack.packb({"kind": "cachescout.transitions"}), "checksum"),
    (_sealed(b"\xc1"), "not valid msgpack"),
    (_sealed(msgpack.packb([1, 2])), "not valid msgpack"),
    (_payload(kind="other"), "'kind'"),
    (_payload(schema=1), "'schema' must be 2"),
    (_payload(half_life=-1.0), "'half_life'"),
    (_payload(half_life=float("nan")), "'half_life'"),
    (_payload(rows={"a": 1}), "'rows' must be a list"),
    (_payload(rows=[["a", [["b", -5]]]]), "integer count"),
    (_payload(rows=[["a", [["b", 1.5]]]]), "integer count"),
    (_payload(rows=[["a", [["b", True]]]]), "integer count"),
    (_payload(rows=[["", [["b", 1]]]]), "agent name"),
    (_payload(rows=[["a" * 300, [["b", 1]]]]), "agent name"),
    (_payload(rows=[[7, [["b", 1]]]]), "not a [agent, count]"),
    (_payload(rows=[["a", [["b", 1]]], ["a", []]]), "repeats agent"),
    (_payload(rows=[["a", [["b", 1], ["b", 2]]]]), "repeats agent"),
    (_payload(rows=[["a"]]), "not a [agent, count]"),
    (_payload(rows=[["a", [["b", 1]]], ["c", 5]]), "rows[1] must be"),
    (_payload(rows=[["a", [["b", 1], "c"]]]), "mixes other values"),
    # Rows and transition lists are never nested: refused at the second one, not after a whole array of them.
    (_payload(rows=[["a", [["b", 1], ["c", [["d", 1]]]]]]), "array around a row"),
    (_payload(rows=[["a", [[], []]]]), "array around a list of transitions"),
    (_payload(rows=[["a", [[["b", 1]], ["c", 1]]]]), "transition outside a row's list"),
    (_payload(rows=[["a", [["b", {"c": 1}]]]]), "holds a map"),
    (_payload(rows="x"), "'rows' must be a list"),
    (_payload(extra=1), "header has 5 fields"),
    (_sealed(msgpack.packb({"kind": "cachescout.transitions", "x": 1})), "unknown or repeated"),
    (_sealed(msgpack.packb({"kind": "cachescout.transitions", "schema": 2, "half_life": 1.0})), "'rows' is missing"),
    (_sealed(msgpack.packb({"kind": "cachescout.transitions", "schema": 2, "half_life": 1.0, "rows": [],
                            "x": b"\x00" * 10})), "header has 5 fields"),
    (_sealed(msgpack.packb({"kind": "cachescout.transitions", "rows": b"\x00" * 10})), "'rows' must be a list"),
    (_sealed(msgpack.packb({"kind": "cachescout.transitions"}) + b"\x00"), "bytes after the snapshot"),
    ("text", "must be bytes"),
])
def test_bad_bytes_are_rejected_with_a_clear_error(blob, needle):
    with pytest.raises(StateDecodeError) as err:
        TransitionSnapshot.decode(blob)
    assert needle in str(err.value)


def test_every_single_bit_flip_is_refused():
    learner = TransitionLearner(200)
    for i in range(40):
        learner.update(f"agent-{i % 7}", f"agent-{(i * 3) % 5}")
    blob = TransitionSnapshot.of(learner).encode()
    rng = random.Random(7)
    for bit in rng.sample(range(len(blob) * 8), min(3000, len(blob) * 8)):
        flipped = bytearray(blob)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(StateDecodeError):
            TransitionSnapshot.decode(bytes(flipped))


def test_hostile_shapes_are_refused_before_they_expand():
    # Bounded memory: every shape fails within one array of the unpacker's limit, far below what
    # its bytes would expand to (a 4 MiB run of empty arrays is ~280 MB of Python lists).
    for name, blob in hostile_blobs(4 * 1024 * 1024).items():
        tracemalloc.start()
        with pytest.raises(StateDecodeError):
            TransitionSnapshot.decode(blob)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 40 * 1024 * 1024, (name, peak)


def test_nested_rows_and_lists_are_refused_at_the_second_not_after_the_array():
    # An array of 16,000 rows (or of empty lists) was built whole, then refused, then freed: a
    # stretch of milliseconds with the interpreter lock held, per entry per round. Rows and lists
    # of transitions never nest, so the second one is refused before the rest are built.
    for name in ("one-cell rows", "empty arrays"):
        blob = hostile_blobs(256 * 1024)[name]
        tracemalloc.start()
        with pytest.raises(StateDecodeError, match="array around"):
            TransitionSnapshot.decode(blob)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 2 * len(blob), (name, peak)   # the bytes, the unpacker's arrays, next to nothing built


def test_a_blob_in_parts_is_decoded_without_joining_them():
    # Joining a 4 MiB blob's parts, and the unpacker's copy of it, were steps of milliseconds with
    # the interpreter lock held (copies into fresh memory). The parts go to the unpacker a read at a
    # time instead: nothing near the blob's size is ever allocated while decoding.
    learner = TransitionLearner(200)
    for i in range(2000):
        learner.update("a" * 200 + str(i), "b" * 200 + str(i))
    blob = TransitionSnapshot.of(learner).encode()
    part = 128 * 1024
    parts = tuple(blob[i:i + part] for i in range(0, len(blob), part))
    assert len(blob) > 800_000 and len(parts) > 6
    largest, calls = [], [0]

    def checkpoint():
        calls[0] += 1
        if calls[0] % 50 == 0:
            largest.append(max((t.size for t in tracemalloc.take_snapshot().traces), default=0))

    tracemalloc.start()
    try:
        snap = TransitionSnapshot.decode(parts, checkpoint)
    finally:
        tracemalloc.stop()
    assert snap == TransitionSnapshot.decode(blob)
    assert len(largest) > 10 and max(largest) < 2 * part, max(largest)
    # Split anywhere, even inside the checksum, a blob decodes the same; a torn one is refused.
    cuts = sorted({*random.Random(1).sample(range(1, len(blob)), 40), len(blob) - 2})
    pieces = tuple(blob[a:b] for a, b in zip([0, *cuts], [*cuts, len(blob)], strict=True))
    assert TransitionSnapshot.decode(pieces) == snap
    with pytest.raises(StateDecodeError, match="checksum"):
        TransitionSnapshot.decode(parts[:-2] + parts[-1:])
    with pytest.raises(StateDecodeError, match="must be bytes"):
        TransitionSnapshot.decode([blob, 3])


def test_decoding_calls_the_checkpoint_so_a_caller_can_yield():
    calls = []
    learner = TransitionLearner(200)
    for i in range(3000):
        learner.update(f"a{i % 60}", f"a{(i * 7) % 61}")
    blob = TransitionSnapshot.of(learner).encode()
    assert TransitionSnapshot.decode(blob, lambda: calls.append(1)) == TransitionSnapshot.decode(blob)
    assert len(calls) >= 2
    calls.clear()
    with pytest.raises(StateDecodeError):
        TransitionSnapshot.decode(hostile_blobs(1024 * 1024)["empty arrays"], lambda: calls.append(1))


def test_hostile_headers_do_not_allocate_what_they_claim():
    # A map/array header announcing 2**32-1 entries, followed by nothing.
    hostile = [_sealed(b"\xdf\xff\xff\xff\xff"), _sealed(b"\xdd\xff\xff\xff\xff"),
               _sealed(b"\xdb\xff\xff\xff\xff"), _sealed(b"\x91" * 100_000),  # deep nesting
               _payload(rows=[["a", [["b", 1]] * 1]] * 1)[:-7]]
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
