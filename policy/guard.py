"""Keeps the learned order honest: is it beating LRU on this traffic, right now?

A shadow LRU cache is simulated on a spatial sample of the blocks (SHARDS, Waldspurger et al.,
FAST 2015): blocks whose key falls in a fixed 1/`SAMPLE` slice of the hash space. Requests replay
into it in the order they reach the real cache, with vLLM's semantics: a hit stops at the first
sampled block missing, a block is held (unevictable) from the request that uses it until it is
released, and free blocks leave in the order they were released. The shadow holds at most as many
sampled blocks as the real cache holds at that moment: a fixed size would be wrong by the blocks
that running requests' partial blocks and prefetches take, which come and go (sized by the cache's
nominal capacity, it was 0.4-2 points pessimistic about LRU on long conversations, enough to keep
trusting a model that lost to LRU), and equal occupancy also takes out the sampling noise in how
many sampled blocks the real cache happens to hold. Held to LRU's order, the real cache and its
shadow then hold the same sampled blocks.
Over windows of sampled accesses (2048, or 256 requests' worth), the real cache's hits on the same
sampled blocks (those within the prefix it really hit) are compared with the shadow's: that
difference is CacheScout's measured gain over plain LRU. Where attention's cost is priced
(`per_depth`), each sampled block weighs what recomputing it costs at its position in the prompt,
and where a lower tier holds a copy of it (LMCache's CPU tier, as the connector or the replay
reports it: `backed`), no more than loading it: the comparison is of seconds saved, the measure
the scorer weighs its order by (a model that lets copied blocks go to keep the ones nowhere else
trades hits for time, and counted by hits it would look worse than LRU). The lower tier is filled
the same whatever the GPU's order keeps (LMCache stores every prompt), so a block's weight is the
same for both orders.

A sampled shadow is an estimate, and on traffic whose prompts are a few long conversations (every
request hits or misses hundreds of sampled blocks together) a noisy one; where requests have few
blocks it samples more densely (`resample`). The windows spent on plain LRU are its control: there
the real cache follows LRU's order, so the spread of what the shadow makes of them says how far a
trusted window may fall below LRU by chance. (Their mean is kept as `bias`, for inspection only: it
also holds what the model's order left behind in the cache.)

Trust scales every confidence the scorer uses: 1 (use the model) or 0 (plain LRU). A trusted window
far below LRU (beyond four times the shadow's spread), or trusted windows whose recent mean is
below LRU by more than twice its standard error, drop it to 0; the model is tried again after 1, 2,
4, ... up to 64 windows (doubling after each failed try, halving back once trusted windows are
clearly above LRU), so a
model that recovers, or a workload that turns predictable, is used again, while a model that keeps
losing costs only a few probe windows. This bounds what a wrong model can cost, whatever the cause:
sessions that could not be inferred, a workflow that changed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Final

SAMPLE: Final = 8          # by default one block in 8 is simulated
_WINDOW: Final = 2048             # sampled accesses per comparison (about 150 requests) ...
_WINDOW_REQUESTS: Final = 8       # ... from at least this many requests; or, where requests have
_WINDOW_MAX_REQUESTS: Final = 256  # few blocks (large ones), this many requests ...
_WINDOW_MIN: Final = 256          # ... with at least this many sampled accesses
_PRIOR_SPREAD: Final = 0.02       # the shadow's error per window (share of accesses) before it is measured
_MIN_CONTROL: Final = 4           # windows on plain LRU before their bias and spread are used
_CONTROL_EMA: Final = 0.05        # ... averaged over about this many windows' worth (1 / it)
_FAR_WORSE: Final = 4.0           # a trusted window this many spreads below LRU cuts trust at once
_MEAN_EMA: Final = 0.1            # trusted windows' recent mean, over about 1 / this many
_SIGNIFICANT: Final = 2.0         # standard errors below LRU at which that mean cuts trust
_PROVEN: Final = 4                # trusted windows, clearly above LRU, before the backoff halves
_MAX_BACKOFF: Final = 64          # most windows spent on plain LRU before the model is tried again
_BLOCKS_PER_SAMPLED_REQUEST: Final = 12   # `resample`: sampled blocks wanted per request at least
_MAX_BACKED: Final = 1 << 20      # blocks with a lower tier's copy followed at most (more: recomputed)


_RELEASE_BITS: Final = 40
_RELEASE_MASK: Final = (1 << _RELEASE_BITS) - 1


def _wanted_number(request: int, released: int) -> int:
    """Order of a free block queued request `request` wants: later requests first, then release order."""
    return released - (request << _RELEASE_BITS)


class _FreeOrder:
    """Sampled free blocks in release order, LRU first: a dict of each one's release number and a
    heap of (number, key) whose stale entries are skipped, so a block can leave from anywhere and
    come back to its own place (a queued request's blocks do, see `wanted`)."""

    __slots__ = ("order", "heap")

    def __init__(self) -> None:
        self.order: dict[Hashable, int] = {}
        self.heap: list[tuple[int, Hashable]] = []

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.order

    def __iter__(self) -> Iterator[Hashable]:
        return iter(sorted(self.order, key=self.order.__getitem__))

    def add(self, key: Hashable, number: int) -> None:
        self.order[key] = number
        heap = self.heap
        heapq.heappush(heap, (number, key))
        if len(heap) > 2 * len(self.order) + 64:   # mostly stale: rebuild
            self.heap = heap = [(n, k) for k, n in self.order.items()]
            heapq.heapify(heap)

    def take(self, key: Hashable) -> int | None:
        """Remove `key`; its number, or None if it was not here."""
        return self.order.pop(key, None)

    def pop_oldest(self) -> Hashable:
        order, heap = self.order, self.heap
        while True:
            number, key = heapq.heappop(heap)
            if order.get(key) == number:
                del order[key]
                return key

    def clear(self) -> None:
        self.order.clear()
        self.heap.clear()


class LruGuard:
    def __init__(self, sample: int = SAMPLE, per_depth: float = 0.0, backed_value: float = 1.0) -> None:
        self.sample = sample          # one block in `sample` (by key hash) is simulated
        # Hits are compared by what they save: a block at prompt position i weighs 1 + per_depth * i
        # (its recompute, where attention is priced: `RebuildCost.depth_factor`), else 1; a block a
        # lower tier holds a copy of weighs at most `backed_value` (its load: `RebuildCost.backed_value`).
        self.per_depth = per_depth
        self.backed_value = backed_value
        # Blocks a lower tier holds, on the GPU or not: every one until `resample` has settled the
        # sample (a block sampled then may have been stored long before), the sampled ones after.
        self._backed: set[Hashable] = set()
        self._resampled = False
        self._held: set[Hashable] = set()                  # sampled blocks in use: never evicted
        self._free = _FreeOrder()         # sampled free blocks, LRU first
        # Sampled blocks a queued request will hit (how many want each), and those of them that are
        # free, LRU first: evicted after every other free block, as the real cache does (core.py
        # `_want`), so the guard judges the model alone.
        self._wanted: dict[Hashable, list[int]] = {}   # sampled key -> queued requests that want it
        self._wanted_free = _FreeOrder()
        self._released = 0                # blocks released so far: their release numbers
        self._resident: set[Hashable] = set()   # sampled blocks the real cache holds: the shadow's size
        self.trust = 1.0
        self._ours = 0                # hits of the real cache on sampled accesses, this window
        self._lru = 0                 # hits of the shadow LRU, this window
        self._seen = 0                # sampled accesses, this window
        self._w_ours = self._w_lru = self._w_seen = 0.0   # ... the same, each weighed by its depth
        # Every comparison so far, counted as it is made (windows closed or not): the real cache's
        # hits and the shadow's among the sampled accesses compared.
        self.compared = 0
        self.compared_ours = 0
        self.compared_lru = 0
        self.cuts = 0                 # times trust was cut to 0
        self.trusted_windows = 0      # windows closed with the model trusted ...
        self.lru_windows = 0          # ... and on plain LRU
        self._requests = 0            # requests with a sampled access, this window
        self.windows: list[float] = []   # recent windows' (ours - lru) / accesses
        self._trusted_mean = 0.0         # recent mean of trusted windows' bias-corrected differences
        self._trusted_n = 0              # trusted windows since the model was last (re)tried
        self.bias = 0.0                  # mean difference in windows on plain LRU (not applied)
        self._spread2 = _PRIOR_SPREAD ** 2   # ... and the variance of that error
        self._control = 0                # windows on plain LRU seen
        self._backoff = 1                # windows to wait after the next failure
        self._wait = 0                   # windows left on plain LRU

    def resample(self, blocks_per_request: float) -> None:
        """Sample more densely where requests have few blocks (large blocks, short prompts), so a
        request gives the shadow a dozen sampled blocks or more (never sparser than it was); the
        shadow starts over."""
        rate = max(1, min(self.sample, int(blocks_per_request // _BLOCKS_PER_SAMPLED_REQUEST)))
        self._resampled = True
        self._backed = {k for k in self._backed if not hash(k) % rate}
        if rate != self.sample:
            self.sample = rate
            self._held.clear()
            self._free.clear()
            self._wanted.clear()
            self._wanted_free.clear()
            self._resident.clear()
            self._ours = self._lru = self._seen = self._requests = 0
            self._w_ours = self._w_lru = self._w_seen = 0.0

    def accessed(self, keys: Sequence[Hashable], num_cached: int, hittable: int | None = None) -> None:
        """A request's prompt blocks in order (now all in the real cache, held), and how many
        leading ones the real cache hit; only the first `hittable` (default all) are compared. A
        sampled block is the real cache's hit when it lies within that prefix (a block that is
        cached past a missing one is recomputed all the same); the shadow's, when it and every
        sampled block before it are in the shadow."""
        held, free, resident = self._held, self._free, self._resident
        prefix_lru = True
        sample = self.sample
        seen, ours, lru = self._seen, self._ours, self._lru
        compared = len(keys) if hittable is None else hittable
        per_depth = self.per_depth
        backed = self._backed
        for i in range(len(keys)):
            key = keys[i]
            if hash(key) % sample:
                continue
            was_free = free.take(key) is not None or self._wanted_free.take(key) is not None
            resident.add(key)
            if i < compared:
                prefix_lru = prefix_lru and (was_free or key in held)
                self._seen += 1
                self._lru += prefix_lru
                self._ours += i < num_cached
                w = 1.0 + per_depth * i
                if backed and key in backed and self.backed_value < w:
                    w = self.backed_value
                self._w_seen += w
                if prefix_lru:
                    self._w_lru += w
                if i < num_cached:
                    self._w_ours += w
            held.add(key)
        if self._seen > seen:
            self._requests += 1
            self.compared += self._seen - seen
            self.compared_ours += self._ours - ours
            self.compared_lru += self._lru - lru
        self._trim()
        if (self._seen >= _WINDOW and self._requests >= _WINDOW_REQUESTS) or (
                self._requests >= _WINDOW_MAX_REQUESTS and self._seen >= _WINDOW_MIN):
            self._close_window()

    def backed(self, key: Hashable, held: bool) -> None:
        """A lower tier gained (`held`) or lost its copy of a block, cached on the GPU or not: a
        miss on it costs a load rather than a recompute, for either order (the lower tier is
        filled the same whatever the GPU's order keeps)."""
        if self._resampled and hash(key) % self.sample:
            return
        if held:
            if len(self._backed) < _MAX_BACKED:
                self._backed.add(key)
        else:
            self._backed.discard(key)

    def filled(self, keys: Sequence[Hashable]) -> None:
        """Blocks a request computed while decoding (cached from now on)."""
        sample = self.sample
        for key in [k for k in keys if not hash(k) % sample]:
            self._free.take(key)
            self._wanted_free.take(key)
            self._held.add(key)
            self._resident.add(key)
        self._trim()

    def loaded(self, keys: Sequence[Hashable]) -> None:
        """Blocks the real cache gained without a request (a prefetch): room the shadow gets too."""
        sample = self.sample
        self._resident.update(k for k in keys if not hash(k) % sample)

    def evicted(self, keys: Sequence[Hashable]) -> None:
        """Blocks the real cache dropped."""
        resident = self._resident
        sample = self.sample
        for key in keys:
            if not hash(key) % sample:
                resident.discard(key)

    def released(self, keys: Sequence[Hashable]) -> None:
        """Blocks that became free, in free order: LRU's recency is the release."""
        held, free, wanted = self._held, self._free, self._wanted
        sample = self.sample
        for key in [k for k in keys if not hash(k) % sample]:
            if key in held:
                held.discard(key)
                self._released += 1
                wanters = wanted.get(key)
                if wanters is None:
                    free.add(key, self._released)
                else:
                    self._wanted_free.add(key, _wanted_number(wanters[0], self._released))

    def wanted(self, keys: Sequence[Hashable], request: int) -> None:
        """Queued request number `request` (numbers grow with arrival) will hit these cached
        blocks: keep them after every other free block, the latest request's first, as the real
        cache does (core.py `_want`)."""
        sample = self.sample
        for key in keys:
            if hash(key) % sample:
                continue
            wanters = self._wanted.get(key)
            if wanters is not None:
                wanters.append(request)
                continue
            self._wanted[key] = [request]
            number = self._free.take(key)
            if number is not None:
                self._wanted_free.add(key, _wanted_number(request, number))

    def unwanted(self, keys: Sequence[Hashable], request: int, refresh: bool) -> None:
        """Queued request `request` was admitted (`refresh`: those of its blocks it did not hit
        count as freed now, as in the real cache) or ended."""
        sample = self.sample
        wanted, wanted_free = self._wanted, self._wanted_free
        back: list[tuple[int, Hashable]] = []
        for key in keys:
            if hash(key) % sample:
                continue
            wanters = wanted.get(key)
            if wanters is None or request not in wanters:
                continue
            first = wanters[0] == request
            wanters.remove(request)
            number = wanted_free.take(key) if first or not wanters else None
            if wanters:
                if number is not None:
                    wanted_free.add(key, _wanted_number(wanters[0], number & _RELEASE_MASK))
                continue
            del wanted[key]
            if number is not None:
                back.append((number & _RELEASE_MASK, key))
        back.sort()
        for released, key in back:
            if refresh:
                self._released += 1
                released = self._released
            self._free.add(key, released)

    def _trim(self) -> None:
        cap = len(self._resident)
        free, wanted_free = self._free, self._wanted_free
        while free and len(free) + len(wanted_free) + len(self._held) > cap:
            free.pop_oldest()
        while wanted_free and len(wanted_free) + len(self._held) > cap:
            wanted_free.pop_oldest()

    def _close_window(self) -> None:
        delta = (self._w_ours - self._w_lru) / self._w_seen
        self.windows = (self.windows + [delta])[-64:]
        self._ours = self._lru = self._seen = self._requests = 0
        self._w_ours = self._w_lru = self._w_seen = 0.0
        if self.trust == 0.0:
            self.lru_windows += 1
            # The real cache follows LRU's order here: the difference is the shadow's own error,
            # and what the model's order left behind in the cache. Its spread says how far a
            # window may miss by chance; its mean is no correction (a model that did harm would
            # excuse itself by the harm it left).
            self._control += 1
            w = max(_CONTROL_EMA, 1.0 / self._control)
            err = delta - self.bias
            self.bias += w * err
            self._spread2 += w * (err * err - self._spread2)
            self._wait -= 1
            if self._wait <= 0:
                self.trust = 1.0          # try the model again
                self._trusted_mean, self._trusted_n = 0.0, 0
            return
        self.trusted_windows += 1
        measured = self._control >= _MIN_CONTROL
        d = delta
        spread = math.sqrt(self._spread2) if measured else _PRIOR_SPREAD
        self._trusted_n += 1
        n = self._trusted_n
        self._trusted_mean += max(_MEAN_EMA, 1.0 / n) * (d - self._trusted_mean)
        effective = min(n, 2.0 / _MEAN_EMA - 1.0)   # windows an EMA's mean carries
        error = spread / math.sqrt(effective)
        if d <= -_FAR_WORSE * spread or self._trusted_mean < -_SIGNIFICANT * error:
            self.trust = 0.0
            self.cuts += 1
            self._wait = self._backoff
            self._backoff = min(_MAX_BACKOFF, 2 * self._backoff)
        elif n >= _PROVEN and self._trusted_mean > _SIGNIFICANT * error:
            self._backoff = max(1, self._backoff // 2)   # clearly better than LRU: retries come sooner again

    def counters(self) -> dict[str, int]:
        """Cumulative counts for operators: sampled accesses compared, the real cache's hits on
        them and the shadow LRU's, and how the windows went. Over any interval, (hits - lru hits) /
        compared is the order's measured gain over LRU (with queued requests' blocks kept last) on
        the calls as they arrived."""
        return {"guard_compared": self.compared, "guard_hits": self.compared_ours, "guard_lru_hits": self.compared_lru,
                "guard_trusted_windows": self.trusted_windows, "guard_lru_windows": self.lru_windows,
                "guard_cuts": self.cuts}

    def estimated_gain(self) -> float | None:
        """Hit-rate gain over plain LRU measured so far (share of sampled block accesses)."""
        return measured_gain(self.counters())


def measured_gain(counts: Mapping[str, float]) -> float | None:
    """(hits - LRU's hits) / compared, of `LruGuard.counters()` or of their differences over an
    interval (vLLM's summed reports); None where nothing was compared."""
    compared = counts.get("guard_compared", 0)
    return (counts.get("guard_hits", 0) - counts.get("guard_lru_hits", 0)) / compared if compared else None
