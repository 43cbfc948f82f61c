"""Survival scores: how soon each group of cached blocks will be needed again, and how sure we are.

For every live session the chain gives the probability that each agent is called within the next
`prediction_horizon` calls (first-passage probabilities over the learned transitions). Summed over
the live sessions, plus the sessions expected to start in that window, this is the expected number
of uses lambda of each agent's anchor; a session's own context under an agent is reused only when
that session calls the agent again. A group's predicted time to next use is horizon / lambda, its
value scaled down when a lower tier already holds a copy (then losing it costs a load, not a
recompute). The eviction index blends the log of that time with the log of the group's LRU age by
the confidence of the rows involved, so an empty or unpredictable chain gives exactly LRU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from .config import PolicyConfig
from .costs import RebuildCost
from .eviction import EvictionIndex
from .sessions import SessionTracker
from .transitions import START, TransitionLearner

_LAMBDA_FLOOR = 1e-3  # a group nobody is predicted to use is "1000 horizons away", not infinitely


class SurvivalScorer:
    def __init__(self, cfg: PolicyConfig, learner: TransitionLearner, sessions: SessionTracker,
                 cost: RebuildCost) -> None:
        self.cfg = cfg
        self.learner = learner
        self.sessions = sessions
        self.cost = cost
        self.current_anchor: dict[str, int] = {}  # agent -> anchor version node in use now
        self.step_s = 1.0             # typical time between two calls of one session (EMA)
        self.new_session_share = 0.0  # share of calls that open a session (EMA)
        self._rows: dict[str, tuple[int, dict[str, float], float]] = {}
        self._scored_at: tuple | None = None

    # -- model views --------------------------------------------------------------------------
    def row(self, src: str) -> tuple[dict[str, float], float]:
        """(reach within the horizon, confidence) of a source agent, recomputed every few updates."""
        version = self.learner.version
        got = self._rows.get(src)
        if got is not None and version - got[0] < self.cfg.model_refresh_interval:
            return got[1], got[2]
        reach = self.learner.reach(src, self.cfg.prediction_horizon) if self.learner.has_row(src) else {}
        conf = self.learner.confidence(src)
        if conf < self.cfg.min_confidence:
            conf = 0.0
        self._rows[src] = (version, reach, conf)
        if len(self._rows) > 4 * self.cfg.max_agents:
            self._rows.clear()
        return reach, conf

    def demand(self) -> tuple[dict[str, float], float]:
        """Expected uses of each agent within the horizon over live and arriving sessions, and the
        confidence of that estimate (live-session-weighted confidence of the rows used)."""
        lam: dict[str, float] = {}
        num = den = 0.0
        counts = self.sessions.agent_counts
        n_live = 0
        for agent, n in counts.items():
            n_live += n
            reach, conf = self.row(agent)
            for x, p in reach.items():
                lam[x] = lam.get(x, 0.0) + n * p
            num += n * conf
            den += n
        n_new = self.new_session_share * self.cfg.prediction_horizon * max(n_live, 1)
        if n_new > 0 and self.learner.has_row(START):
            reach, conf = self.row(START)
            for x, p in reach.items():
                lam[x] = lam.get(x, 0.0) + n_new * p
            num += n_new * conf
            den += n_new
        return lam, (num / den if den > 0 else 0.0)

    def next_call_probabilities(self) -> dict[str, tuple[float, float]]:
        """For each agent X: (P(at least one live or arriving session calls X next), confidence),
        the confidence being that of the rows that predict X, weighted by what they contribute."""
        miss: dict[str, float] = {}
        conf_num: dict[str, float] = {}
        conf_den: dict[str, float] = {}
        counts = self.sessions.agent_counts
        n_live = sum(counts.values())
        sources: list[tuple[str, float]] = list(counts.items())
        n_new = self.new_session_share * max(n_live, 1)
        if n_new > 0 and self.learner.has_row(START):
            sources.append((START, n_new))
        for agent, n in sources:
            _, conf = self.row(agent)
            for x, p in self.learner.probabilities(agent).items():
                miss[x] = miss.get(x, 1.0) * (1.0 - p) ** n
                conf_num[x] = conf_num.get(x, 0.0) + n * p * conf
                conf_den[x] = conf_den.get(x, 0.0) + n * p
        return {x: (1.0 - m, conf_num[x] / conf_den[x] if conf_den[x] > 0 else 0.0) for x, m in miss.items()}

    # -- scoring ------------------------------------------------------------------------------
    def score(self, index: EvictionIndex, overrides: Mapping[object, str] | None = None,
              trust: float = 1.0) -> None:
        """Write `model` and `conf` of every group; cheap to call again while nothing changed.

        `overrides` maps a session id to the agent it is known (hinted) to call next; `trust`
        (from the LRU guard) scales every confidence.
        """
        trust = round(trust, 2)
        stamp = (self.learner.version // self.cfg.model_refresh_interval, self.sessions.version,
                 len(index.groups()), trust)
        if stamp == self._scored_at:
            return
        self._scored_at = stamp
        lam, conf_all = self.demand()
        if overrides:
            for nxt in overrides.values():
                lam[nxt] = lam.get(nxt, 0.0) + 1.0
        if conf_all < self.cfg.min_confidence:
            conf_all = 0.0
        log_h = math.log(self.cfg.prediction_horizon * self.step_s)
        backed_value = self.cost.backed_value("cpu")
        sessions = self.sessions
        current = self.current_anchor
        anchors = []
        preambles = []
        for g in index.groups():
            kind = g.kind
            if kind == "context":
                s = sessions.get(g.session)
                if s is None:
                    lam_g, conf = 0.0, conf_all           # the session is over
                elif s.agent is None or g.agent is None:
                    lam_g, conf = 0.0, 0.0                 # nothing known: LRU
                else:
                    reach, conf = self.row(s.agent)
                    lam_g = reach.get(g.agent, 0.0)
                    if overrides and overrides.get(g.session) == g.agent:
                        lam_g, conf = 1.0, 1.0             # the framework said so
            elif kind == "anchor":
                anchors.append(g)
                lam_g = lam.get(g.agent, 0.0) if current.get(g.agent) == g.gid[2] else 0.0
                conf = conf_all
            elif kind == "preamble":
                preambles.append(g)
                g.model = math.inf
                g.conf = conf_all * trust
                continue
            else:
                g.model, g.conf = 0.0, 0.0
                continue
            if g.n_free and g.n_backed_free:
                lam_g *= 1.0 - (g.n_backed_free / g.n_free) * (1.0 - backed_value)
            g.model = log_h - math.log(max(lam_g, _LAMBDA_FLOOR))
            g.conf = conf * trust
        # A prefix is needed whenever anything below it is: parents never look colder than children.
        for g in index.groups():
            if g.kind == "context" and g.parent is not None and g.model < g.parent.model:
                g.parent.model = g.model
        for g in anchors:
            if g.parent is not None and g.model < g.parent.model:
                g.parent.model = g.model
        for g in preambles:
            if g.model == math.inf:
                g.model = log_h - math.log(_LAMBDA_FLOOR)
        index.scores_changed()

    def invalidate(self) -> None:
        self._scored_at = None
