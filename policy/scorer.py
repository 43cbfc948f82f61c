"""Survival scores: when will each group of cached blocks be needed again, and how sure are we.

For every live session the chain gives, per agent, the probability of being called within the next
`prediction_horizon` calls and at which of them (first-passage probabilities). Timing comes from
what was observed per agent: how long its calls take and how long a session typically waits after
one (a tool runs, a user types; averaged in the log, so that a wait of hours does not make every
wait look long). A session in a call of agent X is expected to call again after the rest of that
call plus X's typical wait, an idle one after what remains of that wait; one idle for much longer
than that has likely ended. Where an agent's waits are irregular (people), both are tempered by how
regular they are: what remains of the wait is drawn towards the whole wait (one that finished a
moment ago is about as likely to call soon), and a session's own prediction is blended with the
time it has idled already, as LRU would judge it. So each session
gives each agent a use rate, P(use) / expected time to it; an agent's anchor is used at the sum of
those rates over live sessions plus the sessions expected to arrive, a session's context under an
agent only at that session's rate. A session in which no agent was recognised has no chain to
predict from: its context is used at the chance that it calls within the cache's residence time,
given how long it has waited and how its last call ended, over the expected wait until then
(`Traffic.waits`, learned from such sessions' waits). Blocks a context's later call left out (spent) are used at the
rate LRU's order gives them times the share of such blocks seen used again. A group's predicted
time to next use is 1 / rate, weighed by
what losing its next victim costs: shorter for a block deep in a long prompt where attention's
cost is priced (recomputing it costs more), longer when a lower tier holds a copy (a load, not a
recompute). The eviction index blends the log of that time with the log of the group's LRU age by
the confidence of the rows involved, so an empty or unpredictable chain gives exactly LRU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Final, cast

from .config import PolicyConfig
from .costs import RebuildCost
from .eviction import EvictionIndex, Group
from .sessions import Session, SessionTracker, SessionView
from .traffic import Traffic
from .transitions import END, START, HorizonRow, LearnerRef

_RATE_FLOOR: Final = 1e-4     # uses per second of a group nobody is predicted to use: far, not infinitely
# The `model` of blocks queued requests will hit (core.py `_want`; later requests a little higher):
# below any prediction's (a use every microsecond would be -log(1e6) = -13.8), so they go after
# every other free block.
WANTED_MODEL: Final = -1e3
_LINKED_SHARE: Final = 0.2    # multi-call sessions spanning agents, at and above which contexts are trusted
_UNLINKED_SHARE: Final = 0.1  # ... and at and below which they are not
# Idle for this many think times, a session is under 0.1% likely to call again (see next_call_in).
_ALIVE_IDLE_THINKS: Final = 2.0 - math.log(1e-3)
# Waits seen (`Traffic.waits`) at which a prediction from them is half trusted.
_WAITS_HALF_CONFIDENT: Final = 32.0


def _next_call(s: Session, now: float, think: float, duration: float, regular: float) -> tuple[float, float]:
    """`next_call_in` given the session's agent's think time, call duration and how regular its
    waits are (`Timing.reliability`). A session in a call is expected to call again after the rest
    of it plus the think time; an idle one once its think time has passed, less likely the longer
    it waits beyond twice that. That an idle session calls sooner the longer it has waited holds
    for regular waits (a tool that takes ten seconds) only: where they are spread like people's,
    one that finished a moment ago is about as likely to call soon, so the remaining wait is drawn
    towards the think time as far as the waits are irregular."""
    if s.in_flight:
        return max(duration - (now - s.last_call_at), 0.1 * duration) + think, 1.0
    idle = now - max(s.last_finish_at, s.last_call_at)
    wait = max(think - idle, 0.1 * think)
    if regular < 1.0:
        wait = think * (wait / think) ** regular
    return wait, math.exp(-max(0.0, idle - 2.0 * think) / think)


def _as_expired(g: Group, now: float, dead_reuse: float) -> float:
    """The use rate of a context whose session expired: one use per idle time of its youngest
    free block (the session's last use), as LRU's order implies, times the share of expired
    sessions' context blocks used again (0 where workflows run their course)."""
    tail = g.tail
    if dead_reuse <= 0.0 or tail is None:
        return 0.0
    return dead_reuse / (max(now - tail.freed_at, 0.0) + 1e-3)


def _protect(parent: Group, child: Group, now: float) -> None:
    """Give `parent` its child's score where that keeps it longer. Compared by eviction key (see
    eviction.py) at the age of the parent's free head, so that a child on plain LRU order
    (confidence 0, its `model` meaningless) protects its prefix as LRU would, and a confident child
    by its prediction: evicting a prefix before what follows it wastes both."""
    head = parent.head
    if head is None:     # nothing of it is free now: keep the nearer prediction for later
        if child.model < parent.model:
            parent.model = child.model
        return
    age = math.log(max(now - head.freed_at, 0.0) + 1e-3)
    pc, cc = parent.conf, child.conf
    if pc <= 0.0:
        parent_key = age
    elif parent.model == math.inf:
        parent_key = math.inf
    else:
        parent_key = pc * parent.model + (1.0 - pc) * age
    child_key = age if cc <= 0.0 else cc * child.model + (1.0 - cc) * age
    if child_key < parent_key:
        if cc > 0.0:
            parent.model, parent.conf = child.model, cc
        else:
            parent.model, parent.conf = 0.0, 0.0


class _AgentView:
    """`score`'s per-agent inputs in one rescoring: its row, think time, call duration, and the
    uses that matter now (agents whose current anchor has free blocks)."""

    __slots__ = ("row", "think", "duration", "regular", "uses")

    def __init__(self, row: HorizonRow, think: float, duration: float, regular: float,
                 uses: tuple[tuple[str, float, float], ...]) -> None:
        self.row = row
        self.think = think
        self.duration = duration
        self.regular = regular
        self.uses = uses


class SurvivalScorer:
    """Scores the eviction index's groups. Reads the chain (through `chain`, which the policy may
    point at another learner), the sessions and the traffic's measurements; changes none of them."""

    def __init__(self, cfg: PolicyConfig, chain: LearnerRef, sessions: SessionTracker, cost: RebuildCost,
                 traffic: Traffic) -> None:
        self.cfg = cfg
        self._chain = chain
        self._sessions = sessions
        self._cost = cost
        self._traffic = traffic
        self._rows: dict[str, HorizonRow] = {}
        # What the last scoring was computed for (the chain's refresh count, trust, time tick).
        self._scored_refresh = -1
        self._scored_trust = 0
        self._scored_tick = 0.0
        self._round = 0   # rescorings so far (sessions' views carry the one they were made in)

    @property
    def dead_model(self) -> float:
        """The `model` value of a group predicted never to be used again."""
        return -math.log(_RATE_FLOOR)

    # -- model views --------------------------------------------------------------------------
    def row(self, src: str) -> tuple[dict[str, float], float]:
        """(reach within the horizon, confidence) of a source agent, recomputed every few updates."""
        got = self._row(src)
        return got.reach, got.conf

    def _row(self, src: str) -> HorizonRow:
        learner = self._chain.learner
        version = learner.version
        got = self._rows.get(src)
        if got is not None and version - got.version < self.cfg.model_refresh_interval:
            return got
        reach: dict[str, float] = {}
        extra: dict[str, float] = {}
        if learner.has_row(src):
            before: dict[str, float] = {}
            for k, cumulative in enumerate(learner.reach_within(src, self.cfg.prediction_horizon), 1):
                for x, p in cumulative.items():
                    first_at_k = p - before.get(x, 0.0)
                    if first_at_k > 0:
                        extra[x] = extra.get(x, 0.0) + first_at_k * (k - 1)
                before = cumulative
            reach = before
            extra = {x: e / reach[x] for x, e in extra.items() if reach.get(x, 0.0) > 0}
        conf = learner.confidence(src)
        if conf < self.cfg.min_confidence:
            conf = 0.0
        uses = tuple((x, p, extra.get(x, 0.0)) for x, p in reach.items() if x != END)
        got = HorizonRow(version, reach, conf, extra, uses)
        self._rows[src] = got
        if len(self._rows) > 4 * self.cfg.max_agents:
            self._rows.clear()
        return got

    def session_links(self) -> float:
        """How far to trust predictions about sessions' contexts, in [0, 1]: 0 when several agents
        are active but under a tenth of the multi-call sessions used more than one of them
        (sessions are evidently not being linked across agents; the few that are come from agents
        relabelled while their anchors were learned), 1 from a fifth on, or with no evidence."""
        share = self._sessions.cross_agent_share()
        if share is None or len(self._traffic.current_anchor) < 2:
            return 1.0
        return min(1.0, max(0.0, (share - _UNLINKED_SHARE) / (_LINKED_SHARE - _UNLINKED_SHARE)))

    def patience(self) -> tuple[Callable[[str | None], float], float]:
        """(how long a session of an agent may stay idle before it is all but certainly over,
        the least of those): idle that long, `next_call_in` gives it under 0.1% to go on."""
        think = self._traffic.think

        def of(agent: str | None) -> float:
            return max(think.get(agent), 1e-3) * _ALIVE_IDLE_THINKS
        return of, max(think.shortest(), 1e-3) * _ALIVE_IDLE_THINKS

    def next_call_in(self, s: Session, now: float) -> tuple[float, float]:
        """(seconds until the session's next call is expected, probability it is still going)."""
        traffic = self._traffic
        return _next_call(s, now, max(traffic.think.get(s.agent), 1e-3), traffic.duration.get(s.agent),
                          traffic.think.reliability(s.agent))

    def confidence(self) -> float:
        """Confidence of the rows the live sessions are predicted from (0 below min_confidence)."""
        num = den = 0.0
        for agent, n in self._sessions.agent_counts.items():
            num += n * self._row(agent).conf
            den += n
        conf = num / den if den > 0 else 0.0
        return conf if conf >= self.cfg.min_confidence else 0.0

    def next_call_probabilities(self, counts: Mapping[str, float] | None = None) -> dict[str, tuple[float, float]]:
        """For each agent X: (P(at least one live or arriving session calls X next), confidence),
        the confidence being that of the rows that predict X, weighted by what they contribute.
        `counts`: the sessions to count per current agent (default: every live one); given, new
        sessions are expected in proportion to them only."""
        miss: dict[str, float] = {}
        conf_num: dict[str, float] = {}
        conf_den: dict[str, float] = {}
        learner = self._chain.learner
        if counts is None:
            counts = self._sessions.agent_counts
            n_new = self._traffic.new_session_share * max(sum(counts.values()), 1)
        else:
            n_new = self._traffic.new_session_share * sum(counts.values())
        sources: list[tuple[str, float]] = list(counts.items())
        if n_new > 0 and learner.has_row(START):
            sources.append((START, n_new))
        for agent, n in sources:
            _, conf = self.row(agent)
            for x, p in learner.probabilities(agent).items():
                miss[x] = miss.get(x, 1.0) * (1.0 - p) ** n
                conf_num[x] = conf_num.get(x, 0.0) + n * p * conf
                conf_den[x] = conf_den.get(x, 0.0) + n * p
        return {x: (1.0 - m, conf_num[x] / conf_den[x] if conf_den[x] > 0 else 0.0) for x, m in miss.items()}

    # -- scoring ------------------------------------------------------------------------------
    def score(self, index: EvictionIndex, overrides: Mapping[object, str] | None = None,
              trust: float = 1.0, now: float = 0.0) -> None:
        """Write `model` and `conf` of every group; cheap to call again while nothing changed.

        `overrides` maps a session id to the agent it is known (hinted) to call next; `trust`
        (from the LRU guard) scales every confidence.
        """
        # Scores follow sessions and time; recomputing them every `rescore_interval_s` is enough
        # (groups created in between keep LRU order until then). They also follow the chain, at
        # once: on routing without a pattern its confidence falls with every few updates, and
        # leaving that to the clock cost 0.3 points of hit rate and up to 12% of TTFT there.
        interval = self.cfg.rescore_interval_s
        learner = self._chain.learner
        traffic = self._traffic
        refresh = learner.version // self.cfg.model_refresh_interval
        trusted = int(trust * 100.0 + 0.5)   # in hundredths
        tick = float(int(now / interval)) if interval > 0 else now
        if refresh == self._scored_refresh and trusted == self._scored_trust and tick == self._scored_tick:
            return
        self._scored_refresh, self._scored_trust, self._scored_tick = refresh, trusted, tick
        step = max(traffic.step_s, 1e-3)
        # Per live session (written on the session, numbered by rescoring): expected time to its
        # next call and whether it is still going; its use rate for agent x is
        # alive * P(x within the horizon) / (time to the call that uses x).
        self._round += 1
        rnd = self._round
        # Anchor use rates per anchor version (node): a session calls again the version it used
        # last (several versions of one agent's anchor can be in use at once: one per user, per
        # project), a session new to the agent its newest.
        anchor_rate: dict[int, float] = {}
        per_agent: dict[str, _AgentView] = {}
        num = den = 0.0
        # Only groups with free blocks can give victims; the others keep their last scores until
        # the next rescoring after their blocks are freed. So only the agents with an anchor that
        # has free blocks need a use rate.
        free_groups = list(index.free_groups())
        current = traffic.current_anchor
        wanted = {g.agent for g in free_groups if g.kind == "anchor"}

        # Sessions idle long enough are all but certainly over: they add nothing to the anchors'
        # rates (their own contexts are scored below, when they have free blocks).
        for s in self._sessions.recent(now, max(traffic.think.longest(), 1e-3) * _ALIVE_IDLE_THINKS):
            if s.agent is None:
                continue
            sv = s.view
            view = self._view(s, sv, s.agent, now, rnd, per_agent, overrides, wanted)
            t_next, alive = sv.t_next, sv.alive
            used = s.anchor_nodes
            for x, p, e in view.uses:
                node = used.get(x, 0) or current.get(x, 0)
                anchor_rate[node] = anchor_rate.get(node, 0.0) + alive * p / (t_next + e * step)
            nxt = sv.next_agent
            if nxt is not None:   # the framework said so
                node = used.get(nxt, 0) or current.get(nxt, 0)
                anchor_rate[node] = anchor_rate.get(node, 0.0) + alive / t_next
            num += alive * view.row.conf
            den += alive
        new_rate = traffic.new_session_rate
        if new_rate > 0 and learner.has_row(START):
            start = self._row(START)
            for x, p, _ in start.uses:
                node = current.get(x, 0)
                anchor_rate[node] = anchor_rate.get(node, 0.0) + new_rate * p
            share = new_rate * step
            num += share * start.conf
            den += share
        conf_all = num / den if den > 0 else 0.0
        if conf_all < self.cfg.min_confidence:
            conf_all = 0.0
        floor = -math.log(_RATE_FLOOR)
        cost = self._cost
        load_value = cost.backed_value("cpu")
        depth_priced = cost.depth_priced
        dead_reuse = traffic.dead_reuse
        spent_reuse = traffic.spent_reuse()
        link = self.session_links()
        # How long a free block stays cached now, as LRU keeps them: a use later than that is a
        # miss whatever the order, so waits are judged within it.
        residence = max(index.oldest_free_age(now), 1.0)
        anchors = []
        preambles = []
        session_of = self._sessions.get
        for g in free_groups:
            kind = g.kind
            if kind == "context":
                agent = g.agent
                ses = session_of(g.session)
                if ses is None:
                    # The session is over (it expired). Blocks of expired sessions' contexts that
                    # are used again after all (a chat's next turn may come as a session of its
                    # own) are used as LRU would expect, only that much less often: the rate
                    # LRU's order implies (one use per idle time) times that share.
                    rate, conf = _as_expired(g, now, dead_reuse), conf_all
                elif ses.agent is None and agent is None:
                    # A session whose calls no agent was recognised in (each conversation its
                    # own prompt, as in coding agents' traffic): its next call continues this
                    # context, when the waits learned after calls that ended as its last did say.
                    rate, conf = self._unknown_agent_rate(ses, g, now, residence, dead_reuse)
                elif ses.agent is None or agent is None:
                    rate, conf = 0.0, 0.0                  # nothing known: LRU
                else:
                    # Most live sessions were viewed above.
                    sv = ses.view
                    row = (self._view(ses, sv, ses.agent, now, rnd, per_agent, overrides, wanted).row
                           if sv.round != rnd else cast(HorizonRow, sv.row))
                    t_next, alive = sv.t_next, sv.alive
                    p = row.reach.get(agent, 0.0)
                    rate = alive * p / (t_next + row.extra.get(agent, 0.0) * step) if p else 0.0
                    # The group's idle time is its youngest free block's: the blocks the session
                    # last used. (Its oldest can be far older: blocks its later calls left out, as
                    # a conversation is edited or branches; judged by those, the group of a session
                    # that called a minute ago looked idle for many minutes.)
                    tail = g.tail
                    if tail is not None:
                        idle = max(now - tail.freed_at, 0.0) + 1e-3
                        if rate > 0.0:
                            # Timing as far as the waits are regular: where they are not, the time
                            # a session has idled stands in for when it calls next (as in LRU).
                            r = per_agent[ses.agent].regular   # this rescoring's view made it
                            if r < 1.0:
                                rate = math.exp(r * math.log(rate) + (1.0 - r) * (math.log(p) - math.log(idle)))
                        # Never below what the same blocks are worth once the session expired: a
                        # session predicted to end (rate ~0) may still see its context used by
                        # another (a chat's next turn as a session of its own), as expired ones are.
                        if dead_reuse > 0.0:
                            rate = max(rate, dead_reuse / idle)
                    # How far sessions are linked across agents bears only on contexts under
                    # another agent than the session's own (its own agent's next call extends
                    # the prompt it already sent: a continuation, always linked).
                    conf = row.conf * (1.0 if agent == ses.agent else link)
                    if sv.next_agent == agent:             # the framework said so
                        rate = max(rate, alive / t_next)
                        conf = 1.0
            elif kind == "anchor":
                anchors.append(g)
                rate = anchor_rate.get(cast(tuple, g.gid)[2], 0.0) if g.agent is not None else 0.0
                conf = conf_all
            elif kind == "preamble":
                preambles.append(g)
                g.model = math.inf
                g.conf = conf_all * trust
                continue
            elif kind == "spent":
                # Blocks a context's later call left out: used again (by a call that rewinds, by
                # another session) as LRU would expect, only that much less often: the rate its
                # order gives the oldest of them (one use per idle time) times the share of spent
                # blocks used again. Trusted by how many were seen; where that share is 1 the
                # order is LRU's.
                share, conf = spent_reuse
                head = g.head
                rate = share / (max(now - head.freed_at, 0.0) + 1e-3) if head is not None else share
                if conf < self.cfg.min_confidence:
                    conf = 0.0
            elif kind == "wanted":   # a queued request will hit them: a fact, set when it was queued
                continue
            else:
                g.model, g.conf = 0.0, 0.0
                continue
            # What losing the group's next victim costs, relative to recomputing a block at the
            # start of a prompt: more where attention makes deep blocks dearer, less where a lower
            # tier holds copies (a load, where that is cheaper). A group used at `rate` goes as if
            # used that many times more (or less) often. This prices predictions only: where
            # there is none (conf 0) the order stays LRU's. (LRU's order by age over that cost was
            # measured and left out: on the Claude Code mixes it put more cells above LRU's TTFT;
            # see docs/policy.md, known limits.)
            loss = 1.0
            if depth_priced:
                head = g.head
                if head is not None:
                    loss = cost.depth_factor(head.depth)
            if g.n_free and g.n_backed_free and load_value < loss:
                loss -= (g.n_backed_free / g.n_free) * (loss - load_value)
            rate *= loss
            g.model = -math.log(rate) if rate > _RATE_FLOOR else floor
            g.conf = conf * trust
        # A prefix is needed whenever anything below it is: parents never look colder than
        # children (contexts, then anchors, pass their scores up).
        for g in free_groups:
            if g.kind == "context" and g.parent is not None:
                _protect(g.parent, g, now)
        for g in anchors:
            if g.parent is not None:
                _protect(g.parent, g, now)
        for g in preambles:
            if g.model == math.inf:
                g.model = floor
        index.scores_changed()

    def _unknown_agent_rate(self, ses: Session, g: Group, now: float, residence: float,
                            dead_reuse: float) -> tuple[float, float]:
        """(use rate, confidence) of the context of a session with no known agent: P(it calls
        within `residence`) / the expected wait until then, from the waits learned after calls
        that ended as its last (`Traffic.waits`); never below what an expired session's context
        is worth. Confidence grows with the waits seen; (0, 0), LRU's order, before any."""
        traffic = self._traffic
        waits = traffic.waits
        if ses.in_flight:
            idle = 0.0
            ahead = max(traffic.duration.get(None) - (now - ses.last_call_at), 0.0)
        else:
            idle = max(now - max(ses.last_finish_at, ses.last_call_at), 0.0)
            ahead = 0.0
        got = waits.next_call(ses.ending, idle, residence)
        if got is None:
            return 0.0, 0.0
        p, wait = got
        rate = max(p / (wait + ahead), _as_expired(g, now, dead_reuse))
        conf = waits.seen / (waits.seen + _WAITS_HALF_CONFIDENT)
        return rate, conf if conf >= self.cfg.min_confidence else 0.0

    def _view(self, s: Session, sv: SessionView, agent: str, now: float, rnd: int,
              per_agent: dict[str, _AgentView], overrides: Mapping[object, str] | None,
              wanted: set[str | None]) -> _AgentView:
        """`score`'s view of session `s` in rescoring `rnd`, written into its `sv` (time to its next
        call, probability it is still going, its agent's row, the agent it is hinted to call next);
        returns its agent's view."""
        view = per_agent.get(agent)
        if view is None:
            row = self._row(agent)
            traffic = self._traffic
            view = per_agent[agent] = _AgentView(row, max(traffic.think.get(agent), 1e-3), traffic.duration.get(agent),
                                                 traffic.think.reliability(agent),
                                                 tuple(u for u in row.uses if u[0] in wanted))
        sv.t_next, sv.alive = _next_call(s, now, view.think, view.duration, view.regular)
        sv.row = view.row
        sv.next_agent = overrides.get(s.sid) if overrides else None
        sv.round = rnd
        return view

    def invalidate(self) -> None:
        self._scored_refresh = -1
