"""LRU told one thing about the future: what part of Belady's gain each kind of foresight is worth.

Reference policies, like `belady`, not bounds: they read the workload's future calls. Each keeps
vLLM's LRU order, except that free blocks of one kind leave first (in LRU order among themselves);
like `lru`, they run without LMCache's tiers:

- `lru-knows-dead`: blocks no later call's prompt uses (a conversation's last context, the blocks an
  edited or compacted conversation leaves behind). LRU plus perfect knowledge of which blocks are
  dead: what an online policy could gain by telling dead blocks from idle ones.
- `lru-knows-ends`: blocks of sessions that have all issued their last call (a conversation that
  is over). The share of the above that is knowing when a conversation ends.

Where Belady stays far above both, its gain is in ordering blocks that are all used again, that is,
in knowing *when* each idle conversation returns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from .replay import LRUPolicy, Request, call_keys
from .workloads import Session


class ForesightLRU(LRUPolicy):
    """LRU with the blocks `_first` names evicted before all others."""

    label = "lru-knows"

    def __init__(self, sessions: Sequence[Session], block_size: int) -> None:
        super().__init__()
        # Set here, not as a class attribute: the compiled LRUPolicy sets `name` on each instance.
        self.name = self.label
        self.first: OrderedDict[Hashable, None] = OrderedDict()   # free blocks that go first, LRU order
        self.uses: dict[Hashable, int] = {}      # key -> prompts not yet admitted that use it
        self.users: dict[Hashable, int] = {}     # key -> sessions using it that have a call left
        self.keys_of: dict[Hashable, set[Hashable]] = {}
        for s in sessions:
            mine: set[Hashable] = set()
            for call in s.calls:
                keys = call_keys(call, block_size)
                for k in keys:
                    self.uses[k] = self.uses.get(k, 0) + 1
                mine.update(keys)
            self.keys_of[s.session_id] = mine
            for k in mine:
                self.users[k] = self.users.get(k, 0) + 1
        self._admitted: set[tuple[Hashable, int]] = set()
        self._freed_at: dict[Hashable, int] = {}   # free key -> its place in free order
        self._frees = 0

    def _first(self, key: Hashable) -> bool:
        raise NotImplementedError

    def _recheck(self, keys) -> None:
        """Free blocks among `keys` that now go first join the front queue, in the order they were
        freed (behind those already there)."""
        free, first = self.free, self.first
        for k in sorted((k for k in keys if k in free and self._first(k)), key=self._freed_at.__getitem__):
            del free[k]
            first[k] = None

    def admitted(self, req: Request, keys: Sequence[Hashable], num_cached: int, now: float) -> None:
        call = (req.session.session_id, req.index)
        if call in self._admitted:   # admitted again after a preemption: its uses are past already
            return
        self._admitted.add(call)
        uses = self.uses
        for k in req.hashes:
            uses[k] = uses.get(k, 0) - 1
        self._recheck(req.hashes)
        if req.index == len(req.session.calls) - 1:
            mine = self.keys_of.get(req.session.session_id, ())
            for k in mine:
                self.users[k] -= 1
            self._recheck(mine)

    def reused(self, keys: Sequence[Hashable], now: float) -> None:
        free, first = self.free, self.first
        at = self._freed_at
        for k in keys:
            if k in first:
                del first[k]
            else:
                del free[k]
            del at[k]

    def freed(self, keys: Sequence[Hashable], now: float) -> None:
        free, first, at = self.free, self.first, self._freed_at
        for k in keys:
            self._frees += 1
            at[k] = self._frees
            if self._first(k):
                first[k] = None
            else:
                free[k] = None

    def evict(self, n: int, now: float) -> list[Hashable]:
        out: list[Hashable] = []
        for queue in (self.first, self.free):
            while queue and len(out) < n:
                out.append(queue.popitem(last=False)[0])
        for k in out:
            del self._freed_at[k]
        return out


class KnowsDeadLRU(ForesightLRU):
    label = "lru-knows-dead"

    def _first(self, key: Hashable) -> bool:
        return self.uses.get(key, 0) <= 0


class KnowsEndsLRU(ForesightLRU):
    label = "lru-knows-ends"

    def _first(self, key: Hashable) -> bool:
        return self.users.get(key, 0) <= 0
