"""`belady`: prefix-aware Belady that knows the future of a reference run. A strong reference
policy, not a bound (the bound is bound.py's).

It evicts the free block whose next use is farthest in the future. Future uses come from the calls
not yet issued, each placed at its arrival time in a reference run of the same workload with an
unbounded cache. A call uses its blocks when it is admitted, not when it arrives: while it waits,
its blocks are needed next. Chained hashes make a block's every use also a use of all blocks before
it, so a prefix is never needed later than what follows it; ties go to the deeper block, so it never
evicts a block whose successors stay cached. In a closed loop the calls arrive in the order the run's
own timing gives, which can differ from the reference run's wherever waits are as short as prefills:
there another policy can beat it (real agentic traces do that).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from typing import Final

from .replay import Engine, EngineConfig, LRUPolicy, ReplayPolicy, Request, call_keys
from .workloads import Session

_STAMP_BITS: Final = 32   # a heap entry's low bits: its push number
_STAMP_MASK: Final = (1 << _STAMP_BITS) - 1


class BeladyPolicy(ReplayPolicy):
    name = "belady"
    # The heap is rebuilt when the entries pushed since the last rebuild exceed four per free block
    # plus this many: rare enough that rebuilding costs little per push, while stale entries stay
    # a small multiple of the live ones.
    rebuild_slack = 65536

    def __init__(self, sessions: Sequence[Session], block_size: int) -> None:
        reference = Engine(EngineConfig(gpu_blocks=1 << 30, block_size=block_size), LRUPolicy()).run(sessions)
        arrival = {(r.session.session_id, r.index): r.issued_at for r in reference.requests}
        calls = [(arrival[(s.session_id, i)], call_keys(call, block_size))
                 for s in sessions for i, call in enumerate(s.calls)]
        # A use at time t of a block at depth d gets the priority rank(t) * span + d: farther uses
        # first, at equal times the deeper block first, in one integer.
        rank = {t: i for i, t in enumerate(sorted({t for t, _ in calls}))}
        span = max((len(keys) for _, keys in calls), default=0) + 1
        self._never = len(rank) * span   # no use left: before every block that has one
        # key -> priorities of its future uses, latest first; consumed (popped) as calls are admitted.
        uses: dict[Hashable, list[int]] = {}
        for t, keys in calls:
            base = rank[t] * span
            for depth, key in enumerate(keys):
                lst = uses.get(key)
                if lst is None:
                    lst = uses[key] = []
                lst.append(base + depth)
        for lst in uses.values():
            lst.sort(reverse=True)   # pop() gives the earliest
        self._uses = uses
        self._free: set[Hashable] = set()
        # A max-heap of free blocks by next use, as one integer per entry: (never - priority) in the
        # high bits, the push number in the low ones (equal priorities: the earlier push first). A
        # block's entry is its latest push (`_stamp`); older ones are skipped when they come up, and
        # the heap is rebuilt when they pile up (`rebuild_slack`).
        self._heap: list[int] = []
        self._pushed: list[Hashable] = []   # push number -> key
        self._stamp: dict[Hashable, int] = {}   # key -> its latest push number (a free key: its live entry)

    def _push(self, key: Hashable) -> None:
        lst = self._uses.get(key)
        stamp = self._stamp[key] = len(self._pushed)
        self._pushed.append(key)
        heapq.heappush(self._heap, (self._never - (lst[-1] if lst else self._never)) << _STAMP_BITS | stamp)

    def admitted(self, req: Request, keys: Sequence[Hashable], num_cached: int, now: float) -> None:
        # This call's uses happen now (not at its arrival: while it waits, its blocks' next use is
        # this call): each block's next use moves on. Its hits were taken out of the free blocks
        # just before; a block it recomputes past its hit may still be free. A call admitted again
        # after a preemption used its blocks already.
        if req.tag is not None:
            return
        req.tag = True
        uses, free = self._uses, self._free
        hashes = req.hashes
        for key, lst in zip(hashes, map(uses.get, hashes), strict=True):   # look-ups in C: once per prompt block
            if lst:
                lst.pop()
                if key in free:
                    self._push(key)

    def reused(self, keys: Sequence[Hashable], now: float) -> None:
        free = self._free
        for k in keys:
            free.discard(k)

    def freed(self, keys: Sequence[Hashable], now: float) -> None:
        self._free.update(keys)
        for k in keys:
            self._push(k)
        if len(self._pushed) > 4 * len(self._free) + self.rebuild_slack:
            self._rebuild()

    def _rebuild(self) -> None:
        """Only the free blocks' latest entries, renumbered in their order."""
        stamp, uses, never = self._stamp, self._uses, self._never
        live = sorted(self._free, key=stamp.__getitem__)
        self._pushed = live
        self._stamp = {k: i for i, k in enumerate(live)}
        heap = []
        for i, k in enumerate(live):
            lst = uses.get(k)
            heap.append((never - (lst[-1] if lst else never)) << _STAMP_BITS | i)
        heapq.heapify(heap)
        self._heap = heap

    def evict(self, n: int, now: float) -> list[Hashable]:
        out: list[Hashable] = []
        heap, free, stamps, pushed = self._heap, self._free, self._stamp, self._pushed
        while heap and len(out) < n:
            stamp = heapq.heappop(heap) & _STAMP_MASK
            key = pushed[stamp]
            if key in free and stamps[key] == stamp:
                free.discard(key)
                del stamps[key]
                out.append(key)
        return out
