"""Trace files: one LLM call per JSONL line, compatible with Mooncake's traces (reading, and
writing the built-in workloads); `load_trace` also reads kv-cache-tester conversation files
(conversations.py). The fields of both formats are in docs/workloads.md.

Fields (Mooncake): `timestamp` (ms from the start), `input_length`, `output_length`, `hash_ids`
(one id per block of the prompt, the last one possibly partial, or one per full block only, as
vLLM hashes them; equal ids mean equal content up to and including that block), optional
`block_size` (else the reader's default, 512 as in Mooncake).

Extensions, all optional:
- `session_id`: the workflow the call belongs to. With `think_ms` on every record of a session,
  the session is replayed closed-loop: after each call finishes, the session waits that call's
  `think_ms` and issues its next one. Otherwise its calls are issued at their timestamps (open loop).
- `agent`: the true agent (for evaluation and for hinted runs only; never shown to CacheScout
  otherwise).
- `output_hash_ids`: ids of the blocks the output completes, continuing the prompt's chain (the
  next prompt of the same agent contains them); without it, decoded blocks never match anything.
- `chunks`: `[[begin, end, hash], ...]`, the prompt's content-defined chunks (see
  `cachescout.policy.content_sketch`); `output_chunks`: `[hash, ...]` of the output's leading
  chunks. They let session inference work on a trace without shipping token ids.

A malformed line is reported with its line number and field and skipped (or, with `strict`,
rejected); the report counts the reasons.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

from cachescout.policy import InputError, check_fields, content_chunks, content_sketch, setting

from .replay import ReplayResult, chain_hashes
from .workloads import Session

DEFAULT_BLOCK_SIZE = 512  # Mooncake's
_MAX_IDS = 1 << 20        # ids per record: a larger record is refused, not allocated
_MAX_TOKENS = 1 << 26     # prompt tokens per record (64 M: far past any model's context)
_MAX_OUTPUT = 1 << 20     # output tokens per record
_MAX_BLOCK_SIZE = 1 << 16
_MAX_SECONDS = 1e9        # timestamps, offsets and think times (about 30 years)
_SIGNED64 = 1 << 63
# Tags mixed into hashes (ints, not strings: string hashes change with PYTHONHASHSEED).
_UNKNOWN_OUTPUT = -0x6F7574
_PARTIAL = -0x706172


class TraceError(InputError):
    """A trace record (or file) was rejected; the message names the line or file and the field,
    `reason` says why in a few words (the read report counts them)."""

    def __init__(self, message: str, *, field: str | None = None, reason: str = "invalid") -> None:
        super().__init__(message)
        self.field = field
        self.reason = reason


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
    line: int = 0         # the record's number, unique in its trace (a line of a JSONL file)
    origin: str = ""      # where it came from, for messages (default: "line N")
    end: str | None = None  # how the call ended (its stop reason: "tool_use", "end_turn", ...), if known

    @property
    def where(self) -> str:
        return self.origin or f"line {self.line}"

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
            raise TraceError(f"{self.where}: block_size {self.block_size} differs from the replay's {block_size}",
                             field="block_size", reason="block size differs")
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
            raise TraceError(f"{self.where}: block_size {bs} is too small to stand in tokens for ids (>= 4)",
                             field="block_size", reason="block size below 4")

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
    errors: list[str] = dataclasses.field(default_factory=list)      # the first few, with line/file and field
    reasons: Counter[str] = dataclasses.field(default_factory=Counter)  # why records were skipped, counted
    files: int = 0                                                   # files read (conversation traces)

    def skip(self, exc: TraceError) -> None:
        self.skipped += 1
        self.reasons[exc.reason] += 1
        if len(self.errors) < 20:
            self.errors.append(str(exc))

    def summary(self) -> str:
        """One line: what was skipped and why (empty when nothing was)."""
        if not self.skipped:
            return ""
        why = "; ".join(f"{n} {reason}" for reason, n in self.reasons.most_common(4))
        more = len(self.reasons) - 4
        return (f"{self.skipped} record(s) skipped ({why}{f'; {more} other reasons' if more > 0 else ''}), "
                f"e.g. {self.errors[0]}")


LOOPS = ("auto", "closed", "open")


@dataclasses.dataclass(frozen=True)
class TraceOptions:
    """How to read and replay a trace. Its settings are `cachescout bench`'s --trace-* flags
    (generated from these fields: cli/args.py); `seed` is --seed's."""

    block_size: int = setting(DEFAULT_BLOCK_SIZE, "block size of JSONL records without 'block_size' "
                              "(Mooncake's is 512)", lo=1, hi=_MAX_BLOCK_SIZE)
    strict: bool = setting(False, "reject a trace with any malformed record", flag="--strict-trace")
    loop: str = setting("auto", "closed: each call of a session issued its think time after the previous one "
                        "finished; open: every call at its recorded time; auto: closed where think times are "
                        "known (conversation files; JSONL sessions whose records all carry think_ms)", choices=LOOPS)
    conversations: int | None = setting(None, "conversation folder: mix N of its conversations, chosen by --seed "
                                        "(default: all, at most 32)", lo=1, hi=_MAX_IDS)
    window_s: float = setting(1800.0, "conversation folder: start the mixed conversations at random times within "
                              "S seconds (by --seed)", lo=0, hi=_MAX_SECONDS, flag="--trace-window")
    seed: int = setting(1, "which conversations are mixed, and when they start", lo=0, hi=2**32 - 1, flag=False)
    time_scale: float = setting(1.0, "multiply every timestamp, offset and think time by X (e.g. 10 to spread a "
                                "cluster's trace to one replica's load)", lo=0, lo_open=True, hi=1e6)

    def __post_init__(self) -> None:
        check_fields(self)


def load_trace(path: str | Path, options: TraceOptions | None = None) -> tuple[list[Session], TraceReadReport]:
    """Sessions to replay from a trace: a Mooncake-style JSONL file (.jsonl, .jsonl.gz), or
    kv-cache-tester conversation files (.json, .json.gz: one, or a directory of them), detected
    from the content. TraceError when the trace cannot be read at all."""
    from .conversations import is_conversation_trace, read_conversations

    options = options or TraceOptions()
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory", reason="missing file")
    if path.is_dir() or is_conversation_trace(path):
        sessions, report = read_conversations(path, options)
    else:
        sessions, report = read_trace(path, block_size=options.block_size, strict=options.strict,
                                      loop=options.loop)
    if options.time_scale != 1.0:
        sessions = [_scaled(s, options.time_scale) for s in sessions]
    return sessions, report


def _scaled(s: Session, x: float) -> Session:
    calls = tuple(dataclasses.replace(c, think_s=c.think_s * x) for c in s.calls)
    return dataclasses.replace(s, arrival_s=s.arrival_s * x, calls=calls, offsets_s=tuple(o * x for o in s.offsets_s))


def open_text(path: Path) -> Iterator[str]:
    """Lines of a text file, gzipped or not; a file that cannot be read (or a gzip cut short)
    ends in a TraceError naming it, after the lines read before."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as fh:
            yield from fh
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(f"{path}: cannot be read to its end ({type(exc).__name__}: {exc})",
                         reason="file cut short or corrupt") from None


def read_trace(path: str | Path, *, block_size: int = DEFAULT_BLOCK_SIZE, strict: bool = False,
               loop: str = "auto") -> tuple[list[Session], TraceReadReport]:
    """Sessions to replay from a Mooncake-style trace file (.jsonl or .jsonl.gz) and a report of
    what was skipped. A file cut short keeps the records before the cut (counted as a skip)."""
    return parse_trace(open_text(Path(path)), block_size=block_size, strict=strict, loop=loop)


def parse_trace(lines: Iterable[str], *, block_size: int = DEFAULT_BLOCK_SIZE, strict: bool = False,
                loop: str = "auto") -> tuple[list[Session], TraceReadReport]:
    if not (_is_int(block_size) and 1 <= block_size <= _MAX_BLOCK_SIZE):
        raise InputError(f"block_size must be an integer in 1..{_MAX_BLOCK_SIZE}, got {block_size!r}")
    if loop not in LOOPS:
        raise InputError(f"loop must be one of {', '.join(LOOPS)}, got {loop!r}")
    report = TraceReadReport()
    rows: list[tuple[float, str | None, TraceCall]] = []
    number = 0
    it = iter(lines)
    while True:
        try:
            raw = next(it)
        except StopIteration:
            break
        except TraceError as exc:   # the file ends early: keep what was read
            if strict:
                raise
            report.skip(exc)
            break
        number += 1
        line = raw.strip()
        if not line:
            continue
        try:
            rows.append(_record(line, number, block_size))
            report.records += 1
        except TraceError as exc:
            if strict:
                raise
            report.skip(exc)
    sizes = {call.block_size for _, _, call in rows}
    if len(sizes) > 1:
        raise TraceError(f"records use several block sizes ({', '.join(map(str, sorted(sizes)))}); "
                         "a replay needs one", field="block_size", reason="several block sizes")
    return _sessions(rows, loop), report


def _record(line: str, number: int, default_block_size: int) -> tuple[float, str | None, TraceCall]:
    def bad(field: str, why: str, reason: str | None = None) -> TraceError:
        return TraceError(f"line {number}: field {field!r} {why}", field=field, reason=f"{field} {reason or 'invalid'}")

    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as exc:
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        raise TraceError(f"line {number}: not valid JSON ({msg})", reason="not JSON") from None
    except ValueError as exc:   # e.g. an integer literal beyond Python's digit limit
        raise TraceError(f"line {number}: not valid JSON ({exc})", reason="not JSON") from None
    if not isinstance(rec, dict):
        raise TraceError(f"line {number}: a record must be a JSON object", reason="not a JSON object")
    timestamp = _number(rec.get("timestamp", 0), "timestamp", bad, minimum=0.0, maximum=_MAX_SECONDS * 1e3)
    input_length = _integer(rec.get("input_length"), "input_length", bad, minimum=1, maximum=_MAX_TOKENS)
    output_length = _integer(rec.get("output_length", 1), "output_length", bad, minimum=1, maximum=_MAX_OUTPUT)
    bs = _integer(rec.get("block_size", default_block_size), "block_size", bad, minimum=1, maximum=_MAX_BLOCK_SIZE)
    hash_ids = _ids(rec.get("hash_ids"), "hash_ids", bad)
    check_block_count(hash_ids, input_length, bs, bad)
    output_hash_ids = _ids(rec.get("output_hash_ids", []), "output_hash_ids", bad, allow_empty=True)
    think = rec.get("think_ms")
    think_s = -1.0 if think is None else _number(think, "think_ms", bad, minimum=0.0, maximum=_MAX_SECONDS * 1e3) / 1e3
    session = rec.get("session_id")
    if session is not None and not (isinstance(session, (str, int)) and not isinstance(session, bool)):
        raise bad("session_id", "must be a string or an integer", "not a string or integer")
    if isinstance(session, str) and not 0 < len(session) <= 256:
        raise bad("session_id", "must be 1 to 256 characters long", "too long or empty")
    agent = rec.get("agent")
    if agent is not None and not (isinstance(agent, str) and 0 < len(agent) <= 256):
        raise bad("agent", "must be a string of 1 to 256 characters", "not a short string")
    chunks = rec.get("chunks", [])
    if not isinstance(chunks, list) or len(chunks) > _MAX_IDS or not all(
            isinstance(c, list) and len(c) == 3 and all(_is_int(x) for x in c) for c in chunks):
        raise bad("chunks", "must be a list of [begin, end, hash] integers", "not [begin, end, hash] integers")
    output_chunks = _ids(rec.get("output_chunks", []), "output_chunks", bad, allow_empty=True)
    stop = rec.get("stop")
    if stop is not None and not (isinstance(stop, str) and len(stop) <= 64):
        raise bad("stop", "must be a string of at most 64 characters", "not a short string")
    call = TraceCall(agent, hash_ids, input_length, output_length, think_s, bs, output_hash_ids,
                     tuple(tuple(c) for c in chunks), output_chunks, number, end=stop)
    return timestamp / 1e3, None if session is None else str(session), call


def check_block_count(hash_ids: tuple[int, ...], input_length: int, bs: int, bad) -> None:
    """One id per block of the prompt: every block including a partial last one (Mooncake), or
    the full blocks only (as vLLM hashes them; kv-cache-tester)."""
    full, every = input_length // bs, -(-input_length // bs)
    if len(hash_ids) not in (full, every):
        need = str(full) if full == every else f"{full} (full blocks) or {every} (with the partial last one)"
        raise bad("hash_ids", f"has {len(hash_ids)} ids; input_length {input_length} at block_size {bs} needs {need}",
                  "wrong number of ids for input_length")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _integer(v: Any, field: str, bad, minimum: int, maximum: int) -> int:
    if not _is_int(v) or not minimum <= v <= maximum:
        raise bad(field, f"must be an integer in {minimum}..{maximum}, got {_show(v)}",
                  "out of range or not an integer")
    return v


def _number(v: Any, field: str, bad, minimum: float, maximum: float) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if ok and isinstance(v, int):
        ok = minimum <= v <= maximum     # before float(): a huge integer does not fit one
    if ok:
        v = float(v)
        ok = math.isfinite(v) and minimum <= v <= maximum
    if not ok:
        raise bad(field, f"must be a number in {minimum:g}..{maximum:g}, got {_show(v)}",
                  "out of range or not a number")
    return float(v)


def _show(v: Any) -> str:
    """A value for a message, cut short: a huge literal must not make a huge line."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
        return f"an integer of {len(str(abs(v))) if abs(v) < 10**4000 else 'over 4000'} digits"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _ids(v: Any, field: str, bad, allow_empty: bool = False) -> tuple[int, ...]:
    if not isinstance(v, list) or (not v and not allow_empty):
        raise bad(field, "must be a non-empty list of integer ids" if not allow_empty else "must be a list",
                  "not a list of ids")
    if len(v) > _MAX_IDS:
        raise bad(field, f"has more than {_MAX_IDS} ids", "too many ids")
    for x in v:
        if not _is_int(x) or not -_SIGNED64 <= x < _SIGNED64:
            raise bad(field, f"must hold 64-bit integer ids, found {_show(x)}", "ids not 64-bit integers")
    return tuple(v)


def _sessions(rows: list[tuple[float, str | None, TraceCall]], loop: str = "auto") -> list[Session]:
    """Records with a `session_id` form sessions: closed loop where every one of its records
    has `think_ms` (unless `loop` is "open"), else open loop at their timestamps. A record without
    a session is a session of its own."""
    grouped: dict[str, list[tuple[float, TraceCall]]] = {}
    sessions: list[Session] = []
    for t, sid, call in rows:
        if sid is None:
            sessions.append(Session(f"line{call.line}", "trace", t, (dataclasses.replace(call, think_s=0.0),)))
        else:
            grouped.setdefault(sid, []).append((t, call))
    taken = {s.session_id for s in sessions}
    for sid, calls in grouped.items():
        calls.sort(key=lambda tc: tc[0])
        name = sid if sid not in taken else f"{sid}#session"
        closed = loop == "closed" or (loop == "auto" and all(c.think_s >= 0 for _, c in calls))
        t0 = calls[0][0]
        if closed:
            sessions.append(Session(name, "trace", t0, tuple(dataclasses.replace(c, think_s=max(c.think_s, 0.0))
                                                              for _, c in calls)))
        else:
            sessions.append(Session(name, "trace", t0, tuple(dataclasses.replace(c, think_s=0.0) for _, c in calls),
                                    offsets_s=tuple(t - t0 for t, _ in calls)))
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
        out_full = chain_hashes(sequence, block_size, parent=cast(int, full[-1]) if full else 0,
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
