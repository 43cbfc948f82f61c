"""What the policy has measured of its traffic: how long calls take and how long sessions wait
between them, how often sessions start, which anchor version each agent uses now, and how often
the contexts of expired sessions come back, and how often blocks a context's later call left out
(spent blocks) are used again, and how long sessions without a known agent wait after a call, by
how the call ended (`WaitSurvival`). The policy (core.py) writes it as calls come and go; the scorer
only reads it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Final

_TIMING_EMA: Final = 0.05
_CALL_EMA: Final = 0.02        # per call: the time between a session's calls, the share that open one
_TYPICAL_FLOOR_S: Final = 1e-3  # waits shorter than this count as this (their log is the average)
_RATE_WINDOW_S: Final = 60.0  # new-session arrivals are counted over about this much time
_STEP_SAMPLES: Final = 32      # gaps between a session's calls seen before their average is used
_DEAD_DECAY: Final = 0.995     # per expired session
_DEAD_MIN_BLOCKS: Final = 256.0  # dead blocks counted before their reuse is judged
_SPENT_DECAY: Final = 0.9999   # per block a context's call left out (a half-life of ~7,000 blocks)
_SPENT_PRIOR: Final = 64.0     # spent blocks counted before their reuse is half trusted
_OUTPUT_DECAY: Final = 0.98    # per call whose previous output was checked (~35 calls)
_OUTPUT_MIN_CALLS: Final = 16.0  # such calls seen before outputs are judged
# Waits by ending (`WaitSurvival`): bin 0 holds waits under _WAIT_EDGE0_S, bin i >= 1 those from
# _WAIT_EDGE0_S * 2 ** ((i - 1) / 2) to twice that over two bins (the last up to 8.6 days), and
# the bin after them sessions that expired without calling again.
_WAIT_EDGE0_S: Final = 0.25
_WAIT_BINS: Final = 44
_WAIT_DECAY: Final = 1.0 - 1.0 / 1024   # per wait of the same ending (and of all, for the pool)
_WAIT_PRIOR: Final = 8.0      # waits of the pool an ending's own count as, as long as it has few
_WAIT_MAX_KEYS: Final = 256   # endings remembered; the one with the fewest waits goes first
_WAIT_MIN: Final = 32.0       # waits seen before they are used at all


class Timing:
    """Exponential moving averages per agent, with a shared fallback for agents not seen yet.
    `typical`: averaged in the log (a geometric mean, the median of a lognormal), so that the rare
    wait of hours (a person who left) does not make every wait look long."""

    __slots__ = ("per_agent", "overall", "samples", "typical", "spread")

    def __init__(self, initial: float, typical: bool = False) -> None:
        self.per_agent: dict[str, float] = {}
        self.typical = typical
        self.overall = math.log(initial) if typical else initial
        self.samples = 0
        self.spread: dict[str, float] = {}   # typical: agent -> EMA of squared log deviations

    def note(self, agent: str | None, seconds: float) -> None:
        if seconds < 0 or not math.isfinite(seconds):
            return
        if self.typical:
            seconds = math.log(max(seconds, _TYPICAL_FLOOR_S))
        self.samples += 1
        self.overall += _TIMING_EMA * (seconds - self.overall)
        if agent is not None:
            old = self.per_agent.get(agent)
            self.per_agent[agent] = seconds if old is None else old + 2 * _TIMING_EMA * (seconds - old)
            if self.typical and old is not None:
                dev2 = (seconds - old) ** 2
                v = self.spread.get(agent)
                self.spread[agent] = dev2 if v is None else v + 2 * _TIMING_EMA * (dev2 - v)

    def reliability(self, agent: str | None) -> float:
        """How far an order by these estimates can be trusted over an order by recency, in
        [0, 1]. For waits spread lognormally by sigma (in the log), two sessions predicted a factor
        e apart return in the predicted order with probability (1 + erf(1 / (2 sigma))) / 2: the
        score is erf(1 / (2 sigma)), sigma the root mean square deviation of the log waits from
        their running average (a long tail counts fully). About 0.8 for a steady tool (sigma 0.4),
        0.4 for people typing (sigma 1.2)."""
        v = self.spread.get(agent) if agent is not None else None
        if v is None:
            return 1.0
        return math.erf(0.5 / max(math.sqrt(v), 1e-6))

    def get(self, agent: str | None) -> float:
        v = self.per_agent.get(agent, self.overall) if agent is not None else self.overall
        return math.exp(v) if self.typical else v

    def longest(self) -> float:
        """The largest current estimate (of any agent, or the fallback)."""
        v = max(self.overall, max(self.per_agent.values(), default=-math.inf))
        return math.exp(v) if self.typical else v

    def shortest(self) -> float:
        """The smallest current estimate (of any agent, or the fallback)."""
        v = min(self.overall, min(self.per_agent.values(), default=math.inf))
        return math.exp(v) if self.typical else v


def _wait_edges() -> list[float]:
    edges = [0.0]
    edges.extend(_WAIT_EDGE0_S * 2.0 ** (i / 2.0) for i in range(_WAIT_BINS))
    return edges   # bin i holds [edges[i], edges[i + 1]); the last bin's top is edges[_WAIT_BINS]


_EDGES: Final = _wait_edges()


def _wait_bin(seconds: float) -> int:
    if seconds < _WAIT_EDGE0_S:
        return 0
    return min(_WAIT_BINS - 1, 1 + int(2.0 * math.log2(seconds / _WAIT_EDGE0_S)))


class _Waits:
    """Decayed counts of waits per bin (the last, `_WAIT_BINS`, for "expired without calling")."""

    __slots__ = ("counts", "total", "version")

    def __init__(self) -> None:
        self.counts = [0.0] * (_WAIT_BINS + 1)
        self.total = 0.0
        self.version = 0

    def add(self, b: int) -> None:
        counts = self.counts
        for i in range(len(counts)):
            counts[i] *= _WAIT_DECAY
        counts[b] += 1.0
        self.total = self.total * _WAIT_DECAY + 1.0
        self.version += 1


class WaitSurvival:
    """How long a session waits after a call before it calls again, learned online from the
    waits seen, per *ending* of the call (an opaque signature of how it ended: inside vLLM its last
    output tokens, which tell a tool call from an answer to a person in most chat templates; in a
    trace its stop reason), each drawn towards the waits of all endings while it has few of its
    own. Sessions that expired without calling again count as waits longer than any. No shape is
    assumed: people's waits are long-tailed and several-peaked (a tool's seconds, a person's
    minutes, a conversation's end), which a typical wait and a spread do not describe."""

    __slots__ = ("_pool", "_by_ending", "_tables")

    def __init__(self) -> None:
        self._pool = _Waits()
        self._by_ending: dict[Hashable, _Waits] = {}
        # Per ending: (versions it was built from, cumulative mass per bin edge) for `next_call`.
        self._tables: dict[Hashable | None, tuple[int, int, list[float]]] = {}

    @property
    def seen(self) -> float:
        """Waits counted (decayed), of all endings."""
        return self._pool.total

    def waited(self, ending: Hashable | None, seconds: float) -> None:
        """A session called again `seconds` after a call that ended as `ending`."""
        if seconds < 0 or not math.isfinite(seconds):
            return
        self._note(ending, _wait_bin(seconds))

    def gave_up(self, ending: Hashable | None) -> None:
        """A session expired without calling again after a call that ended as `ending`."""
        self._note(ending, _WAIT_BINS)

    def _note(self, ending: Hashable | None, b: int) -> None:
        self._pool.add(b)
        if ending is None:
            return
        w = self._by_ending.get(ending)
        if w is None:
            if len(self._by_ending) >= _WAIT_MAX_KEYS:
                least = min(self._by_ending, key=lambda k: self._by_ending[k].total)
                del self._by_ending[least]
                self._tables.pop(least, None)
            w = self._by_ending[ending] = _Waits()
        w.add(b)

    def _table(self, ending: Hashable | None) -> list[float]:
        """Cumulative mass at each bin edge (the last entry: everything), the ending's own waits
        plus the pool's scaled to `_WAIT_PRIOR` waits."""
        pool = self._pool
        own = self._by_ending.get(ending) if ending is not None else None
        if own is None:
            ending = None   # the pool's table
        own_version = own.version if own is not None else -1
        got = self._tables.get(ending)
        if got is not None and got[0] == pool.version and got[1] == own_version:
            return got[2]
        scale = _WAIT_PRIOR / pool.total if own is not None and pool.total > 0 else 1.0
        cum = [0.0]
        acc = 0.0
        for i, c in enumerate(pool.counts):
            acc += c * scale + (own.counts[i] if own is not None else 0.0)
            cum.append(acc)
        self._tables[ending] = (pool.version, own_version, cum)
        return cum

    def next_call(self, ending: Hashable | None, idle: float, horizon: float) -> tuple[float, float] | None:
        """For a session idle `idle` seconds after a call that ended as `ending`: (the probability
        that it calls within the next `horizon` seconds, the expected wait until then if it does);
        None until `_WAIT_MIN` waits were seen. Waits are taken as spread evenly within a bin."""
        if self._pool.total < _WAIT_MIN:
            return None
        cum = self._table(ending)
        edges = _EDGES
        top = idle + horizon
        beyond = cum[-1]   # mass of waits longer than `idle` (expired ones included)
        within = 0.0
        spent = 0.0        # their waits past `idle`, summed
        for i in range(_WAIT_BINS):
            lo, hi = edges[i], edges[i + 1]
            if hi <= idle:
                beyond -= cum[i + 1] - cum[i]
                continue
            if lo >= top:
                break
            mass = cum[i + 1] - cum[i]
            if lo < idle:
                part = mass * (hi - idle) / (hi - lo)
                beyond -= mass - part
                mass, lo = part, idle
            if hi > top:
                mass *= (top - lo) / (hi - lo)
                hi = top
            within += mass
            spent += mass * (0.5 * (lo + hi) - idle)
        if beyond <= 0.0 or within <= 0.0:
            return 0.0, horizon
        return min(1.0, within / beyond), max(spent / within, 1e-3)


class Traffic:
    """The measurements; written through the methods below (by the policy), read by the scorer."""

    __slots__ = ("step_s", "new_session_share", "duration", "think", "waits", "current_anchor", "dead_reuse",
                 "_steps", "_arrivals", "_elapsed", "_last_arrival_at", "_dead_blocks", "_dead_reused",
                 "_spent", "_spent_reused", "_outputs_checked", "_outputs_carried")

    def __init__(self) -> None:
        self.step_s = 1.0             # typical time between two calls of one session (EMA)
        self.new_session_share = 0.0  # share of calls that open a session (EMA)
        self.duration = Timing(1.0)   # seconds a call of an agent takes
        self.think = Timing(1.0, typical=True)   # seconds from a call's end to the session's next call
        self.waits = WaitSurvival()   # the same for sessions without a known agent, by how calls end
        self.current_anchor: dict[str, int] = {}  # agent -> its newest anchor version (node) in use
        self.dead_reuse = 0.0         # share of expired sessions' context blocks used again
        self._steps = 0               # gaps averaged into step_s
        self._arrivals = 0.0          # time-decayed new sessions ...
        self._elapsed = 0.0           # ... over time-decayed seconds
        self._last_arrival_at: float | None = None
        self._dead_blocks = 0.0       # blocks of contexts whose session expired (decayed) ...
        self._dead_reused = 0.0       # ... and hits on such blocks since
        self._spent = 0.0             # blocks a context's later call left out (decayed) ...
        self._spent_reused = 0.0      # ... and the share of those used again, by count
        self._outputs_checked = 0.0   # calls whose previous call's output was looked for (decayed) ...
        self._outputs_carried = 0.0   # ... weighted by the share of that output the call carried

    # -- written by the policy ----------------------------------------------------------------
    def call_opened(self, now: float, new_session: bool, previous_call_at: float | None) -> None:
        """A call arrived: it opened a session, or followed the session's call at `previous_call_at`."""
        if previous_call_at is not None and now > previous_call_at:
            self.step_s += _CALL_EMA * ((now - previous_call_at) - self.step_s)
            self._steps += 1
        self.new_session_share += _CALL_EMA * ((1.0 if new_session else 0.0) - self.new_session_share)
        if new_session:
            self._session_arrived(now)

    def _session_arrived(self, now: float) -> None:
        if self._last_arrival_at is not None and now > self._last_arrival_at:
            dt = now - self._last_arrival_at
            keep = math.exp(-dt / _RATE_WINDOW_S)
            self._arrivals *= keep
            self._elapsed = self._elapsed * keep + dt
        self._last_arrival_at = now
        self._arrivals += 1.0

    def waited(self, agent: str, seconds: float) -> None:
        """A session waited `seconds` after a call of `agent` before calling again."""
        self.think.note(agent, seconds)

    def call_took(self, agent: str | None, seconds: float) -> None:
        self.duration.note(agent, seconds)

    def anchor_in_use(self, agent: str, node: int) -> None:
        self.current_anchor[agent] = node

    def contexts_expired(self, blocks: int) -> None:
        """An expired session's contexts held `blocks` blocks, presumed dead from now on."""
        self._dead_blocks = self._dead_blocks * _DEAD_DECAY + blocks
        self._dead_reused *= _DEAD_DECAY
        self._judge_dead()

    def expired_contexts_hit(self, blocks: int) -> None:
        """A call hit `blocks` blocks of expired sessions' contexts."""
        self._dead_reused += blocks
        self._judge_dead()

    def _judge_dead(self) -> None:
        # A chat whose next turn arrives as a new session reuses what "died": there the contexts of
        # expired sessions keep LRU order; a workflow that ran its course does not.
        if self._dead_blocks >= _DEAD_MIN_BLOCKS:
            self.dead_reuse = min(1.0, self._dead_reused / self._dead_blocks)

    def blocks_spent(self, blocks: int) -> None:
        """A context's call left out `blocks` blocks of its previous call (or outputs were filed as
        spent right away, see `outputs_carried`)."""
        keep = _SPENT_DECAY ** blocks
        self._spent = self._spent * keep + blocks
        self._spent_reused *= keep

    def spent_used(self, blocks: int) -> None:
        """A call used `blocks` spent blocks after all (hit them, or recomputed ones evicted)."""
        self._spent_reused += blocks

    def outputs_checked(self, blocks: int, carried: int) -> None:
        """A context's call carried `carried` of the `blocks` output blocks of its previous call."""
        if blocks > 0:
            self._outputs_checked = self._outputs_checked * _OUTPUT_DECAY + 1.0
            self._outputs_carried = self._outputs_carried * _OUTPUT_DECAY + min(carried, blocks) / blocks

    # -- read by the scorer and the policy ------------------------------------------------------
    def spent_reuse(self) -> tuple[float, float]:
        """(share of spent blocks used again, confidence in that share from how many were seen)."""
        if self._spent <= 0.0:
            return 1.0, 0.0
        share = min(1.0, (self._spent_reused + 1.0) / (self._spent + 1.0))
        return share, self._spent / (self._spent + _SPENT_PRIOR)

    def spent_set_apart(self) -> bool:
        """Whether spent blocks go to a group of their own (core.py `_spend`): once at least 64
        were counted, while under half of them were used again."""
        share, conf = self.spent_reuse()
        return conf >= 0.5 and share < 0.5

    def outputs_carried(self) -> bool | None:
        """Whether a context's next call usually carries its previous call's output (its blocks
        are then hit as part of the context); None until enough calls were checked. Where outputs
        come back re-rendered (a template around them, reasoning dropped) their blocks never hit."""
        if self._outputs_checked < _OUTPUT_MIN_CALLS:
            return None
        return self._outputs_carried / self._outputs_checked >= 0.5

    @property
    def new_session_rate(self) -> float:
        """Sessions starting per second, recently."""
        return self._arrivals / self._elapsed if self._elapsed > 0 else 0.0

    def known_step_s(self) -> float | None:
        """`step_s` once enough gaps were seen to trust it, else None."""
        return self.step_s if self._steps >= _STEP_SAMPLES else None
