"""Trace files: one LLM call per JSONL line, compatible with Mooncake's traces.

Fields (Mooncake): `timestamp` (ms from the start), `input_length`, `output_length`, `hash_ids`
(one id per block of the prompt, the last one possibly partial; equal ids mean equal content up to
and including that block), optional `block_size` (else the reader's default, 512 as in Mooncake).

Extensions, all optional:
- `session_id`: the workflow the call belongs to. With `think_ms`, calls of a session are replayed
  closed-loop: each is issued `think_ms` after the session's previous call finished. Without it,
  every call is issued at its `timestamp`.
- `agent`: the true agent (for evaluation and for hinted runs only; never shown to CacheScout
  otherwise).
- `output_hash_ids`: ids of the blocks the output completes, continuing the prompt's chain (the
  next prompt of the same agent contains them); without it, decoded blocks never match anything.
- `chunks`: `[[begin, end, hash], ...]`, the prompt's content-defined chunks (see
  `cachescout.policy.content_sketch`); `output_chunks`: `[hash, ...]` of the output's leading
  chunks. They let session inference work on a trace without shipping token ids.

A malformed line is reported with its line number and skipped (or, with `strict`, rejected).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from cachescout.policy import content_chunks, content_sketch

from .replay import ReplayResult, chain_hashes
from .workloads import Session

DEFAULT_BLOCK_SIZE = 512  # Mooncake's
_MAX_IDS = 1 << 20        # ids per record: a larger record is refused, not allocated
_SIGNED64 = 1 << 63
# Tags mixed into hashes (ints, not strings: string hashes change with PYTHONHASHSEED).
_UNKNOWN_OUTPUT = -0x6F7574
_PARTIAL = -0x706172


class TraceError(ValueError):
    """A trace line was rejected; the message names the line and the field."""


@dataclasses.dataclass(frozen=True, slots=True)
class TraceCall:
    """One trace record, answering what the replay engine asks of a call."""

    agent: str | None
    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int
    think_s: float
    block_size: int
    output_hash_ids: tuple[int, ...] = ()
    chunks: tuple[tuple[int, int, int], ...] = ()
    output_chunks: tuple[int, ...] = ()
    line: int = 0

    def prompt_tokens(self) -> None:
        return None

    @property
    def prompt_len(self) -> int:
        return self.input_length

    @property
    def output_len(self) -> int:
        return self.output_length

    def block_keys(self, block_size: int) -> list[int]:
        """Keys of the prompt's full blocks (a partial last block is never cached by vLLM),
        chained over the ids so that a key names the whole prefix, whether or not the trace's
        ids already do."""
        if block_size != self.block_size:
            raise TraceError(f"line {self.line}: block_size {self.block_size} differs from the replay's {block_size}")
        keys = []
        h = 0
        for i in self.hash_ids[:self.input_length // self.block_size]:
            h = hash((h, i))
            keys.append(h)
        return keys

    def synthetic_tokens(self) -> tuple[list[int], list[int]]:
        """Prompt and output token ids standing in for the trace's content, for vLLM's scheduler
        (which hashes tokens, not ids): a block's tokens are a function of its id alone, so equal ids
        give equal blocks and different ids different ones, and vLLM's chained hashes match exactly
        where the trace's ids do (its block size must be the trace's). Content the trace does not
        name (an output without `output_hash_ids`) is unique to this record."""
        bs = self.block_size
        if bs < 4:
            raise TraceError(f"line {self.line}: block_size {bs} is too small to stand in tokens for ids (>= 4)")

        def block(ident: int, tag: int = 0) -> list[int]:
            # Four tokens spell the id (so different ids never give equal blocks); the rest are
            # pseudo-random from it, so token-level content matching (session linking) sees text-like
            # variety rather than a filler. The tag keeps a record's own content apart from ids.
            v = ident % (1 << 64)
            out = [((v >> s) & 0xFFFF) + 1 for s in (0, 16, 32, 48)]
            x = v ^ (0x9E3779B97F4A7C15 * (tag + 1)) % (1 << 64)
            for _ in range(bs - 4):
                x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
                out.append((x >> 33) % 65536 + 1)
            return out

        def fill(ids: tuple[int, ...], n: int, own: int) -> list[int]:
            out: list[int] = []
            for k in range((n + bs - 1) // bs):
                out += block(ids[k]) if k < len(ids) else block(hash((own, self.line, k)), tag=1)
            return out[:n]

        # Prompt and output are one stream of blocks: the prompt's full blocks, then the blocks its
        # output completes (`output_hash_ids`; the first holds the prompt's partial tail), so a later
        # call that repeats this one's prompt and output, ids and all, repeats its tokens too.
        full = self.input_length // bs
        ids = self.hash_ids[:full] + self.output_hash_ids
        if not self.output_hash_ids:
            ids = self.hash_ids[:full + 1]
        stream = fill(ids, self.input_length + self.output_length, _UNKNOWN_OUTPUT)
        return stream[:self.input_length], stream[self.input_length:]

    def output_key(self, k: int, parent: int) -> int:
        """Key of the k-th block the output completes."""
        if k < len(self.output_hash_ids):
            return hash((parent, self.output_hash_ids[k]))
        return hash((parent, _UNKNOWN_OUTPUT, self.line, k))  # unknown content: matches nothing


# -- reading ----------------------------------------------------------------------------------
@dataclasses.dataclass
class TraceReadReport:
    records: int = 0
    skipped: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)  # first few, with line numbers


def read_trace(path: str | Path, *, block_size: int = DEFAULT_BLOCK_SIZE, strict: bool = False,
               ) -> tuple[list[Session], TraceReadReport]:
    """Sessions to replay from a trace file (.jsonl or .jsonl.gz) and a report of what was skipped."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as fh:
        return parse_trace(fh, block_size=block_size, strict=strict)


def parse_trace(lines: Iterable[str], *, block_size: int = DEFAULT_BLOCK_SIZE, strict: bool = False,
                ) -> tuple[list[Session], TraceReadReport]:
    if not (isinstance(block_size, int) and block_size > 0):
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    report = TraceReadReport()
    rows: list[tuple[float, str | None, TraceCall]] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line:
            continue
        try:
            rows.append(_record(line, number, block_size))
            report.records += 1
        except TraceError as exc:
            if strict:
                raise
            report.skipped += 1
            if len(report.errors) < 20:
                report.errors.append(str(exc))
    sizes = {call.block_size for _, _, call in rows}
    if len(sizes) > 1:
        raise TraceError(f"records use several block sizes ({', '.join(map(str, sorted(sizes)))}); "
                         "a replay needs one")
    return _sessions(rows), report


def _record(line: str, number: int, default_block_size: int) -> tuple[float, str | None, TraceCall]:
    def bad(field: str, why: str) -> TraceError:
        return TraceError(f"line {number}: field {field!r} {why}")

    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"line {number}: not valid JSON ({exc.msg})") from None
    if not isinstance(rec, dict):
        raise TraceError(f"line {number}: a record must be a JSON object")
    timestamp = _number(rec.get("timestamp", 0), "timestamp", bad, minimum=0.0)
    input_length = _integer(rec.get("input_length"), "input_length", bad, minimum=1)
    output_length = _integer(rec.get("output_length", 1), "output_length", bad, minimum=1)
    bs = _integer(rec.get("block_size", default_block_size), "block_size", bad, minimum=1)
    hash_ids = _ids(rec.get("hash_ids"), "hash_ids", bad)
    expected = math.ceil(input_length / bs)
    if len(hash_ids) != expected:
        raise bad("hash_ids", f"has {len(hash_ids)} ids; input_length {input_length} at block_size {bs} "
                              f"needs {expected}")
    output_hash_ids = _ids(rec.get("output_hash_ids", []), "output_hash_ids", bad, allow_empty=True)
    think = rec.get("think_ms")
    think_s = -1.0 if think is None else _number(think, "think_ms", bad, minimum=0.0) / 1e3
    session = rec.get("session_id")
    if session is not None and not (isinstance(session, (str, int)) and not isinstance(session, bool)):
        raise bad("session_id", "must be a string or an integer")
    agent = rec.get("agent")
    if agent is not None and not isinstance(agent, str):
        raise bad("agent", "must be a string")
    chunks = rec.get("chunks", [])
    if not isinstance(chunks, list) or not all(
            isinstance(c, list) and len(c) == 3 and all(_is_int(x) for x in c) for c in chunks):
        raise bad("chunks", "must be a list of [begin, end, hash] integers")
    output_chunks = _ids(rec.get("output_chunks", []), "output_chunks", bad, allow_empty=True)
    call = TraceCall(agent, hash_ids, input_length, output_length, think_s, bs, output_hash_ids,
                     tuple(tuple(c) for c in chunks), output_chunks, number)
    return timestamp / 1e3, None if session is None else str(session), call


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _integer(v: Any, field: str, bad, minimum: int) -> int:
    if not _is_int(v) or v < minimum:
        raise bad(field, f"must be an integer >= {minimum}, got {v!r:.40}")
    return v


def _number(v: Any, field: str, bad, minimum: float) -> float:
    if not (isinstance(v, (int, float)) and not isinstance(v, bool)) or not math.isfinite(v) or v < minimum:
        raise bad(field, f"must be a number >= {minimum:g}, got {v!r:.40}")
    return float(v)


def _ids(v: Any, field: str, bad, allow_empty: bool = False) -> tuple[int, ...]:
    if not isinstance(v, list) or (not v and not allow_empty):
        raise bad(field, "must be a non-empty list of integer ids" if not allow_empty else "must be a list")
    if len(v) > _MAX_IDS:
        raise bad(field, f"has more than {_MAX_IDS} ids")
    out = []
    for x in v:
        if not _is_int(x) or not -_SIGNED64 <= x < _SIGNED64:
            raise bad(field, f"must hold 64-bit integer ids, found {x!r:.40}")
        out.append(x)
    return tuple(out)


def _sessions(rows: list[tuple[float, str | None, TraceCall]]) -> list[Session]:
    """Closed-loop sessions where `think_ms` is given, else one single-call session per record."""
    grouped: dict[str, list[tuple[float, TraceCall]]] = {}
    sessions: list[Session] = []
    for t, sid, call in rows:
        if sid is not None and call.think_s >= 0:
            grouped.setdefault(sid, []).append((t, call))
        else:
            name = sid if sid is not None else f"line{call.line}"
            sessions.append(Session(name, "trace", t, (dataclasses.replace(call, think_s=0.0),)))
    for sid, calls in grouped.items():
        calls.sort(key=lambda tc: tc[0])
        sessions.append(Session(sid, "trace", calls[0][0], tuple(c for _, c in calls)))
    sessions.sort(key=lambda s: s.arrival_s)
    return sessions


# -- writing ----------------------------------------------------------------------------------
def export_trace(result: ReplayResult, path: str | Path, block_size: int, *, content: bool = True) -> int:
    """Write the calls of a replay (of built-in workloads) as a trace; returns the record count.

    Ids are the replay's chained block hashes renumbered in order of first appearance; the last
    partial block of a prompt gets an id of its own content, as in Mooncake's traces."""
    ids: dict[int, int] = {}

    def rid(h: int) -> int:
        got = ids.get(h)
        if got is None:
            got = ids[h] = len(ids) + 1
        return got

    n = 0
    with open(path, "w", encoding="utf-8") as fh:
        for rec in _records(result, block_size, rid, content):
            fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
            n += 1
    return n


def _records(result: ReplayResult, block_size: int, rid, content: bool) -> Iterator[dict]:
    for req in sorted(result.requests, key=lambda r: r.issued_at):
        call = req.call
        tokens = call.prompt()
        full = chain_hashes(tokens, block_size)
        hash_ids = [rid(h) for h in full]
        if len(tokens) % block_size:
            parent = full[-1] if full else 0
            hash_ids.append(rid(hash((parent, _PARTIAL, tuple(tokens[len(full) * block_size:])))))
        sequence = tokens + list(call.output)
        out_full = chain_hashes(sequence, block_size, parent=full[-1] if full else 0,
                                start=len(full) * block_size)
        rec: dict[str, Any] = {
            "timestamp": round(req.issued_at * 1e3, 3),
            "input_length": len(tokens),
            "output_length": len(call.output),
            "hash_ids": hash_ids,
            "block_size": block_size,
            "session_id": req.session.session_id,
            "agent": call.agent,
            "think_ms": round(call.think_s * 1e3, 3),
            "output_hash_ids": [rid(h) for h in out_full],
        }
        if content:
            rec["chunks"] = [list(c) for c in content_sketch(tokens)]
            rec["output_chunks"] = content_chunks(list(call.output), 0, 192)
        yield rec
