"""Online first-order Markov chain over agents, with exponential decay per source agent.

Each row (source agent) forgets at its own pace: an old transition weighs 2**(-k / half_life) after k
newer transitions out of the same agent. So a change in the workflow is followed after a few
half-lives of that agent's own traffic, and a rare agent keeps what it learned while busy agents run.

The decay costs O(1) per update: counts are stored inflated by a per-row weight that grows by
2**(1/half_life) at each update, so probabilities are plain ratios of stored numbers and only the
effective (decayed) count needs the weight. Rows are rescaled when the weight gets large.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from .errors import ConfigError, InputError

START: Final = "<start>"  # pseudo-agent: a session's first call is a transition out of it
END: Final = "<end>"      # pseudo-agent: a session that ends makes a transition into it

_RESCALE_AT: Final = 1e120
_REACH_EPS: Final = 1e-6  # multi-step probabilities below this are dropped to keep rows sparse


class _Row:
    __slots__ = ("counts", "total", "weight", "updates")

    def __init__(self) -> None:
        self.counts: dict[str, float] = {}
        self.total = 0.0
        self.weight = 1.0
        self.updates = 0


class TransitionLearner:
    """Decayed transition counts between agents, their probabilities and how far to trust them."""

    def __init__(self, half_life: float = 200.0, confidence_count_scale: float = 8.0) -> None:
        if not (half_life > 0 and math.isfinite(half_life)):
            raise ConfigError(f"half_life must be a positive number, got {half_life!r}")
        self.half_life = float(half_life)
        self.confidence_count_scale = float(confidence_count_scale)
        self._growth = 2.0 ** (1.0 / self.half_life)
        self._rows: dict[str, _Row] = {}
        self._states: set[str] = set()  # every agent seen as a destination (END included)
        self.version = 0                  # bumped on every change; caches key on it
        # Called with ("update", src, dst, weight) / ("forget", agent) for each change made from this
        # replica's own traffic, so the shared state can keep its own counts apart from the peers'.
        self.journal: Callable[[tuple], None] | None = None

    # -- learning -----------------------------------------------------------------------------
    def update(self, src: str, dst: str, weight: float = 1.0) -> None:
        """Count one observed transition src -> dst (one dict update, O(1))."""
        row = self._rows.get(src)
        if row is None:
            row = self._rows[src] = _Row()
        w = row.weight * weight
        counts = row.counts
        counts[dst] = counts.get(dst, 0.0) + w
        row.total += w
        row.updates += 1
        row.weight *= self._growth
        if row.weight > _RESCALE_AT:
            self._rescale(row)
        if dst not in self._states:
            self._states.add(dst)
        self.version += 1
        if self.journal is not None:
            self.journal(("update", src, dst, weight))

    @staticmethod
    def _rescale(row: _Row) -> None:
        k = 1.0 / row.weight
        for dst in row.counts:
            row.counts[dst] *= k
        row.total *= k
        row.weight = 1.0

    def absorb(self, rows: Mapping[str, Mapping[str, float]]) -> None:
        """Add decayed counts from elsewhere (another replica's snapshot), as if just observed."""
        for src, dsts in rows.items():
            row = self._rows.get(src)
            if row is None:
                row = self._rows[src] = _Row()
            # A decayed count c is worth c * (weight / growth) in this row's inflated units.
            scale = row.weight / self._growth
            for dst, c in dsts.items():
                if c <= 0:
                    continue
                row.counts[dst] = row.counts.get(dst, 0.0) + c * scale
                row.total += c * scale
                self._states.add(dst)
        self.version += 1

    def rename(self, old: str, new: str) -> None:
        """Fold agent `old` into `new` (an anchor that became a new version of an agent)."""
        if old == new:
            return
        old_row = self._rows.pop(old, None)
        if old_row is not None:
            self.absorb({new: self._decayed(old_row)})
        for row in self._rows.values():
            c = row.counts.pop(old, None)
            if c is not None:
                row.counts[new] = row.counts.get(new, 0.0) + c
        self._states.discard(old)
        self._states.add(new)
        self.version += 1

    def forget(self, agent: str) -> None:
        """Drop an agent that aged out (its row and the transitions into it)."""
        self._rows.pop(agent, None)
        for row in self._rows.values():
            c = row.counts.pop(agent, None)
            if c is not None:
                row.total -= c
                if row.total < 0:
                    row.total = 0.0
        self._states.discard(agent)
        self.version += 1
        if self.journal is not None:
            self.journal(("forget", agent))

    def replay(self, op: tuple) -> None:
        """Apply one journal entry (see `journal`)."""
        if op[0] == "update":
            self.update(op[1], op[2], op[3])
        elif op[0] == "forget":
            self.forget(op[1])
        else:
            raise InputError(f"unknown journal entry {op[0]!r}")

    # -- reading ------------------------------------------------------------------------------
    def agents(self) -> set[str]:
        """Every state known, as source or destination (START and END included when seen)."""
        return set(self._rows) | self._states

    def has_row(self, src: str) -> bool:
        return src in self._rows

    def probabilities(self, src: str) -> dict[str, float]:
        """P(next = dst | current = src) for the destinations seen; {} for an unknown source."""
        row = self._rows.get(src)
        if row is None or row.total <= 0:
            return {}
        inv = 1.0 / row.total
        return {dst: c * inv for dst, c in row.counts.items()}

    def probability(self, src: str, dst: str) -> float:
        row = self._rows.get(src)
        if row is None or row.total <= 0:
            return 0.0
        return row.counts.get(dst, 0.0) / row.total

    def effective_count(self, src: str) -> float:
        """Decayed number of transitions observed out of `src`."""
        row = self._rows.get(src)
        return 0.0 if row is None else row.total * self._growth / row.weight

    def entropy(self, src: str) -> float:
        """Miller-Madow corrected entropy (nats) of the next agent after `src`."""
        row = self._rows.get(src)
        if row is None or row.total <= 0:
            return 0.0
        inv = 1.0 / row.total
        h = 0.0
        nonzero = 0
        for c in row.counts.values():
            if c > 0:
                p = c * inv
                h -= p * math.log(p)
                nonzero += 1
        n = self.effective_count(src)
        if n > 0:
            h += (nonzero - 1) / (2.0 * n)
        return h

    def confidence(self, src: str) -> float:
        """How far to trust the row of `src`, in [0, 1].

        The product of a count term n / (n + scale) and a predictability term 1 - H / log(K), K
        being the number of agents a call can go to. An empty row and a uniform row both give 0.
        """
        n = self.effective_count(src)
        if n <= 0:
            return 0.0
        k = len(self._states)
        if k < 2:
            predictability = 1.0
        else:
            predictability = max(0.0, 1.0 - self.entropy(src) / math.log(k))
        return predictability * n / (n + self.confidence_count_scale)

    def reach(self, src: str, steps: int) -> dict[str, float]:
        """P(agent X is called at least once within the next `steps` calls | current = src).

        First-passage recursion h_k(a, X) = P(a, X) + sum_{Y != X} P(a, Y) h_{k-1}(Y, X), over the
        sparse rows; END absorbs (a finished session calls nothing more).
        """
        return self.reach_within(src, steps)[-1]

    def reach_within(self, src: str, steps: int) -> list[dict[str, float]]:
        """`reach(src, k)` for k = 1 .. steps, computed together."""
        if steps < 1:
            raise InputError(f"steps must be >= 1, got {steps}")
        memo: dict[tuple[str, int], dict[str, float]] = {}
        return [self._first_passage(src, k, memo) for k in range(1, steps + 1)]

    def _first_passage(self, a: str, k: int, memo: dict[tuple[str, int], dict[str, float]]) -> dict[str, float]:
        key = (a, k)
        got = memo.get(key)
        if got is not None:
            return got
        first = self.probabilities(a)
        out = dict(first)
        if k > 1:
            for y, py in first.items():
                if y == END or py < _REACH_EPS:
                    continue
                for x, px in self._first_passage(y, k - 1, memo).items():
                    if x != y:
                        out[x] = out.get(x, 0.0) + py * px
        out = {x: min(1.0, p) for x, p in out.items() if p >= _REACH_EPS}
        memo[key] = out
        return out

    def decayed_rows(self) -> dict[str, dict[str, float]]:
        """Every row as decayed counts (what a snapshot stores)."""
        return {src: self._decayed(row) for src, row in self._rows.items()}

    def _decayed(self, row: _Row) -> dict[str, float]:
        scale = self._growth / row.weight
        return {dst: c * scale for dst, c in row.counts.items()}

    def row_count(self) -> int:
        return len(self._rows)

    def edges(self) -> Iterable[tuple[str, str, float]]:
        for src, row in self._rows.items():
            for dst, c in self._decayed(row).items():
                yield src, dst, c


class LearnerRef:
    """The learner the policy predicts from, held in one place: the scorer reads it through this,
    and a merged model built off the serving path replaces it by one assignment."""

    __slots__ = ("learner",)

    def __init__(self, learner: TransitionLearner) -> None:
        self.learner = learner


class HorizonRow:
    """What the chain predicts after a source agent within the prediction horizon (the scorer
    computes one per source agent and keeps it for a few of the learner's updates)."""

    __slots__ = ("version", "reach", "conf", "extra", "uses")

    def __init__(self, version: int, reach: dict[str, float], conf: float, extra: dict[str, float],
                 uses: tuple[tuple[str, float, float], ...]) -> None:
        self.version = version    # the learner's version it was computed at
        self.reach = reach        # agent -> P(called within the horizon)
        self.conf = conf          # confidence in the row (0 below min_confidence)
        self.extra = extra        # agent -> expected calls before its first use, given it happens
        self.uses = uses          # (agent, reach, extra) of the real agents, for scoring
