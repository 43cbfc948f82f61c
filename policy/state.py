"""The learner's state as bytes: a schema-versioned msgpack snapshot that replicas exchange and merge.

Counts are stored as fixed-point integers (micro-counts), so merging is exact integer addition:
commutative, associative, and a round trip through bytes gives back an equal snapshot. Decoding
treats the bytes as hostile: size and shape limits are enforced before and during unpacking, every
field is type-checked, and any violation raises StateDecodeError naming what was wrong.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import msgpack

from .errors import StateDecodeError
from .transitions import TransitionLearner

SCHEMA_VERSION = 1
KIND = "cachescout.transitions"
COUNT_SCALE = 1_000_000          # one observed transition = 1e6 micro-counts
MAX_BLOB_BYTES = 8 * 1024 * 1024  # a snapshot larger than this is refused unread
MAX_AGENTS = 100_000
MAX_AGENT_NAME = 256
MAX_COUNT = 2**62               # far above any real decayed count; guards int overflow on merge


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
            raise ValueError(
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
        return msgpack.packb(payload, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> TransitionSnapshot:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise StateDecodeError(f"state must be bytes, got {type(data).__name__}")
        if len(data) > MAX_BLOB_BYTES:
            raise StateDecodeError(f"state is {len(data)} bytes, over the limit of {MAX_BLOB_BYTES}")
        try:
            # The limits bound what the unpacker may allocate, whatever the bytes claim.
            payload = msgpack.unpackb(
                bytes(data), raw=False, strict_map_key=True, use_list=True,
                max_str_len=MAX_AGENT_NAME * 4,
                max_bin_len=0, max_ext_len=0, max_array_len=MAX_AGENTS, max_map_len=64)
        except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData, RecursionError) as exc:
            raise StateDecodeError(f"state is not valid msgpack: {exc}") from None
        return cls._from_payload(payload)

    @classmethod
    def _from_payload(cls, payload: Any) -> TransitionSnapshot:
        if not isinstance(payload, dict):
            raise StateDecodeError(f"state must be a map, got {type(payload).__name__}")
        if payload.get("kind") != KIND:
            raise StateDecodeError(f"state field 'kind' must be {KIND!r}, got {payload.get('kind')!r}")
        schema = payload.get("schema")
        if schema != SCHEMA_VERSION:
            raise StateDecodeError(f"state field 'schema' must be {SCHEMA_VERSION}, got {schema!r}")
        half_life = payload.get("half_life")
        if (not isinstance(half_life, (int, float)) or isinstance(half_life, bool)
                or not math.isfinite(half_life) or half_life <= 0):
            raise StateDecodeError(f"state field 'half_life' must be a positive number, got {half_life!r}")
        raw_rows = payload.get("rows")
        if not isinstance(raw_rows, list):
            raise StateDecodeError("state field 'rows' must be a list of [agent, [[agent, count], ...]]")
        rows: dict[str, dict[str, int]] = {}
        cells = 0
        named: set[str] = set()   # agent names already checked (a name recurs in many rows)
        for i, item in enumerate(raw_rows):
            if not (isinstance(item, list) and len(item) == 2):
                raise StateDecodeError(f"state rows[{i}] must be [agent, [[agent, count], ...]]")
            src, dsts = item
            _check_agent(src, f"rows[{i}][0]")
            if src in rows:
                raise StateDecodeError(f"state rows[{i}] repeats agent {src!r}")
            if not isinstance(dsts, list):
                raise StateDecodeError(f"state rows[{i}][1] must be a list of [agent, count]")
            row: dict[str, int] = {}
            # Per cell only type checks; messages are built when one fails (this loop is the cost of
            # reading a peer's state: 10,000 cells for 1,000 agents).
            for j, cell in enumerate(dsts):
                if type(cell) is not list or len(cell) != 2:
                    raise StateDecodeError(f"state rows[{i}][1][{j}] must be [agent, count]")
                dst, count = cell
                if type(dst) is not str or dst not in named:
                    _check_agent(dst, f"rows[{i}][1][{j}][0]")
                    named.add(dst)
                if type(count) is not int or not 0 < count <= MAX_COUNT:
                    raise StateDecodeError(
                        f"state rows[{i}][1][{j}][1] must be an integer count in 1..{MAX_COUNT}, got {count!r}")
                if dst in row:
                    raise StateDecodeError(f"state rows[{i}][1][{j}] repeats agent {dst!r}")
                row[dst] = count
            cells += len(row)
            if cells > MAX_AGENTS * 4:
                raise StateDecodeError(f"state holds more than {MAX_AGENTS * 4} transitions")
            rows[src] = row
        return cls(float(half_life), rows)


def _check_agent(name: Any, where: str) -> None:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_AGENT_NAME:
        raise StateDecodeError(f"state {where} must be an agent name of 1..{MAX_AGENT_NAME} characters, "
                               f"got {name!r:.80}")
