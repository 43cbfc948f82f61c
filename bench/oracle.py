"""Prefix-aware Belady: the bound for eviction-only policies on the GPU tier.

It evicts the free block whose next use is farthest in the future. Future uses come from the calls
not yet issued, each placed at its arrival time in a reference run of the same workload with an
unbounded cache (closed-loop timing shifts a little between policies; the order of calls barely
does). Chained hashes make a block's every use also a use of all blocks before it, so a prefix is
never needed later than what follows it; ties go to the deeper block, so the oracle never evicts a
block whose successors stay cached.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import Any

from .replay import Engine, EngineConfig, LRUPolicy, ReplayPolicy, Request, call_keys
from .workloads import Session


class OraclePolicy(ReplayPolicy):
    name = "oracle"

    def __init__(self, sessions: Sequence[Session], block_size: int) -> None:
        reference = Engine(EngineConfig(gpu_blocks=1 << 30, block_size=block_size), LRUPolicy()).run(sessions)
        arrival = {(r.session.session_id, r.index): r.issued_at for r in reference.requests}
        calls = [(arrival[(s.session_id, i)], call_keys(call, block_size))
                 for s in sessions for i, call in enumerate(s.calls)]
        # A use at time t of a block at depth d gets the priority rank(t) * span + d: farther uses
        # first, at equal times the deeper block first, in one integer (one comparison in the heap).
        rank = {t: i for i, t in enumerate(sorted({t for t, _ in calls}))}
        span = max((len(keys) for _, keys in calls), default=0) + 1
        self._never = len(rank) * span   # no use left: before every block that has one
        # key -> priorities of its future uses, latest first; consumed (popped) as calls arrive.
        uses: dict[int, list[int]] = defaultdict(list)
        for t, keys in calls:
            base = rank[t] * span
            for depth, key in enumerate(keys):
                uses[key].append(base + depth)
        for lst in uses.values():
            lst.sort(reverse=True)   # pop() gives the earliest
        self._uses = uses
        self._free: set[int] = set()
        self._heap: list[tuple[int, int, int]] = []   # (-priority, push number, key)
        self._stamp: dict[int, int] = {}
        self._tick = itertools.count()

    def _push(self, key: int) -> None:
        lst = self._uses.get(key)
        stamp = next(self._tick)
        self._stamp[key] = stamp
        heapq.heappush(self._heap, (-(lst[-1] if lst else self._never), stamp, key))

    def arrived(self, req: Request, now: float) -> None:
        # This call's uses are happening now: each of its blocks' next use moves on.
        uses, free = self._uses, self._free
        hashes = req.hashes
        for key, lst in zip(hashes, map(uses.get, hashes), strict=True):   # look-ups in C: once per prompt block
            if lst:
                lst.pop()
                if key in free:
                    self._push(key)

    def reused(self, keys: Sequence[Any], now: float) -> None:   # the engine's keys: ints
        for k in keys:
            self._free.discard(k)

    def freed(self, keys: Sequence[Any], now: float) -> None:
        # `_push` inlined: this runs once per block of every finished call.
        self._free.update(keys)
        uses, stamps, tick, heap, push = self._uses, self._stamp, self._tick, self._heap, heapq.heappush
        never = self._never
        for k, lst in zip(keys, map(uses.get, keys), strict=True):
            stamps[k] = stamp = next(tick)
            push(heap, (-(lst[-1] if lst else never), stamp, k))

    def evict(self, n: int, now: float) -> list[Hashable]:
        out: list[Hashable] = []
        heap = self._heap
        while heap and len(out) < n:
            _, stamp, key = heapq.heappop(heap)
            if key in self._free and self._stamp.get(key) == stamp:
                self._free.discard(key)
                del self._stamp[key]
                out.append(key)
        return out
