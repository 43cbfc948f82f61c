"""The bound on a run's GPU-tier hit rate: Belady over the run's own events.

A replay's eviction choices change its timing (a miss costs a prefill, and a closed loop waits for
it), so calls do not arrive in the same order under every policy, and a Belady oracle run alongside
them is no bound for any of them. This one is computed after a run, from its event log
(`Engine.record`): the calls as that run admitted them, each with its prompt's block keys, the
blocks decode opened and filled, the releases (finishes and preemptions) and the blocks prefetched
into the cache. Over that fixed sequence it evicts, whenever room is needed, the free block whose
next counted use is farthest (at equal uses the deeper block, so what it keeps is always a prefix).

Why it bounds the run: its cache needs no more room than the run's at any event (a block the run
recomputed beside a cached copy of the same content takes a slot there, not here), so it could
have kept exactly the run's cached blocks and hit what the run hit; Belady's choice hits at least
as many blocks as any other (on a fixed sequence, with the same blocks in use at the same times),
and with its prefix-closed cache every block it holds is a prefix hit. Counted as the engine
counts: a call's first admission only, blocks before its last prompt token's.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from typing import Final

from .replay import EV_ADMIT, EV_FILL, EV_OPEN, EV_PREFETCH, EV_RELEASE

_NEVER: Final = 1 << 62     # next use of a block no counted admission uses again


def belady_hits(log: Sequence[tuple], gpu_blocks: int, block_size: int) -> int:
    """Prompt tokens the best eviction order would have hit on the GPU tier over `log`."""
    # Next counted use of each key: admission number x depth-span + depth, so that farther uses
    # and, at the same use, deeper blocks compare larger.
    span = 1 + max((len(ev[2]) for ev in log if ev[0] == EV_ADMIT), default=0)
    uses: dict[Hashable, list[int]] = {}
    number = 0
    for ev in log:
        if ev[0] == EV_ADMIT:
            if ev[4]:
                base = number * span
                for depth, key in enumerate(ev[2][:ev[3]]):
                    lst = uses.get(key)
                    if lst is None:
                        lst = uses[key] = []
                    lst.append(base + depth)
            number += 1
    for lst in uses.values():
        lst.reverse()                 # pop() gives the earliest

    ref: dict[Hashable, int] = {}     # cached key -> requests holding it
    free: dict[Hashable, int] = {}    # cached, unheld key -> its heap entry's stamp
    heap: list[tuple[int, int, Hashable]] = []   # (-next use, stamp, key): farthest first
    held: dict[int, dict[Hashable, None]] = {}   # request -> keys it holds (insertion-ordered)
    partial: dict[int, int] = {}                 # request -> slots of blocks not yet full
    used = 0                                     # slots: cached keys + partial blocks
    stamp = 0
    hits = 0
    number = 0

    def next_use(key: Hashable) -> int:
        lst = uses.get(key)
        return lst[-1] if lst else _NEVER

    def release(key: Hashable) -> None:
        nonlocal stamp
        c = ref[key] - 1
        ref[key] = c
        if c == 0:
            stamp += 1
            free[key] = stamp
            heapq.heappush(heap, (-next_use(key), stamp, key))

    def make_room(n: int) -> None:
        nonlocal used
        while used + n > gpu_blocks:
            if not heap:
                raise RuntimeError("the bound's cache overflowed: its event log holds more than the cache")
            _, st, key = heapq.heappop(heap)
            if free.get(key) == st:
                del free[key]
                del ref[key]
                used -= 1

    def hold(key: Hashable) -> None:
        nonlocal used
        c = ref.get(key)
        if c is None:
            make_room(1)
            ref[key] = 1
            used += 1
        else:
            if c == 0:
                del free[key]
            ref[key] = c + 1

    for ev in log:
        kind = ev[0]
        if kind == EV_ADMIT:
            _, rid, keys, limit, counted, tail = ev
            hit = 0
            while hit < limit and keys[hit] in ref:
                hit += 1
            if counted:
                hits += hit
                for key in keys[:limit]:      # these uses are now past
                    lst = uses.get(key)
                    if lst and lst[-1] // span == number:
                        lst.pop()
            # Room for what is missing, after pinning what is there (not to evict it).
            mine = dict.fromkeys(keys)
            for key in mine:
                if key in ref:
                    hold(key)
            missing = [k for k in mine if k not in ref]
            make_room(len(missing) + tail)
            for key in missing:
                ref[key] = 1
                used += 1
            used += tail
            held[rid] = mine
            partial[rid] = tail
            number += 1
        elif kind == EV_OPEN:
            make_room(1)
            used += 1
            partial[ev[1]] += 1
        elif kind == EV_FILL:
            rid, key = ev[1], ev[2]
            partial[rid] -= 1
            used -= 1             # the slot turns into the cached block (or is handed back)
            mine = held[rid]
            if key in mine:
                continue
            hold(key)
            mine[key] = None
        elif kind == EV_RELEASE:
            rid = ev[1]
            for key in held.pop(rid, ()):
                release(key)
            used -= partial.pop(rid, 0)
        elif kind == EV_PREFETCH:
            key = ev[1]
            if key not in ref:
                make_room(1)
                ref[key] = 0
                used += 1
                stamp += 1
                free[key] = stamp
                heapq.heappush(heap, (-next_use(key), stamp, key))
    return hits * block_size
