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

_NEVER = float("inf")


class OraclePolicy(ReplayPolicy):
    name = "oracle"

    def __init__(self, sessions: Sequence[Session], block_size: int) -> None:
        reference = Engine(EngineConfig(gpu_blocks=1 << 30, block_size=block_size), LRUPolicy()).run(sessions)
        arrival = {(r.session.session_id, r.index): r.issued_at for r in reference.requests}
        # key -> future uses as (time, depth), in time order; consumed as calls arrive.
        uses: dict[int, list[tuple[float, int]]] = defaultdict(list)
        for s in sessions:
            for i, call in enumerate(s.calls):
                t = arrival[(s.session_id, i)]
                for depth, key in enumerate(call_keys(call, block_size)):
                    uses[key].append((t, depth))
        for lst in uses.values():
            lst.sort()
            lst.reverse()            # pop() gives the earliest
        self._uses = uses
        self._free: set[int] = set()
        self._heap: list[tuple[float, int, int, int]] = []
        self._stamp: dict[int, int] = {}
        self._tick = itertools.count()

    def _next_use(self, key: int) -> tuple[float, int]:
        lst = self._uses.get(key)
        return lst[-1] if lst else (_NEVER, 1 << 30)

    def _push(self, key: int) -> None:
        t, depth = self._next_use(key)
        stamp = next(self._tick)
        self._stamp[key] = stamp
        # Farthest next use first; at equal times the deeper block first.
        heapq.heappush(self._heap, (-t, -depth, stamp, key))

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
        for k, lst in zip(keys, map(uses.get, keys), strict=True):
            t, depth = lst[-1] if lst else (_NEVER, 1 << 30)
            stamps[k] = stamp = next(tick)
            push(heap, (-t, -depth, stamp, k))

    def evict(self, n: int, now: float) -> list[Hashable]:
        out: list[Hashable] = []
        heap = self._heap
        while heap and len(out) < n:
            _, _, stamp, key = heapq.heappop(heap)
            if key in self._free and self._stamp.get(key) == stamp:
                self._free.discard(key)
                del self._stamp[key]
                out.append(key)
        return out
