"""Published competitors, as the benchmark models them (our reading of the papers).

- Continuum (KV-cache time-to-live for multi-turn agents): when a call ends and the workflow goes
  off to run a tool, its KV stays pinned in GPU memory for a time-to-live, so the session's next
  call finds it; the TTL follows how long that agent's tool calls usually take, and pinning is
  bounded. Otherwise vLLM's LRU. It is given the true agent of every call. Continuum weighs a pin's
  cost against its benefit; we read that charitably: an agent's calls are pinned only while at least
  half of that agent's recent pins were reused before they expired (in a supervisor workflow the
  next call usually goes to another agent, whose prefix differs). Calls without a known agent (a
  trace that does not label them) share one estimate.
- KVFlow (workflow-aware KV cache management): every cached agent prefix and session context gets
  an eviction priority from its agent's steps-to-execution in the workflow's agent step graph, and
  the agents about to run have their KV prefetched from CPU to GPU. It is given an oracle: the true
  graph (transition frequencies measured over the whole workload), true agents, true sessions and
  where each agent's anchor ends.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Hashable, Sequence
from typing import Final

from cachescout.policy import EvictionIndex, InputError

from .replay import ReplayPolicy, Request, call_keys
from .workloads import Session

_EMA: Final = 0.1
_ANY_AGENT: Final = "<any>"   # Continuum's key for calls of unknown agent


class ContinuumPolicy(ReplayPolicy):
    name = "continuum"

    def __init__(self, ttl_factor: float = 2.0, max_ttl_s: float = 10.0, max_pinned_share: float = 0.25) -> None:
        self.free: OrderedDict[Hashable, None] = OrderedDict()   # unpinned free blocks, LRU first
        self.pinned: dict[Hashable, float] = {}                  # pinned free blocks -> expiry
        self._expiries: list[tuple[float, Hashable]] = []
        self._pin_on_free: dict[Hashable, float] = {}
        self._gap: dict[str, float] = {}                         # agent -> typical gap after its calls
        self._ended: dict[str, tuple[str, float]] = {}           # session -> (agent, end time)
        self.ttl_factor = ttl_factor
        self.max_ttl_s = max_ttl_s
        self.max_pinned_share = max_pinned_share
        self._pin_agent: dict[Hashable, str] = {}                # pinned block -> agent that pinned it
        self._paid: dict[str, float] = {}                        # agent -> share of pins reused (EMA)

    def arrived(self, req: Request, now: float) -> None:
        last = self._ended.pop(req.session.session_id, None)   # (agent, when its call ended)
        if last is not None:
            agent, t = last
            old = self._gap.get(agent)
            gap = now - t
            self._gap[agent] = gap if old is None else old + _EMA * (gap - old)

    def finished(self, req: Request, now: float) -> None:
        # Runs before the request's blocks are freed (as vLLM's request_finished does).
        agent = req.agent if req.agent is not None else _ANY_AGENT
        self._ended[req.session.session_id] = (agent, now)
        gap = self._gap.get(agent)
        if gap is None or gap > self.max_ttl_s or self._paid.get(agent, 1.0) < 0.5:
            return                       # no record yet, tool calls too long, or pins do not pay
        tracked = len(self.free) + len(self.pinned) + 1
        if len(self.pinned) >= self.max_pinned_share * tracked:
            return
        expiry = now + min(self.ttl_factor * gap, self.max_ttl_s)
        for k in req.keys:
            self._pin_on_free[k] = expiry
            self._pin_agent[k] = agent

    def freed(self, keys: Sequence[Hashable], now: float) -> None:
        for k in keys:
            expiry = self._pin_on_free.pop(k, 0.0)
            if expiry > now:
                self.pinned[k] = expiry
                heapq.heappush(self._expiries, (expiry, k))
            else:
                self.free[k] = None

    def reused(self, keys: Sequence[Hashable], now: float) -> None:
        for k in keys:
            if k in self.free:
                del self.free[k]
            elif self.pinned.pop(k, None) is not None:
                self._outcome(k, reused=True)

    def evict(self, n: int, now: float) -> list[Hashable]:
        # Expired pins join the LRU order at its old end (they were freed a while ago).
        heap = self._expiries
        while heap and heap[0][0] <= now:
            expiry, k = heapq.heappop(heap)
            if self.pinned.get(k) == expiry:
                del self.pinned[k]
                self._outcome(k, reused=False)
                self.free[k] = None
                self.free.move_to_end(k, last=False)
        out: list[Hashable] = []
        while self.free and len(out) < n:
            out.append(self.free.popitem(last=False)[0])
        while heap and len(out) < n:     # nothing unpinned left: the pin that expires first goes
            expiry, k = heapq.heappop(heap)
            if self.pinned.get(k) == expiry:
                del self.pinned[k]
                self._outcome(k, reused=False)
                out.append(k)
        return out

    def _outcome(self, key: Hashable, reused: bool) -> None:
        agent = self._pin_agent.pop(key, None)
        if agent is not None:
            old = self._paid.get(agent, 1.0)
            self._paid[agent] = old + 0.02 * ((1.0 if reused else 0.0) - old)


class KVFlowPolicy(ReplayPolicy):
    name = "kvflow"
    _END = "<end>"
    _HORIZON = 8      # steps looked ahead; farther is "never"

    def __init__(self, sessions: Sequence[Session], block_size: int) -> None:
        unlabelled = sum(c.agent is None for s in sessions for c in s.calls)
        if unlabelled:
            raise InputError(f"kvflow needs the true agent of every call (its workflow graph is built from them); "
                             f"{unlabelled:,} calls here have none")
        counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        keys_by_agent: dict[str, list[list[Hashable]]] = defaultdict(list)
        for s in sessions:
            agents = [c.agent for c in s.calls]
            for a, b in zip(agents, agents[1:] + [self._END], strict=True):
                counts[a][b] += 1
            for c in s.calls[:50]:
                if len(keys_by_agent[c.agent]) < 50:
                    keys_by_agent[c.agent].append(call_keys(c, block_size))
        self.graph = {a: {b: n / sum(row.values()) for b, n in row.items()} for a, row in counts.items()}
        self.anchor = {a: _common_prefix(ks) for a, ks in keys_by_agent.items()}
        self.steps = {a: self._steps_from(a) for a in self.graph}
        self.index = EvictionIndex()
        self.current: dict[str, str] = {}        # live session -> agent of its latest call
        self._running: Counter[str] = Counter()  # how many live sessions are at each agent
        self._called: dict[str, set[str]] = {}   # live session -> agents it called (its contexts)
        self._anchor_steps: dict[str, int] = {}
        self._arrivals = 0
        self._planned_at = -1.0
        self._agent_of: dict[Hashable, str] = {}

    def _steps_from(self, src: str) -> dict[str, int]:
        """Steps until each agent runs, from `src`: the first step at which it is reached with
        probability at least 0.3 (first passage over the true graph)."""
        out: dict[str, int] = {}
        dist = {src: 1.0}
        for k in range(1, self._HORIZON + 1):
            nxt: dict[str, float] = defaultdict(float)
            for a, p in dist.items():
                for b, q in self.graph.get(a, {}).items():
                    nxt[b] += p * q
            for b, p in nxt.items():
                if b != self._END and b not in out and p >= 0.3:
                    out[b] = k
            dist = {b: p for b, p in nxt.items() if b != self._END}
        return out

    # Scores follow the live sessions' current agents only, so they change only when a call arrives
    # or a session ends: then the groups concerned are rescored (and re-keyed in the index's heap),
    # not every group.
    def _score(self, g) -> None:
        never = self._HORIZON + 1
        if g.kind == "anchor":
            steps = self._anchor_steps.get(g.agent, never)
        else:
            agent = self.current.get(g.session)
            steps = never if agent is None else self.steps.get(agent, {}).get(g.agent, never)
        model = math.log(steps + 1.0)   # farther from execution: evicted first
        if g.model != model or g.conf != 1.0:
            g.model, g.conf = model, 1.0
            self.index.rescored(g)

    def _session_moved(self, sid: str, old: str | None, new: str | None) -> None:
        if old is not None:
            self._running[old] -= 1
            if not self._running[old]:
                del self._running[old]
        if new is not None:
            self._running[new] += 1
        get = self.index.get_group
        for agent in self._called.get(sid, ()):
            g = get(("ctx", sid, agent))
            if g is not None:
                self._score(g)
        anchor_steps: dict[str, int] = {}
        for agent in self._running:
            for b, k in self.steps.get(agent, {}).items():
                if k < anchor_steps.get(b, self._HORIZON + 1):
                    anchor_steps[b] = k
        if anchor_steps != self._anchor_steps:
            self._anchor_steps = anchor_steps
            for agent in self.anchor:
                g = get(("anchor", agent))
                if g is not None:
                    self._score(g)

    def _group(self, req: Request, position: int):
        agent, sid = _agent_of(req), req.session.session_id
        gid: tuple
        if position < len(self.anchor.get(agent, ())):
            gid, kind = ("anchor", agent), "anchor"
        else:
            gid, kind = ("ctx", sid, agent), "context"
        g = self.index.get_group(gid)
        if g is None:   # new: scored at once
            g = self.index.group(gid, kind, agent=agent, session=sid if kind == "context" else None)
            self._score(g)
        return g

    def arrived(self, req: Request, now: float) -> None:
        sid = req.session.session_id
        self._called.setdefault(sid, set()).add(_agent_of(req))
        old = self.current.get(sid)
        self.current[sid] = _agent_of(req)
        self._session_moved(sid, old, _agent_of(req))
        self._arrivals += 1
        if self._arrivals % 512 == 0:
            self.index.prune_groups()   # finished sessions' empty contexts

    def finished(self, req: Request, now: float) -> None:
        if req.index == len(req.session.calls) - 1:     # the oracle knows the session is over
            sid = req.session.session_id
            self._session_moved(sid, self.current.pop(sid, None), None)
            self._called.pop(sid, None)

    def admitted(self, req: Request, keys: Sequence[Hashable], num_cached: int, now: float) -> None:
        # The anchor's blocks, then the context's: two groups, looked up once each.
        split = min(len(self.anchor.get(_agent_of(req), ())), len(keys))
        add = self.index.add
        if split:
            group = self._group(req, 0)
            for key in keys[:split]:
                add(key, group)
        if split < len(keys):
            group = self._group(req, split)
            for key in keys[split:]:
                add(key, group)
        self.index.acquire(keys[:num_cached])

    def cached(self, req: Request, keys: Sequence[Hashable], now: float) -> None:
        group = self._group(req, 1 << 30)
        for key in keys:
            self.index.add(key, group)

    def reused(self, keys: Sequence[Hashable], now: float) -> None:
        self.index.acquire(keys)

    def freed(self, keys: Sequence[Hashable], now: float) -> None:
        self.index.release(keys, now)

    def prefetched(self, keys: Sequence[Hashable], now: float) -> None:
        for key in keys:
            agent = self._agent_of.pop(key, None)
            group = None
            if agent:
                group = self.index.get_group(("anchor", agent))
                if group is None:
                    group = self.index.group(("anchor", agent), "anchor", agent=agent)
                    self._score(group)
            self.index.add(key, group)
        self.index.release(keys, now)

    def evict(self, n: int, now: float) -> list[Hashable]:
        return self.index.evict(n, now)

    def prefetch(self, engine, now: float) -> list[Hashable]:
        if now - self._planned_at < 0.1:
            return []
        self._planned_at = now
        nxt = {b for agent in self.current.values() for b, k in self.steps.get(agent, {}).items() if k == 1}
        keys: list[Hashable] = []
        self._agent_of = {}
        for agent in sorted(nxt):
            for key in self.anchor.get(agent, ()):
                where = engine.where(key)
                if where is None:
                    break                # a prefix hit cannot reach past a block that is nowhere
                if where != "gpu":
                    keys.append(key)
                    self._agent_of[key] = agent
        return keys


def _agent_of(req: Request) -> str:
    agent = req.agent
    assert agent is not None, "KVFlow checks at construction that every call names its agent"
    return agent


def _common_prefix(seqs: Sequence[Sequence[Hashable]]) -> list[Hashable]:
    if not seqs:
        return []
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != first[i] for s in seqs):
            return list(first[:i])
    return list(first[:n])
