"""What LMCache's tiers hold, as LMCache 0.5.6 fills them, block by block (no KV, no LMCache import).

- A tier is LRU (`TierStore`). Beside CacheScout the CPU tier also holds a queued request's
  prefix from its arrival to its admission (`TierStore.hold_prefix`), where LMCache pins what its
  lookup finds only from that lookup on; in vLLM CacheScout's connector does it in LMCache's own
  tier (`QueuedHolds`, lmcache_tier.py), by the same rule.
- A call's lookup (vLLM's scheduler asks LMCache once per request) matches the prefix the tiers hold
  from the prompt's first block, the CPU tier's run first and Redis's after it: a block past a
  missing one is never a hit. It refreshes every block of the CPU run, those vLLM holds on the GPU
  too, first block newest (`lmcache_lookup`).
- The prompt is stored from where that hit ended; a block a tier already holds keeps its place.
  What decode fills is not stored (LMCache's `save_decode_cache` is off by default): the next call's
  prompt carries it.

The benchmark's tiers follow these rules (bench/replay.py, bench/tier_connector.py), and in vLLM the
scheduler side keeps a `CpuTierModel` of LMCache's CPU tier, so that the policy core knows which
cached GPU blocks have a CPU copy (cheaper to lose: a load instead of a recompute). Each rule is
checked against LMCache's own engine in tests/test_lmcache_tier.py.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any


HOLD_SHARE = 0.5   # at most this share of a tier is held for queued requests (`TierStore.hold_prefix`)


def lmcache_configs(request: Any) -> dict[str, Any]:
    """A vLLM request's LMCache request configs (`lmcache.*` keys of its `kv_transfer_params`):
    its tags are part of LMCache's chunk keys, so whatever looks its chunks up on a worker needs them."""
    params = getattr(request, "kv_transfer_params", None) or {}
    return {k: v for k, v in params.items() if isinstance(k, str) and k.startswith("lmcache.")}


class TierStore:
    """A lower tier (LMCache's CPU memory, or Redis): LRU over block keys, less the blocks held for
    queued requests (`hold_prefix`), which are evicted only after every other block."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.keys: OrderedDict[Hashable, None] = OrderedDict()   # vLLM's keys are bytes, the replay's ints
        self.held: dict[Hashable, int] = {}   # block -> how many queued requests hold it
        self.hold_limit = int(HOLD_SHARE * capacity)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.keys

    def put(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """Store (or refresh) blocks; returns the blocks evicted to make room: the oldest ones not
        held (held ones keep their place)."""
        store = self.keys
        for k in keys:
            store[k] = None
            store.move_to_end(k)
        dropped: list[Hashable] = []
        skipped: list[Hashable] = []
        held = self.held
        while len(store) + len(skipped) > self.capacity:
            k = store.popitem(last=False)[0]
            if k in held and store:
                skipped.append(k)
            else:   # (nothing but held blocks left: the oldest of them goes)
                dropped.append(k)
        for k in reversed(skipped):   # back at the old end, in their order
            store[k] = None
            store.move_to_end(k, last=False)
        return dropped

    def hold_prefix(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """Hold the run of `keys` the tier has from the first (what a lookup would hit) until
        `release`, as far as the hold limit allows; returns the keys held. LMCache pins what its
        lookup finds until the load; this pins it from the moment a request is queued, so that
        the prompts stored while it waits do not push out what it will load."""
        held = self.held
        room = self.hold_room()
        out: list[Hashable] = []
        store = self.keys
        for k in keys:
            if k not in store:
                break
            n = held.get(k, 0)
            if n == 0:
                if room <= 0:
                    break
                room -= 1
            held[k] = n + 1
            out.append(k)
        return out

    def hold_room(self) -> int:
        """How many more blocks `hold_prefix` may hold."""
        return self.hold_limit - len(self.held)

    def release(self, keys: Sequence[Hashable]) -> None:
        """Undo a `hold_prefix`."""
        held = self.held
        for k in keys:
            n = held[k] - 1
            if n:
                held[k] = n
            else:
                del held[k]

    def touch(self, keys: Sequence[Hashable]) -> None:
        """Refresh held blocks as LMCache's lookup does: last to first, so the first ends newest."""
        store = self.keys
        for k in reversed(keys):
            store.move_to_end(k)


def lmcache_lookup(keys: Sequence[Hashable], cpu: TierStore | None, redis: TierStore | None,
                   touch: bool = True) -> tuple[int, int]:
    """LMCache's lookup of a prompt's blocks: the longest prefix its tiers hold, the CPU tier's run
    first and Redis's after it. Returns where the CPU run ends and where the Redis run after it
    ends. With `touch` (LMCache's first lookup of a request) it refreshes every block of the CPU
    run, those vLLM holds in GPU memory too: a context in use keeps its CPU copy."""
    n = len(keys)
    cpu_end = 0
    if cpu is not None:
        while cpu_end < n and keys[cpu_end] in cpu:
            cpu_end += 1
        if touch:
            cpu.touch(keys[:cpu_end])
    redis_end = cpu_end
    if redis is not None:
        while redis_end < n and keys[redis_end] in redis:
            redis_end += 1
    return cpu_end, redis_end


def lmcache_store(keys: Sequence[Hashable], start: int, cpu: TierStore | None,
                  redis: TierStore | None) -> tuple[list[Hashable], list[Hashable]]:
    """LMCache's store of a prompt's blocks from `start` (where its lookup's hit ended): those the
    first tier does not hold go into every tier; a held block keeps its place. Returns the blocks
    stored and those the CPU tier dropped to make room."""
    holder = cpu if cpu is not None else redis
    if holder is None:
        return [], []
    new = [k for k in keys[start:] if k not in holder]
    if not new:
        return new, []
    dropped = cpu.put(new) if cpu is not None else []
    if redis is not None:
        redis.put(new)
    return new, dropped


class CpuTierModel:
    """LMCache's CPU tier as the scheduler can follow it: each admitted prompt looked up and stored
    by the rules above, at the tier's capacity in GPU blocks, with queued requests' prefixes held
    from the step that left them waiting to their admission as the connector's workers hold them
    (`hold`, `release`). `backed(key, held)` hears every block that gains or loses its CPU copy.

    A model, not LMCache's state: LMCache stores whole chunks (`chunk_size` tokens), drops a store
    it has no room for, and under CacheScout's CPU-tier policy evicts the least likely agent among
    its oldest chunks rather than strictly the oldest. It only tells the GPU order which blocks a
    miss would most likely load instead of recompute."""

    def __init__(self, capacity_blocks: int, backed: Callable[[Hashable, bool], None], holds: bool = False) -> None:
        """`holds`: the connector holds queued requests' prefixes in the tier (`hold_queued`)."""
        self.tier = TierStore("cpu", capacity_blocks)
        self.backed = backed
        self.holds = holds
        self._held: dict[str, list[Hashable]] = {}          # queued request -> the blocks held for it
        self._short: dict[str, Sequence[Hashable]] = {}     # those the limit cut short -> prompt keys

    def hold(self, request_id: str, prompt_keys: Sequence[Hashable]) -> None:
        """A request was left waiting: its prefix is held as the workers hold it (`QueuedHolds`)."""
        if self.holds and request_id not in self._held:
            self._hold(request_id, prompt_keys)

    def _hold(self, request_id: str, prompt_keys: Sequence[Hashable]) -> None:
        tier = self.tier
        held = self._held[request_id] = tier.hold_prefix(prompt_keys)
        if len(held) < len(prompt_keys) and prompt_keys[len(held)] in tier:
            self._short[request_id] = prompt_keys   # (an existing entry keeps its place)
        else:
            self._short.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """The request was admitted or ended: its hold goes, and those the limit cut short are
        held again, in arrival order, as far as the room it left goes (blocks already held for
        another request cost none)."""
        self._short.pop(request_id, None)
        held = self._held.pop(request_id, None)
        if not held:
            return
        tier = self.tier
        tier.release(held)
        for rid, keys in list(self._short.items()):
            tier.release(self._held[rid])
            self._hold(rid, keys)

    def admitted(self, prompt_keys: Sequence[Hashable], filed_from: int = 0) -> None:
        """A request was scheduled: LMCache looked its prompt's full blocks up and stores the rest.
        The GPU cache filed the blocks from `filed_from` on just now (the others it held, and heard
        of their copies as they changed): those the tier holds, and the ones stored, are told."""
        tier = self.tier
        hit, _ = lmcache_lookup(prompt_keys, tier, None)
        _, dropped = lmcache_store(prompt_keys, hit, tier, None)
        backed = self.backed
        for k in prompt_keys[min(filed_from, hit):]:
            if k in tier:
                backed(k, True)
        for k in dropped:
            backed(k, False)
