"""The learner's state as bytes: a schema-versioned, checksummed msgpack snapshot that replicas
exchange and merge.

Counts are stored as fixed-point integers (micro-counts), so merging is exact integer addition:
commutative, associative, and a round trip through bytes gives back an equal snapshot.

Layout: the msgpack payload, then its CRC-32 (4 bytes, big-endian), so storage or transit
corruption is refused instead of decoding into a different, valid-looking learner. The checksum
is not a signature: whoever can write the keys can write a valid blob (docs/shared_state.md).

Decoding treats the bytes as hostile. Expanding msgpack is where hostile bytes hurt: a 4 MiB run
of empty arrays becomes ~280 MB of Python lists in one C call that holds the interpreter lock for
a second. So every array's shape is checked the moment the unpacker has built it (`list_hook`),
before anything encloses it: a blob that is not a snapshot is refused within one array of
`max_array_len` elements, the cells accepted are capped, and `checkpoint` (called every
`_CHECK_EVERY` arrays) lets a caller in a background thread hand the interpreter lock back.
Every violation raises StateDecodeError naming what was wrong.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack

from .errors import ConfigError, StateDecodeError
from .transitions import TransitionLearner

SCHEMA_VERSION = 2               # 2: CRC-32 trailer
KIND = "cachescout.transitions"
COUNT_SCALE = 1_000_000          # one observed transition = 1e6 micro-counts
MAX_BLOB_BYTES = 8 * 1024 * 1024  # a snapshot larger than this is refused unread
MAX_AGENTS = 100_000
MAX_AGENT_NAME = 256
MAX_CELLS = 4 * MAX_AGENTS       # transitions in one snapshot
MAX_ROW_CELLS = 16_384           # transitions out of one agent
MAX_COUNT = 2**62               # far above any real decayed count; guards int overflow on merge
_CRC_BYTES = 4
_CHECK_EVERY = 512               # arrays built between two calls of `checkpoint`
_FIELDS = frozenset({"kind", "schema", "half_life", "rows"})
_CELLS, _LISTED, _ROW = 0, 1, 2  # where the list hook is within one value (see _Shapes)
_CELLS_PER_PART = 2048           # transitions checked between two calls of `checkpoint`
_ONLY_TUPLES = frozenset({tuple})
_READ_BYTES = 64 * 1024          # body bytes the unpacker takes at a time (see _PartReader)


@dataclasses.dataclass(frozen=True)
class TransitionSnapshot:
    """Decayed transition counts at one moment, in micro-counts: rows[src][dst] -> int."""

    half_life: float
    rows: Mapping[str, Mapping[str, int]]

    @classmethod
    def of(cls, learner: TransitionLearner) -> TransitionSnapshot:
        return cls.from_rows(learner.half_life, learner.decayed_rows())

    @classmethod
    def from_rows(cls, half_life: float, decayed: Mapping[str, Mapping[str, float]]) -> TransitionSnapshot:
        rows: dict[str, dict[str, int]] = {}
        for src, dsts in decayed.items():
            row = {dst: int(round(c * COUNT_SCALE)) for dst, c in dsts.items()}
            row = {dst: c for dst, c in row.items() if c > 0}
            if row:
                rows[src] = row
        return cls(float(half_life), rows)

    def merge(self, other: TransitionSnapshot) -> TransitionSnapshot:
        """Sum of decayed counts. Both sides must decay at the same pace."""
        if self.half_life != other.half_life:
            raise ConfigError(
                f"cannot merge states with different half_life ({self.half_life} and {other.half_life})")
        rows = {src: dict(dsts) for src, dsts in self.rows.items()}
        for src, dsts in other.rows.items():
            row = rows.setdefault(src, {})
            for dst, c in dsts.items():
                row[dst] = min(MAX_COUNT, row.get(dst, 0) + c)
        return TransitionSnapshot(self.half_life, rows)

    def decayed_rows(self) -> dict[str, dict[str, float]]:
        return {src: {dst: c / COUNT_SCALE for dst, c in dsts.items()} for src, dsts in self.rows.items()}

    def to_learner(self, confidence_count_scale: float = 8.0) -> TransitionLearner:
        learner = TransitionLearner(self.half_life, confidence_count_scale)
        learner.absorb(self.decayed_rows())
        return learner

    def encode(self) -> bytes:
        payload = {
            "kind": KIND,
            "schema": SCHEMA_VERSION,
            "half_life": float(self.half_life),
            # Sorted so equal snapshots give equal bytes (a stable value to compare or hash).
            "rows": [[src, sorted(dsts.items())] for src, dsts in sorted(self.rows.items())],
        }
        body = msgpack.packb(payload, use_bin_type=True)
        return body + zlib.crc32(body).to_bytes(_CRC_BYTES, "big")

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview | Sequence[bytes],
               checkpoint: Callable[[], object] | None = None) -> TransitionSnapshot:
        """The snapshot in `data` (bytes, or the parts a store fetched them in, in order), or
        StateDecodeError. `checkpoint` is called now and then while decoding (a background caller
        yields the interpreter lock there). The parts are never joined: copying megabytes into
        fresh memory is one step of milliseconds that holds the lock."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            parts: list[bytes] = [bytes(data)]
        elif isinstance(data, (list, tuple)) and all(isinstance(x, bytes) for x in data):
            parts = [x for x in data if x]
        else:
            raise StateDecodeError(f"state must be bytes, got {type(data).__name__}")
        size = sum(len(x) for x in parts)
        if size > MAX_BLOB_BYTES:
            raise StateDecodeError(f"state is {size} bytes, over the limit of {MAX_BLOB_BYTES}")
        if size <= _CRC_BYTES:
            raise StateDecodeError(f"state is {size} bytes, too short to be a snapshot")
        reader = _PartReader(parts, size - _CRC_BYTES, checkpoint)
        if reader.crc() != int.from_bytes(reader.trailer(), "big"):
            raise StateDecodeError("state checksum does not match (corrupted in storage or transit, or not "
                                   f"a schema {SCHEMA_VERSION} snapshot)")
        rows: dict[str, _Cells] = {}
        if checkpoint is not None:
            checkpoint()
        try:
            header = _read(reader, rows, checkpoint)
        except BaseException:
            _release(rows, checkpoint)
            raise
        return cls._from_header(header, rows)

    @classmethod
    def _from_header(cls, header: dict[str, Any], rows: dict[str, _Cells]) -> TransitionSnapshot:
        if header.get("kind") != KIND:
            raise StateDecodeError(f"state field 'kind' must be {KIND!r}, got {header.get('kind')!r:.80}")
        schema = header.get("schema")
        if schema != SCHEMA_VERSION:
            raise StateDecodeError(f"state field 'schema' must be {SCHEMA_VERSION}, got {schema!r:.80}")
        half_life = header.get("half_life")
        if (not isinstance(half_life, (int, float)) or isinstance(half_life, bool)
                or not math.isfinite(half_life) or half_life <= 0):
            raise StateDecodeError(f"state field 'half_life' must be a positive number, got {half_life!r:.80}")
        if "rows" not in header:
            raise StateDecodeError("state field 'rows' is missing")
        return cls(float(half_life), rows)


class _PartReader:
    """The snapshot's body (its bytes less the checksum) across the parts it was fetched in, read
    by the unpacker `_READ_BYTES` at a time, with `checkpoint` called between reads."""

    __slots__ = ("parts", "length", "checkpoint", "_part", "_at", "_done")

    def __init__(self, parts: list[bytes], length: int, checkpoint: Callable[[], object] | None) -> None:
        self.parts, self.length, self.checkpoint = parts, length, checkpoint
        self._part = self._at = self._done = 0

    def crc(self) -> int:
        """CRC-32 of the body, a part at a time (zlib releases the interpreter lock on large parts)."""
        crc, left = 0, self.length
        for part in self.parts:
            if left <= 0:
                break
            crc = zlib.crc32(memoryview(part)[:left], crc)
            left -= len(part)
            if self.checkpoint is not None:
                self.checkpoint()
        return crc

    def trailer(self) -> bytes:
        tail, need = b"", _CRC_BYTES
        for part in reversed(self.parts):
            tail = part[-need:] + tail
            need = _CRC_BYTES - len(tail)
            if need == 0:
                return tail
        return tail

    def read(self, n: int) -> bytes:
        if self.checkpoint is not None:
            self.checkpoint()
        n = min(n, self.length - self._done)
        if n <= 0:
            return b""
        part = self.parts[self._part]
        out = part[self._at:self._at + n]
        self._at += len(out)
        self._done += len(out)
        if self._at == len(part):
            self._part, self._at = self._part + 1, 0
        return out


def _read(body: _PartReader, rows: dict[str, _Cells], checkpoint: Callable[[], object] | None) -> dict[str, Any]:
    """The header fields of `body`; its rows into `rows`, one at a time."""
    shapes = _Shapes(checkpoint)
    # The limits bound what the unpacker may allocate, whatever the bytes claim; the hooks refuse
    # each array or map that is not part of a snapshot as soon as it is built; rows are unpacked
    # one by one, so no single step builds (or frees) more than one row. The unpacker pulls the
    # body from the reader as it goes (its buffer stays near `_READ_BYTES`; an object may span reads).
    u = msgpack.Unpacker(body, read_size=_READ_BYTES, raw=False, strict_map_key=True, use_list=True,
                         list_hook=shapes.array, object_pairs_hook=shapes.map,
                         max_buffer_size=max(_READ_BYTES, body.length), max_str_len=MAX_AGENT_NAME * 4,
                         max_bin_len=0, max_ext_len=0, max_array_len=MAX_ROW_CELLS, max_map_len=len(_FIELDS))
    header: dict[str, Any] = {}
    try:
        n = u.read_map_header()
        if n > len(_FIELDS):
            raise StateDecodeError(f"state header has {n} fields; a snapshot has {sorted(_FIELDS)}")
        for _ in range(n):
            shapes.next_value()
            key = u.unpack()
            if key not in _FIELDS or key in header:
                raise StateDecodeError(f"state header field {key!r:.80} is unknown or repeated "
                                       f"(fields: {sorted(_FIELDS)})")
            if key != "rows":
                shapes.next_value()
                header[key] = u.unpack()
                continue
            header[key] = True
            try:
                count = u.read_array_header()
            except ValueError:
                raise StateDecodeError("state field 'rows' must be a list of [agent, [[agent, count], ...]]") from None
            if count > MAX_AGENTS:
                raise StateDecodeError(f"state has {count} rows, over the limit of {MAX_AGENTS}")
            for i in range(count):
                shapes.next_value()
                row = u.unpack()
                if type(row) is not _Row:
                    raise StateDecodeError(f"state rows[{i}] must be [agent, [[agent, count], ...]], got "
                                           f"{_peek(row)}")
                if row[0] in rows:
                    raise StateDecodeError(f"state rows[{i}] repeats agent {row[0]!r:.80}")
                rows[row[0]] = row[1]
                if checkpoint is not None:
                    checkpoint()
        if u.tell() != body.length:
            raise StateDecodeError(f"state has {body.length - u.tell()} bytes after the snapshot")
    except StateDecodeError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise StateDecodeError(f"state is not valid msgpack: {str(exc)[:120] or type(exc).__name__}") from None
    return header


def _release(rows: dict[str, _Cells], checkpoint: Callable[[], object] | None) -> None:
    """Free what a refused snapshot had built a part of a row at a time, so that freeing it is no
    single long step either (a row of 16,384 transitions takes milliseconds to free at once)."""
    while rows:
        _, cells = rows.popitem()
        while len(cells) > _CELLS_PER_PART:
            for _ in range(_CELLS_PER_PART):
                cells.popitem()
            if checkpoint is not None:
                checkpoint()
        del cells
        if checkpoint is not None:
            checkpoint()


# -- shape checks while unpacking ----------------------------------------------------------------
# The unpacker builds arrays innermost first, so each is classified from its items, which were
# classified already: a cell [agent, count] becomes a tuple, a list of cells a _Cells, a row
# [agent, cells] a _Row. Hostile bytes cannot make these types (the unpacker makes only lists,
# dicts and scalars), so an array whose items are anything else is not part of a snapshot and
# is refused before anything encloses it.

class _Cells(dict):
    __slots__ = ()


class _Row(tuple):
    __slots__ = ()


def _check_agent(name: Any, where: str) -> None:
    if type(name) is not str or not 0 < len(name) <= MAX_AGENT_NAME:
        raise StateDecodeError(f"state {where} must be an agent name of 1..{MAX_AGENT_NAME} characters, "
                               f"got {name!r:.80}")


class _Shapes:
    """The list hook's state within one top-level value (one row, one header field): a row is built
    as its cells, then the list of them, then the row, and nothing more. So an array may never
    enclose a row or a second list of transitions; hostile bytes that nest them are refused at the
    second one instead of after a whole array of them is built (and must be freed)."""

    __slots__ = ("cells", "arrays", "checkpoint", "phase")

    def __init__(self, checkpoint: Callable[[], object] | None) -> None:
        self.cells = 0
        self.arrays = 0
        self.checkpoint = checkpoint
        self.phase = _CELLS

    def next_value(self) -> None:
        """Called before each top-level value is unpacked."""
        self.phase = _CELLS

    def array(self, items: list) -> Any:
        self.arrays += 1
        if self.checkpoint is not None and not self.arrays % _CHECK_EVERY:
            self.checkpoint()
        if self.phase == _ROW:
            raise StateDecodeError(f"state holds an array around a row (rows belong only in 'rows'): "
                                   f"{_peek(items)}")
        if len(items) == 2:
            name, second = items
            if type(name) is str:
                kind = type(second)
                if kind is int:                           # a cell: [agent, count]
                    # (the common case, checked inline: it runs once per transition)
                    if not (0 < second <= MAX_COUNT and 0 < len(name) <= MAX_AGENT_NAME):
                        _check_agent(name, "transition target")
                        raise StateDecodeError(f"state transition to {name!r:.80} must have an integer count "
                                               f"in 1..{MAX_COUNT}, got {second!r}")
                    if self.phase != _CELLS:
                        raise StateDecodeError(f"state holds a transition outside a row's list: {name!r:.80}")
                    self.cells += 1
                    if self.cells > MAX_CELLS:
                        raise StateDecodeError(f"state holds more than {MAX_CELLS} transitions")
                    return (name, second)
                if kind is _Cells or (kind is list and not second):   # a row: [agent, [[agent, count], ...]]
                    _check_agent(name, "row agent")
                    self.phase = _ROW
                    return _Row((name, second if second else _Cells()))
                if kind is float or kind is bool:
                    raise StateDecodeError(f"state transition to {name!r:.80} must have an integer count in "
                                           f"1..{MAX_COUNT}, got {second!r}")
        if not items or type(items[0]) is tuple:          # a row's list of transitions (or no rows at all)
            if self.phase != _CELLS:
                raise StateDecodeError(f"state holds an array around a list of transitions: {_peek(items)}")
            self.phase = _LISTED
            return self._cells(items) if items else items
        raise StateDecodeError(f"state holds an array that is not a [agent, count] transition, a row "
                               f"[agent, [[agent, count], ...]] or a list of transitions: {_peek(items)}")

    def _cells(self, items: list) -> _Cells:
        # In parts, with a checkpoint after each: a row's list of 16,384 transitions is several ms.
        cells = _Cells()
        for i in range(0, len(items), _CELLS_PER_PART):
            part = items[i:i + _CELLS_PER_PART]
            if set(map(type, part)) != _ONLY_TUPLES:
                raise StateDecodeError(f"state transitions list mixes other values in: {_peek(items)}")
            cells.update(part)
            if self.checkpoint is not None:
                self.checkpoint()
        if len(cells) != len(items):
            raise StateDecodeError(f"state transitions list repeats agent {_repeated(items)!r:.80}")
        return cells

    def map(self, pairs: list[tuple[Any, Any]]) -> Any:
        raise StateDecodeError(f"state holds a map inside its header (keys {_peek([k for k, _ in pairs])}); "
                               "a snapshot has none")


def _repeated(cells: list[tuple[str, int]]) -> str:
    """The first agent named twice in `cells` (which names one twice)."""
    seen: set[str] = set()
    for name, _ in cells:
        if name in seen:
            return name
        seen.add(name)
    raise AssertionError("no agent is repeated")


def _peek(items: Any) -> str:
    return f"{(items[:3] if isinstance(items, list) else items)!r:.120}"
