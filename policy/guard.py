"""Keeps the learned order honest: is it beating LRU on this traffic, right now?

A shadow LRU cache is simulated on a spatial sample of the blocks (SHARDS, Waldspurger et al.,
FAST 2015): blocks whose key falls in a fixed 1/`SAMPLE` slice of the hash space, in a cache
1/`SAMPLE` the size. Requests replay into it in the order they reach the real cache, with vLLM's
semantics: a hit stops at the first sampled block missing, a block is held (unevictable) from the
request that uses it until it is released, and free blocks leave in the order they were released.
Over windows of sampled accesses, the real cache's hits on the same sampled blocks are compared with
the shadow's: that difference is CacheScout's measured gain over plain LRU.

Trust scales every confidence the scorer uses: 1 (use the model) or 0 (plain LRU). A window clearly
worse than the shadow, or trusted windows that are worse on average, drop it to 0; the model is
tried again after 1, 2, 4, ... up to 64 windows (doubling after each failed try, halving back after
a good window), so a model that recovers, or a workload that turns predictable, is used again,
while a model that keeps losing costs only a few probe windows. This bounds what a wrong model can
cost, whatever the cause: sessions that could not be inferred, a workflow that changed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Sequence
from typing import Final

SAMPLE: Final = 8          # by default one block in 8 is simulated
_WINDOW: Final = 2048             # sampled accesses per comparison (about 150 requests)
_WORSE: Final = -0.02             # a window this much below LRU (share of accesses) cuts trust
_WORSE_ON_AVERAGE: Final = -0.005  # trusted windows this much below LRU on average cut it too
_MAX_BACKOFF: Final = 64          # most windows spent on plain LRU before the model is tried again


class LruGuard:
    def __init__(self, sample: int = SAMPLE) -> None:
        self.sample = sample          # one block in `sample` (by key hash) is simulated
        self._held: set[Hashable] = set()                  # sampled blocks in use: never evicted
        self._free: OrderedDict[Hashable, None] = OrderedDict()  # sampled free blocks, LRU first
        self.capacity = 0             # real cache size in blocks (0: learn it from the index)
        self.trust = 1.0
        self._ours = 0                # hits of the real cache on sampled accesses, this window
        self._lru = 0                 # hits of the shadow LRU, this window
        self._seen = 0                # sampled accesses, this window
        self.total_ours = 0
        self.total_lru = 0
        self.total_seen = 0
        self.windows: list[float] = []   # recent windows' (ours - lru) / accesses
        self._trusted_avg = 0.0          # decayed mean of trusted windows' differences
        self._trusted_n = 0
        self._backoff = 1                # windows to wait after the next failure
        self._wait = 0                   # windows left on plain LRU

    def accessed(self, keys: Sequence[Hashable], cached: Container) -> None:
        """A request's prompt blocks in order, and what the real cache held when it arrived.
        Both caches are scored by the same rule: a sampled block hits if it and every sampled
        block before it are cached."""
        held, free = self._held, self._free
        prefix_lru = prefix_ours = True
        sample = self.sample
        for key in [k for k in keys if not hash(k) % sample]:
            was_free = free.pop(key, 0) is None
            prefix_lru = prefix_lru and (was_free or key in held)
            prefix_ours = prefix_ours and key in cached
            self._seen += 1
            self._lru += prefix_lru
            self._ours += prefix_ours
            held.add(key)
        self._trim()
        if self._seen >= _WINDOW:
            self._close_window()

    def filled(self, keys: Sequence[Hashable]) -> None:
        """Blocks a request computed while decoding (cached from now on)."""
        sample = self.sample
        for key in [k for k in keys if not hash(k) % sample]:
            self._free.pop(key, None)
            self._held.add(key)
        self._trim()

    def released(self, keys: Sequence[Hashable]) -> None:
        """Blocks that became free, in free order: LRU's recency is the release."""
        held, free = self._held, self._free
        sample = self.sample
        for key in [k for k in keys if not hash(k) % sample]:
            if key in held:
                held.discard(key)
                free[key] = None

    def _trim(self) -> None:
        cap = max(1, self.capacity // self.sample)
        free = self._free
        while free and len(free) + len(self._held) > cap:
            free.popitem(last=False)

    def _close_window(self) -> None:
        delta = (self._ours - self._lru) / self._seen
        self.windows = (self.windows + [delta])[-64:]
        self.total_ours += self._ours
        self.total_lru += self._lru
        self.total_seen += self._seen
        self._ours = self._lru = self._seen = 0
        if self.trust == 0.0:
            self._wait -= 1
            if self._wait <= 0:
                self.trust = 1.0          # try the model again
                self._trusted_avg, self._trusted_n = 0.0, 0
            return
        self._trusted_avg = 0.7 * self._trusted_avg + 0.3 * delta if self._trusted_n else delta
        self._trusted_n += 1
        if delta <= _WORSE or (self._trusted_n >= 3 and self._trusted_avg <= _WORSE_ON_AVERAGE):
            self.trust = 0.0
            self._wait = self._backoff
            self._backoff = min(_MAX_BACKOFF, 2 * self._backoff)
        elif delta > 0:
            self._backoff = max(1, self._backoff // 2)

    def estimated_gain(self) -> float | None:
        """Hit-rate gain over plain LRU measured so far (share of sampled block accesses)."""
        seen = self.total_seen + self._seen
        if seen == 0:
            return None
        return (self.total_ours + self._ours - self.total_lru - self._lru) / seen
