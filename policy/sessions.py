"""Which workflow instance (session) a call belongs to, so transitions are counted within one.

Evidence, strongest first:
1. an explicit session hint (e.g. `kv_transfer_params["cachescout.session_id"]`);
2. the prompt extends an earlier prompt of the same agent (chained hashes match past its end);
3. content: the first tokens of the prompt past everything seen before (the user's task, the
   supervisor's instruction: text that travels between the agents of one workflow), cut into
   content-defined chunks, so the same text gives the same chunks whatever anchor precedes it.
   Chunks come from prompts and from outputs (an output is usually part of the next prompt). A call
   joins the session that owns at least `session_min_shared_chunks` of its chunks (or two, when
   those are all the chunks any session owns in a short window) and most of the chunks any session
   owns; chunks seen in two sessions (boilerplate) are ignored from then on;
4. time (off by default; only for calls that carry no tokens): the idle session whose last agent
   the learned chain finds most likely to call this agent next. Measured on the built-in workloads
   it made no correct link, and its guesses feed the chain the transitions that make more guesses
   pass, so it stays an experiment;
otherwise the call starts a new session. Contexts are assumed append-only, so a session that has
already called this agent is never a candidate for 3 or 4 (its repeat calls are continuations).
Sessions idle past `session_idle_timeout_s` are over.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Final

from .config import PolicyConfig
from .transitions import HorizonRow

_MIN_ENDED: Final = 20.0            # multi-call sessions needed before judging session links
_ENDED_DECAY: Final = 0.995         # ... counted with a half-life of about 140 sessions
_MIN_IDLE_S: Final = 5.0           # never call a session over sooner than this
_CUT_MASK: Final = 3               # a cut after ~1 token in 4: chunks of ~4 tokens
_MIX: Final = 0x9E3779B97F4A7C15   # odd 64-bit constants for the cut-point hash
_MIX_PREV: Final = 0x85EBCA6B
# The cut tests bits 17-18 of (tok * _MIX) ^ (prev * _MIX_PREV), which depend only on the low 19
# bits of each factor: multiplying by the constants' low bits gives the same cuts with products
# that fit a machine word (no big-integer arithmetic per token).
_MIX_LO: Final = _MIX & (1 << 19) - 1
_MIX_PREV_LO: Final = _MIX_PREV & (1 << 19) - 1


def content_chunks(tokens: Sequence[int], start: int, window: int) -> list[Hashable]:
    """Hashes of the complete content-defined chunks in tokens[start:start + window].

    A cut falls after token i when a hash of tokens i-1 and i has its low bits zero, so the same
    text is cut the same way at any offset; the partial chunks at both ends are dropped.
    """
    begin = max(start, 0)
    # One tuple of the window: indexing it is cheap, and its slices are the chunks (one copy each).
    toks: tuple[int, ...] = tuple(tokens[begin:min(len(tokens), start + window)])
    out: list[Hashable] = []   # hashes, typed so that compiled code keeps the objects (see bench/replay.py)
    last_cut = -1
    prev = tokens[begin - 1] if begin > 0 else 0
    for i in range(len(toks)):
        tok = toks[i]
        if ((tok * _MIX_LO) ^ (prev * _MIX_PREV_LO)) >> 17 & _CUT_MASK == 0:
            if last_cut >= 0:
                out.append(hash(toks[last_cut:i + 1]))
            last_cut = i + 1
        prev = tok
    return out


def content_sketch(tokens: Sequence[int]) -> list[tuple[int, int, int]]:
    """(begin, end, hash) of every complete content-defined chunk of `tokens`: what a trace file
    stores instead of tokens. `sketch_window` then gives what `content_chunks` gives."""
    out: list[tuple[int, int, int]] = []
    last_cut = -1
    prev = 0
    for i, tok in enumerate(tokens):
        if ((tok * _MIX_LO) ^ (prev * _MIX_PREV_LO)) >> 17 & _CUT_MASK == 0:
            if last_cut >= 0:
                out.append((last_cut, i + 1, hash(tuple(tokens[last_cut:i + 1]))))
            last_cut = i + 1
        prev = tok
    return out


def sketch_window(sketch: Sequence[Sequence[int]], start: int, window: int) -> list[Hashable]:
    """Hashes of the sketch's chunks that lie within tokens[start:start + window], like
    `content_chunks(tokens, start, window)` (its first chunk begins after the first cut there)."""
    end = start + window
    return [h for b, e, h in sketch if b > start and e <= end]


class SessionView:
    """The scorer's view of one session in one rescoring (`SurvivalScorer.score` writes it)."""

    __slots__ = ("round", "t_next", "alive", "row", "next_agent")

    def __init__(self) -> None:
        self.round = -1                     # the rescoring it was made in
        self.t_next = 0.0                   # seconds until the session's next call is expected
        self.alive = 0.0                    # probability the session is still going
        self.row: HorizonRow | None = None  # its agent's row
        self.next_agent: str | None = None  # the agent it is hinted to call next


@dataclasses.dataclass(slots=True, eq=False)
class Session:
    sid: Hashable
    agent: str | None = None       # agent of the latest call
    started_at: float = 0.0
    last_call_at: float = 0.0
    last_finish_at: float = 0.0
    in_flight: int = 0
    calls: int = 0
    hinted: bool = False
    chunks: list[Hashable] = dataclasses.field(default_factory=list)
    called: set[str] = dataclasses.field(default_factory=set)  # agents this session has called
    anchor_nodes: dict[str, int] = dataclasses.field(default_factory=dict)  # agent -> anchor version it used last
    over: bool = False             # idle long enough to be all but certainly finished
    ending: Hashable | None = None  # how its latest finished call ended (`finish`'s `ending`)
    # The scorer's view of it in its latest rescoring, kept here so that rescoring looks nothing
    # up per session.
    view: SessionView = dataclasses.field(default_factory=SessionView)


@dataclasses.dataclass(frozen=True, slots=True)
class Assignment:
    session: Session
    previous_agent: str | None     # agent of the session's previous call (None: first call)
    new: bool
    evidence: str                  # "hint", "continuation", "content" or "new"
    previous_call_at: float | None  # when the session's previous call started


class SessionTracker:
    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.cfg = config or PolicyConfig()
        self._sessions: OrderedDict[Hashable, Session] = OrderedDict()  # least recent call first
        self._chunk_owner: dict[Hashable, Session] = {}
        self._shared_chunks: OrderedDict[Hashable, None] = OrderedDict()  # boilerplate, bounded
        self._idle: OrderedDict[Hashable, Session] = OrderedDict()   # no call in flight, by finish time
        self._busy: dict[Hashable, Session] = {}                      # a call in flight
        self._waiting: OrderedDict[Hashable, Session] = OrderedDict()  # idle, not yet judged over
        self._ids = itertools.count(1)
        self.agent_counts: Counter[str] = Counter()   # current agent of each live session
        self.version = 0
        self.evidence: Counter[str] = Counter()
        # Of the sessions that ended after two or more calls, how many involved two or more agents
        # (decayed): near zero while several agents are active means sessions are not being
        # linked across agents (no token ids, no hints), so predictions about contexts are unfounded.
        self.multi_call = 0.0
        self.multi_agent = 0.0
        self._live_multi = 0   # live sessions with two or more calls ...
        self._live_mixed = 0   # ... of which linked to two or more agents

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions.values())

    def get(self, sid: Hashable) -> Session | None:
        return self._sessions.get(sid)

    def recent(self, now: float, idle_within_s: float) -> list[Session]:
        """Sessions with a call in flight, then those whose last call ended at most
        `idle_within_s` ago, most recent first: O(what it returns), however many sessions wait
        to expire."""
        out = list(self._busy.values())
        for s in reversed(self._idle.values()):
            if now - s.last_finish_at > idle_within_s:
                break
            out.append(s)
        return out

    # -- assignment ---------------------------------------------------------------------------
    def assign(self, now: float, agent: str | None, *, hint: Hashable | None = None,
               continues: Hashable | None = None, candidates: Sequence[Hashable] = (),
               tokens: Sequence[int] | None = None, sketch: Sequence[Sequence[int]] | None = None,
               content_start: int = 0) -> Assignment:
        """Pick (or open) the session of a call that is starting now, and move it to `agent`.

        `candidates`: sessions that sent the continued prompt identically; content decides
        between them. Content comes from `tokens`, or from a precomputed `sketch` (trace files)."""
        s: Session | None = None
        evidence = "new"
        chunks: list[Hashable] = []
        if hint is not None:
            # Session ids are strings: they key many dicts (sessions, groups, views), and a
            # string's hash is computed once.
            sid = f"hint:{hint}"
            s = self._sessions.get(sid)
            evidence = "hint"
            if s is None:
                s = self._open(now, sid, hinted=True)
                evidence = "new"
        if s is None and continues is not None:
            s = self._sessions.get(continues)
            if s is not None:
                evidence = "continuation"
        has_content = tokens is not None or sketch is not None
        if s is None and has_content:
            if tokens is not None:
                chunks = content_chunks(tokens, content_start, self.cfg.session_window_tokens)
            else:
                assert sketch is not None
                chunks = sketch_window(sketch, content_start, self.cfg.session_window_tokens)
            if candidates:
                live = {self._sessions[c] for c in candidates if c in self._sessions}
                s = self._match_content(chunks, None, among=live) if live else None
                if s is not None:
                    evidence = "continuation"
            if s is None:
                s = self._match_content(chunks, agent)
            if s is not None:
                evidence = "content"
        new = s is None
        if s is None:
            s = self._open(now, f"auto:{next(self._ids)}")
        if chunks:
            self._register(s, chunks)
        previous = s.agent if s.calls else None
        previous_at = s.last_call_at if s.calls else None
        self._move(s, agent)
        self._count_linked(s, -1)
        if agent is not None:
            s.called.add(agent)
        s.calls += 1
        self._count_linked(s, 1)
        s.in_flight += 1
        s.last_call_at = now
        self._idle.pop(s.sid, None)
        self._waiting.pop(s.sid, None)
        s.over = False
        self._busy[s.sid] = s
        self._sessions.move_to_end(s.sid)
        self.evidence[evidence] += 1
        self.version += 1
        return Assignment(s, previous, new, evidence, previous_at)

    def finished(self, sid: Hashable, now: float, output: Sequence[int] | None = None,
                 output_chunks: Sequence[Hashable] | None = None, ending: Hashable | None = None) -> None:
        """A call of the session ended. Its output usually reappears in the next agent's prompt
        (an instruction, an answer), so its leading chunks become evidence for this session.
        `output_chunks`: those chunk hashes precomputed (trace files), instead of `output`;
        `ending`: how the call ended (see `CacheScoutPolicy.finish`)."""
        s = self._sessions.get(sid)
        if s is not None and output:
            output_chunks = content_chunks(output, 0, self.cfg.session_window_tokens)
        if s is not None and output_chunks:
            self._register(s, list(output_chunks))
        if s is not None and s.in_flight > 0:
            s.in_flight -= 1
            s.last_finish_at = now
            s.ending = ending
            if s.in_flight == 0:
                self._busy.pop(sid, None)
                self._idle[sid] = s
                self._waiting[sid] = s

    def close(self, sid: Hashable) -> Session | None:
        s = self._sessions.pop(sid, None)
        if s is not None:
            self._forget(s)
        return s

    def overdue(self, now: float, patience: Callable[[str | None], float], shortest: float) -> list[Session]:
        """Idle sessions that waited longer than `patience(agent)` after their last call: all but
        certainly finished, though kept (and reopened if they call again) until they expire.
        `shortest`: the least patience of any agent (the scan stops at sessions idle less)."""
        out = []
        for s in list(self._waiting.values()):
            idle = now - max(s.last_call_at, s.last_finish_at)
            if idle <= shortest:
                break
            if idle > patience(s.agent):
                del self._waiting[s.sid]
                s.over = True
                out.append(s)
        return out

    def expire(self, now: float, typical_gap_s: float | None = None) -> list[Session]:
        """Close sessions idle past the timeout (and the oldest beyond the cap); returns them.

        The timeout is `session_idle_timeout_s`, or less: `session_idle_gap_factor` times the
        typical gap between two calls of a session (at least 5 s), so that a workflow's end is
        learned about as fast as its calls come."""
        out = []
        timeout = self.cfg.session_idle_timeout_s
        if typical_gap_s is not None and self.cfg.session_idle_gap_factor > 0:
            timeout = min(timeout, max(_MIN_IDLE_S, self.cfg.session_idle_gap_factor * typical_gap_s))
        # Idle sessions in the order their last call ended: one with a long call in flight does
        # not hold back the ones behind it (their ends are what teaches the chain where
        # workflows stop).
        idle = self._idle
        while idle:
            s = next(iter(idle.values()))
            if now - max(s.last_call_at, s.last_finish_at) <= timeout:
                break
            self._sessions.pop(s.sid, None)
            self._forget(s)   # also leaves `_idle`
            out.append(s)
        while len(self._sessions) > self.cfg.max_sessions:
            _, s = self._sessions.popitem(last=False)
            self._forget(s)
            out.append(s)
        return out

    # -- internals ----------------------------------------------------------------------------
    def _open(self, now: float, sid: Hashable, hinted: bool = False) -> Session:
        s = Session(sid, started_at=now, last_call_at=now, hinted=hinted)
        self._sessions[sid] = s
        return s

    def _move(self, s: Session, agent: str | None) -> None:
        if s.agent is not None and s.calls:
            self.agent_counts[s.agent] -= 1
            if self.agent_counts[s.agent] <= 0:
                del self.agent_counts[s.agent]
        s.agent = agent
        if agent is not None:
            self.agent_counts[agent] += 1

    def cross_agent_share(self) -> float | None:
        """Share of multi-call sessions (live ones, and ended ones decayed) that used two or more
        agents; None while there are too few to tell."""
        multi = self.multi_call + self._live_multi
        return (self.multi_agent + self._live_mixed) / multi if multi >= _MIN_ENDED else None

    def _count_linked(self, s: Session, sign: int) -> None:
        """Add (1) or take back (-1) the session's part in the live counts of `cross_agent_share`."""
        if s.calls >= 2:
            self._live_multi += sign
            if len(s.called) >= 2:
                self._live_mixed += sign

    def _forget(self, s: Session) -> None:
        self._count_linked(s, -1)
        if s.calls >= 2:
            self.multi_call = self.multi_call * _ENDED_DECAY + 1.0
            self.multi_agent = self.multi_agent * _ENDED_DECAY + (1.0 if len(s.called) >= 2 else 0.0)
        if s.agent is not None and s.calls:
            self.agent_counts[s.agent] -= 1
            if self.agent_counts[s.agent] <= 0:
                del self.agent_counts[s.agent]
        for c in s.chunks:
            if self._chunk_owner.get(c) is s:
                del self._chunk_owner[c]
        self._idle.pop(s.sid, None)
        self._busy.pop(s.sid, None)
        self._waiting.pop(s.sid, None)
        self.version += 1

    def _match_content(self, chunks: list[Hashable], agent: str | None, among: set | None = None) -> Session | None:
        votes: Counter[Session] = Counter()
        known = 0
        for c in chunks:
            owner = self._chunk_owner.get(c)
            if owner is not None and (among is None or owner in among):
                known += 1
                # Contexts are append-only: a session's repeat call to an agent extends its earlier
                # prompt and is caught as a continuation, so a session that already called this
                # agent is not a candidate (this also stops boilerplate from merging sessions).
                if agent is None or agent not in owner.called:
                    votes[owner] += 1
        if not votes:
            return None
        (best, n), *rest = votes.most_common(2)
        # Enough chunks (or, in a short window, at least two and every chunk any session owns),
        # most of those any session owns, and no tie.
        enough = n >= self.cfg.session_min_shared_chunks or (n >= 2 and n == known)
        if not enough or 2 * n < known or (rest and rest[0][1] == n):
            return None
        return best if best.sid in self._sessions else None

    def mark_shared(self, start: int, end: int, *, tokens: Sequence[int] | None = None,
                    sketch: Sequence[Sequence[int]] | None = None) -> None:
        """Text at tokens[start:end] that several sessions sent: its chunks identify none of them
        (only the first `session_window_tokens` of it are looked at, as matching does)."""
        window = min(end - start, self.cfg.session_window_tokens)
        if tokens is not None:
            chunks = content_chunks(tokens, start, window)
        elif sketch is not None:
            chunks = sketch_window(sketch, start, window)
        else:
            return
        for c in chunks:
            if c not in self._shared_chunks:
                self._share(c)

    def _share(self, c: Hashable) -> None:
        self._chunk_owner.pop(c, None)   # boilerplate: evidence for no session, from now on
        shared = self._shared_chunks
        shared[c] = None
        if len(shared) > 64 * self.cfg.max_sessions:
            shared.popitem(last=False)

    def _register(self, s: Session, chunks: list[Hashable]) -> None:
        owners = self._chunk_owner
        shared = self._shared_chunks
        for c in chunks:
            if c in shared:
                continue
            owner = owners.get(c)
            if owner is None:
                owners[c] = s
                s.chunks.append(c)
            elif owner is not s:
                self._share(c)
