"""Conversation traces in the format of WEKA's kv-cache-tester: agentic coding sessions recorded
through a logging proxy (Claude Code and its sub-agents), one conversation per file, replayed as
many conversations at once on one server.

A file (`.json` or `.json.gz`, one JSON object) holds `id`, `block_size`, `hash_id_scope`
("local": ids are unique within the conversation, which its sub-agents share; "global": across
files) and `requests`, in order, each either
- a call: `t` (seconds from the conversation's start), `in` / `out` (prompt and output tokens),
  `hash_ids` (one id per full block of the prompt, as vLLM hashes them), `think_time` (seconds the
  client waited before it, after the previous call ended), `api_time` (seconds the recorded server
  took), `stop` (how the call ended: "tool_use", "end_turn", or "" where the proxy did not record
  it; what a server sees as the call's stop reason); `type`, `model` and the rest are not used;
- a sub-agent: `type: "subagent"`, `agent_id`, `subagent_type`, `duration_ms`, its own `requests`
  (calls, `t` from the sub-agent's start), and `t`: when it *ended*, in seconds from the
  conversation's start (its start, `t - duration_ms / 1000`, falls within a second of the end of
  the call before it in every file here, and sub-agents started together run in parallel).

Replayed here: each conversation is a session (agent "main"), each sub-agent a session of its own
(agent "subagent:<type>") that its parent waits for. Closed loop (the default): a call is issued its
recorded think time after the previous one finished on the replayed server, sub-agents start when
the call before them finishes, and the parent resumes (after its recorded residual wait) once all
of them are done. Open loop: every call at its recorded offset from the conversation's start.
Ids are made global per conversation, so conversations never share blocks (their text is unknown);
an output's blocks match nothing (the files do not say which ids it became in the next prompt).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
import re
import zlib
from pathlib import Path
from typing import Any

from .trace import (
    _MAX_IDS, _MAX_OUTPUT, _MAX_SECONDS, _MAX_TOKENS, TraceCall, TraceError, TraceOptions, TraceReadReport,
    _ids, _integer, _number, _show, check_block_count,
)
from .workloads import Session

MAIN_AGENT = "main"
DEFAULT_MIX = 32            # conversations mixed from a directory unless told otherwise
_MAX_FILE_BYTES = 1 << 30   # decompressed; a larger conversation file is refused
_LOCAL_ID_BITS = 32
_PEEK = 1 << 16


def is_conversation_trace(path: Path) -> bool:
    """Whether a file is a conversation (one JSON object with `requests`) rather than JSONL."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as fh:
            head = fh.read(_PEEK).decode("utf-8", errors="replace")
    except (OSError, EOFError, zlib.error):
        return path.name.endswith((".json", ".json.gz"))
    first = head.lstrip().split("\n", 1)[0]
    try:
        rec = json.loads(first)
    except ValueError:
        return re.search(r'"requests"\s*:\s*\[', head) is not None
    return isinstance(rec, dict) and "requests" in rec


@dataclasses.dataclass(frozen=True, slots=True)
class _Call:
    t: float
    prompt: int
    output: int
    ids: tuple[int, ...]
    think: float | None
    api: float | None
    where: str
    stop: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _SubAgent:
    after: int                # index of the main call it follows (-1: before any)
    agent_id: str
    kind: str
    start: float
    end: float
    calls: tuple[_Call, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Conversation:
    name: str
    block_size: int
    local_ids: bool
    calls: tuple[_Call, ...]
    subagents: tuple[_SubAgent, ...]

    @property
    def call_count(self) -> int:
        return len(self.calls) + sum(len(s.calls) for s in self.subagents)


def read_conversations(path: str | Path, options: TraceOptions | None = None
                       ) -> tuple[list[Session], TraceReadReport]:
    """Sessions of a mix of the conversations in `path` (a directory of conversation files, or one
    file): `options.conversations` of them (default all, at most DEFAULT_MIX), chosen and started at
    random times within `options.window_s` by `options.seed`."""
    options = options or TraceOptions()
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.name.endswith((".json", ".json.gz"))) if path.is_dir() else [path]
    if not files:
        raise TraceError(f"{path}: no conversation files (*.json, *.json.gz) in it", reason="no files")
    report = TraceReadReport()
    conversations: list[Conversation] = []
    for f in files:
        try:
            conv = parse_conversation(_load(f), f.name, report, options.strict)
        except TraceError as exc:
            if options.strict:
                raise
            report.skip(exc)
            continue
        report.files += 1
        if conv.calls or conv.subagents:
            conversations.append(conv)
    if not conversations:
        return [], report
    count = options.conversations or min(DEFAULT_MIX, len(conversations))
    if count > len(conversations):
        raise TraceError(f"{path}: {count} conversations asked for, {len(conversations)} readable here",
                         field="conversations", reason="too few conversations")
    rng = random.Random(options.seed)
    chosen = rng.sample(conversations, count) if count < len(conversations) else list(conversations)
    starts = [0.0] * len(chosen) if len(chosen) == 1 else [rng.uniform(0.0, options.window_s) for _ in chosen]
    sessions: list[Session] = []
    names: set[str] = set()
    closed = options.loop != "open"
    serial = [0]
    for number, (conv, start) in enumerate(zip(chosen, starts, strict=True)):
        name = conv.name if conv.name not in names else f"{conv.name}#{number}"
        names.add(name)
        sessions.extend(conversation_sessions(conv, name, number, start, closed, serial))
    sessions.sort(key=lambda s: s.arrival_s)
    return sessions, report


def _load(f: Path) -> Any:
    try:
        if f.suffix == ".gz":
            with gzip.open(f, "rb") as fh:
                raw = fh.read(_MAX_FILE_BYTES + 1)
        else:
            raw = f.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(f"{f.name}: cannot be read to its end ({type(exc).__name__}: {exc})",
                         reason="file cut short or corrupt") from None
    if len(raw) > _MAX_FILE_BYTES:
        raise TraceError(f"{f.name}: over {_MAX_FILE_BYTES >> 20} MiB of JSON", reason="file too large")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise TraceError(f"{f.name}: not valid JSON ({str(exc)[:80]})", reason="not JSON") from None


def parse_conversation(doc: Any, name: str, report: TraceReadReport, strict: bool = False) -> Conversation:
    """A conversation from a file's JSON; a malformed call is skipped (and counted in `report`),
    a malformed file raises TraceError."""
    def bad(field: str, why: str, reason: str | None = None) -> TraceError:
        return TraceError(f"{name}: field {field!r} {why}", field=field, reason=f"{field} {reason or 'invalid'}")

    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise TraceError(f"{name}: a conversation file is a JSON object with a 'requests' list",
                         field="requests", reason="no requests list")
    bs = _integer(doc.get("block_size"), "block_size", bad, minimum=1, maximum=1 << 16)
    scope = doc.get("hash_id_scope", "local")
    if scope not in ("local", "global"):
        raise bad("hash_id_scope", f"must be 'local' or 'global', got {_show(scope)}", "not local or global")
    ident = doc.get("id", Path(name).name.split(".")[0])
    if not (isinstance(ident, str) and 0 < len(ident) <= 200):
        raise bad("id", "must be a string of 1 to 200 characters", "not a short string")

    def calls_of(items: list, where: str) -> list[_Call]:
        """The valid calls of `items` (sub-agent entries among them are left to the caller)."""
        out = []
        for i, r in enumerate(items):
            if isinstance(r, dict) and r.get("type") == "subagent":
                continue
            try:
                out.append(_call(r, f"{name}: {where}request {i}", bs, scope == "local"))
            except TraceError as exc:
                if strict:
                    raise
                report.skip(exc)
        return out

    requests = doc["requests"]
    main = calls_of(requests, "")
    valid = {c.where for c in main}
    subs: list[_SubAgent] = []
    before = 0   # valid main calls before the sub-agent at hand: it follows the last of them
    for i, r in enumerate(requests):
        if isinstance(r, dict) and r.get("type") == "subagent":
            try:
                subs.append(_subagent(r, f"{name}: request {i} (sub-agent)", before - 1, calls_of))
            except TraceError as exc:
                if strict:
                    raise
                report.skip(exc)
        elif f"{name}: request {i}" in valid:
            before += 1
    report.records += len(main) + sum(len(s.calls) for s in subs)
    return Conversation(ident, bs, scope == "local", tuple(main), tuple(s for s in subs if s.calls))


def _call(r: Any, where: str, bs: int, local: bool) -> _Call:
    def bad(field: str, why: str, reason: str | None = None) -> TraceError:
        return TraceError(f"{where}: field {field!r} {why}", field=field, reason=f"{field} {reason or 'invalid'}")

    if not isinstance(r, dict):
        raise TraceError(f"{where}: a request must be a JSON object", reason="not a JSON object")
    t = _number(r.get("t"), "t", bad, minimum=0.0, maximum=_MAX_SECONDS)
    prompt = _integer(r.get("in"), "in", bad, minimum=1, maximum=_MAX_TOKENS)
    output = _integer(r.get("out", 1), "out", bad, minimum=0, maximum=_MAX_OUTPUT)
    ids = _ids(r.get("hash_ids"), "hash_ids", bad, allow_empty=prompt < bs)
    if len(ids) > _MAX_IDS:
        raise bad("hash_ids", f"has more than {_MAX_IDS} ids", "too many ids")
    check_block_count(ids, prompt, bs, bad)
    if local and any(not 0 <= x < 1 << _LOCAL_ID_BITS for x in ids):
        raise bad("hash_ids", f"local ids must lie in 0..{(1 << _LOCAL_ID_BITS) - 1}", "local ids out of range")
    think = r.get("think_time")
    api = r.get("api_time")
    stop = r.get("stop")
    if stop is not None and not (isinstance(stop, str) and len(stop) <= 64):
        raise bad("stop", f"must be a string of at most 64 characters, got {_show(stop)}", "not a short string")
    return _Call(t, prompt, output, ids,
                 None if think is None else _number(think, "think_time", bad, minimum=0.0, maximum=_MAX_SECONDS),
                 None if api is None else _number(api, "api_time", bad, minimum=0.0, maximum=_MAX_SECONDS), where,
                 stop)


def _subagent(r: dict, where: str, after: int, calls_of) -> _SubAgent:
    def bad(field: str, why: str, reason: str | None = None) -> TraceError:
        return TraceError(f"{where}: field {field!r} {why}", field=field, reason=f"{field} {reason or 'invalid'}")

    end = _number(r.get("t"), "t", bad, minimum=0.0, maximum=_MAX_SECONDS)
    duration = _number(r.get("duration_ms", 0), "duration_ms", bad, minimum=0.0, maximum=_MAX_SECONDS * 1e3) / 1e3
    agent_id = r.get("agent_id", "subagent")
    kind = r.get("subagent_type", "subagent")
    for field, v in (("agent_id", agent_id), ("subagent_type", kind)):
        if not (isinstance(v, str) and 0 < len(v) <= 100):
            raise bad(field, "must be a string of 1 to 100 characters", "not a short string")
    if not isinstance(r.get("requests"), list):
        raise bad("requests", "must be a list of calls", "not a list")
    calls = calls_of(r["requests"], f"sub-agent {agent_id} ")
    return _SubAgent(after, agent_id, kind, max(0.0, end - duration), end, tuple(calls))


def conversation_sessions(conv: Conversation, name: str, number: int, start: float, closed: bool,
                          serial: list[int]) -> list[Session]:
    """The sessions replaying one conversation started at `start`: the main agent's and one per
    sub-agent. `number` makes its local ids global; `serial` numbers the records (shared by a mix)."""
    def gid(x: int) -> int:
        return (number << _LOCAL_ID_BITS) | x if conv.local_ids else x

    def record(c: _Call, agent: str, think: float) -> TraceCall:
        serial[0] += 1
        return TraceCall(agent, tuple(gid(x) for x in c.ids), c.prompt, max(1, c.output), think, conv.block_size,
                         line=serial[0], origin=c.where, end=c.stop)

    def gap(calls: tuple[_Call, ...], k: int) -> float:
        """The recorded wait between calls k and k + 1 (after k ended)."""
        nxt = calls[k + 1]
        if nxt.think is not None:
            return nxt.think
        return max(0.0, nxt.t - calls[k].t - (calls[k].api or 0.0))

    def end_of(c: _Call) -> float:
        return c.t + (c.api or 0.0)

    sessions: list[Session] = []
    main = conv.calls
    if not closed:
        if main:
            sessions.append(Session(name, "trace", start + main[0].t,
                                    tuple(record(c, MAIN_AGENT, 0.0) for c in main),
                                    offsets_s=tuple(c.t - main[0].t for c in main)))
        for sub in conv.subagents:
            first = sub.calls[0].t
            sessions.append(Session(f"{name}/{sub.agent_id}", "trace", start + sub.start + first,
                                    tuple(record(c, f"subagent:{sub.kind}", 0.0) for c in sub.calls),
                                    offsets_s=tuple(c.t - first for c in sub.calls)))
        return _unique(sessions)
    spawned: dict[int, list[_SubAgent]] = {}
    for sub in conv.subagents:
        spawned.setdefault(sub.after if main else -1, []).append(sub)
    thinks = []
    for k in range(len(main)):
        if k + 1 == len(main):
            thinks.append(0.0)
        elif k in spawned:   # the recorded wait after the last of its sub-agents ended
            thinks.append(max(0.0, main[k + 1].t - max(s.end for s in spawned[k])))
        else:
            thinks.append(gap(main, k))
    if main:
        sessions.append(Session(name, "trace", start + main[0].t,
                                tuple(record(c, MAIN_AGENT, thinks[k]) for k, c in enumerate(main))))
    for after, subs in spawned.items():
        for sub in subs:
            calls = tuple(record(c, f"subagent:{sub.kind}", gap(sub.calls, m) if m + 1 < len(sub.calls) else 0.0)
                          for m, c in enumerate(sub.calls))
            first = sub.start + sub.calls[0].t
            if after < 0:   # before any call of the main agent: on its own, at its recorded time
                sessions.append(Session(f"{name}/{sub.agent_id}", "trace", start + first, calls))
            else:
                sessions.append(Session(f"{name}/{sub.agent_id}", "trace", max(0.0, first - end_of(main[after])),
                                        calls, parent=name, after_call=after))
    return _unique(sessions)


def _unique(sessions: list[Session]) -> list[Session]:
    """Sub-agents that share an `agent_id` get distinct session ids (a parent keeps its own)."""
    seen: dict[str, int] = {}
    out = []
    for s in sessions:
        n = seen.get(s.session_id, 0)
        seen[s.session_id] = n + 1
        out.append(s if n == 0 else dataclasses.replace(s, session_id=f"{s.session_id}#{n}"))
    return out
