"""Which free cached block to evict next: per-group free lists ordered by a per-group score.

Blocks are grouped by what they hold (a shared preamble, an agent's anchor, one session's context
under one agent); every block of a group shares one survival score, so scoring costs O(groups), not
O(blocks). Inside a group, free blocks wait in an intrusive doubly-linked list in the order they
were freed (vLLM frees a request's blocks tail first, so a group loses its deepest blocks first).

The next victim is the head of the group with the highest eviction key,
    key = c * model + (1 - c) * log(age of the head + 1 ms),
where `model` is the log of the predicted time to next use (set by the scorer) and c in [0, 1] the
confidence in it. With c = 0 everywhere the key orders heads by age, ties by free order: exactly
vLLM's LRU free queue. Choosing victims reads state only; `evict` is the one call that mutates.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Iterator
from typing import Final

_AGE_FLOOR_S: Final = 1e-3
_HEAP_HORIZON_S: Final = 0.1   # `evict`'s heap keys serve as bounds this long (scorers rescore about as often)


def _key(g: Group, b: Block, now: float) -> float:
    """Block `b`'s eviction key at `now` (higher goes first). The loops that run once per block
    inline it."""
    c = g.conf
    age = math.log(max(now - b.freed_at, 0.0) + _AGE_FLOOR_S)
    return age if c <= 0.0 else c * g.model + (1.0 - c) * age


def _entry(g: Group, at: float, push: int) -> _Entry:
    """Heap entry of group `g`'s head, keyed at `at`."""
    b = g.head
    assert b is not None, "only groups with a free block have a head entry"
    return _Entry(-_key(g, b, at), b.seq, push, b, g, g.stamp)


class Block:
    """One cached block known to the index. Linked into its group's free list while free."""

    __slots__ = ("key", "group", "depth", "seq", "freed_at", "free", "backed", "spent", "prev", "next", "gprev",
                 "gnext")

    def __init__(self, key: Hashable, group: Group, depth: int = 0) -> None:
        self.key = key
        self.group = group
        self.depth = depth    # its position in the prompts that hold it (0 first; what recomputing it costs)
        self.seq = 0          # global free order: lower was freed earlier
        self.freed_at = 0.0
        self.free = False
        self.backed = False   # a copy lives in a lower tier (cheaper to bring back than recompute)
        self.spent = False    # its context's later call left it out (core.py `_spend`), not used since
        self.prev: Block | None = None   # within the group's free list
        self.next: Block | None = None
        self.gprev: Block | None = None  # within the global free order (what LRU would evict)
        self.gnext: Block | None = None


class Group:
    """Blocks that share one score. `model` and `conf` are written by the scorer."""

    __slots__ = ("gid", "kind", "agent", "session", "parent", "head", "tail", "n_free",
                 "n_backed_free", "n_blocks", "model", "conf", "stamp", "last_call", "last_prompt")

    def __init__(self, gid: Hashable, kind: str, agent: str | None = None, session: Hashable | None = None,
                 parent: Group | None = None) -> None:
        self.gid = gid
        self.kind = kind
        self.agent = agent
        self.session = session
        self.parent = parent
        self.head: Block | None = None  # oldest free block: evicted first within the group
        self.tail: Block | None = None
        self.n_free = 0
        self.n_backed_free = 0
        self.n_blocks = 0
        self.model = 0.0
        self.conf = 0.0
        self.stamp = 0
        # A context's latest call: its blocks (prompt, then output) and how many are prompt, to
        # tell which of them its next call leaves out (core.py `_spend`).
        self.last_call: list[Hashable] | None = None
        self.last_prompt = 0

    def free_blocks(self) -> Iterator[Block]:
        node = self.head
        while node is not None:
            yield node
            node = node.next

    def __repr__(self) -> str:
        return f"Group({self.gid!r}, {self.kind}, free={self.n_free}/{self.n_blocks})"


class _Entry:
    """A group head in a heap. The heap's top is the smallest (neg, seq, push): the key is negated
    (the farthest next use comes first), ties go to the block freed first, as in LRU, and the push
    number makes the order total. `stamp` is the group's when pushed (a later one makes it stale)."""

    __slots__ = ("neg", "seq", "push", "block", "group", "stamp")

    def __init__(self, neg: float, seq: int, push: int, block: Block, group: Group, stamp: int) -> None:
        self.neg = neg
        self.seq = seq
        self.push = push
        self.block = block
        self.group = group
        self.stamp = stamp


# A binary min-heap of entries on a list, as heapq's, with the comparison compiled in (heapq
# compares through Python's protocol, which cost more than the rest of a victim's choice).
def _before(a: _Entry, b: _Entry) -> bool:
    if a.neg != b.neg:
        return a.neg < b.neg
    if a.seq != b.seq:
        return a.seq < b.seq
    return a.push < b.push


def _heap_push(heap: list[_Entry], e: _Entry) -> None:
    heap.append(e)
    i = len(heap) - 1
    while i > 0:
        parent = (i - 1) >> 1
        p = heap[parent]
        if not _before(e, p):
            break
        heap[i] = p
        i = parent
    heap[i] = e


def _sift_down(heap: list[_Entry], i: int, e: _Entry) -> None:
    """Place `e` at `i` or below, moving smaller children up."""
    n = len(heap)
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _before(heap[c + 1], heap[c]):
            c += 1
        child = heap[c]
        if not _before(child, e):
            break
        heap[i] = child
        i = c
    heap[i] = e


def _heap_pop(heap: list[_Entry]) -> _Entry:
    last = heap.pop()
    if not heap:
        return last
    top = heap[0]
    _sift_down(heap, 0, last)
    return top


def _heapify(heap: list[_Entry]) -> None:
    for i in range(len(heap) // 2 - 1, -1, -1):
        _sift_down(heap, i, heap[i])


class EvictionIndex:
    """Free cached blocks of a KV cache tier, and the order to evict them in."""

    def __init__(self) -> None:
        self._blocks: dict[Hashable, Block] = {}
        self._groups: dict[Hashable, Group] = {}
        self._headed: dict[Group, None] = {}   # groups with a free block (insertion-ordered set)
        self._seq = 0
        self._last_freed_at = -math.inf
        self.n_free = 0
        self.default_group = self.group(("lru",), "other")
        # Blocks a context's later call left out (core.py `_spend`), where such blocks are seen to
        # be rarely used again; and the keys of spent blocks evicted since the policy last looked,
        # so that it can tell when one is computed again (used after all).
        self.spent_group = self.group(("spent",), "spent")
        self.spent_evicted: list[Hashable] = []
        # Heap of group heads for `evict`, valid for one set of scores and keyed at a time just
        # ahead (see `evict`); stale entries are skipped by stamp, so keeping it current costs one
        # push per head change.
        self._heap: list[_Entry] = []
        self._pushes = 0   # entries made (their tie-breaking push numbers)
        self._heap_until: float | None = None   # the time the heap's keys are taken at
        self._heap_epoch = -1
        self.epoch = 0  # bumped by `scores_changed()`
        # Bumped whenever a block joins the free order or the order is re-sorted; removing a block
        # leaves the others' order as it was (see `victims`).
        self.version = 0
        self._lru_head: Block | None = None  # global free order, oldest first (vLLM's free queue)
        self._lru_tail: Block | None = None

    # -- groups -------------------------------------------------------------------------------
    def group(self, gid: Hashable, kind: str, *, agent: str | None = None, session: Hashable | None = None,
              parent: Group | None = None) -> Group:
        """The group with this id, created on first use."""
        g = self._groups.get(gid)
        if g is None:
            g = self._groups[gid] = Group(gid, kind, agent, session, parent)
        elif parent is not None and g.parent is not parent and parent is not g:
            g.parent = parent
        return g

    def registered(self, g: Group) -> Group:
        """The group registered under `g`'s id now: `g` itself, registered again if it was pruned
        while it held no block (a caller kept it meanwhile), or the group that replaced it."""
        got = self._groups.get(g.gid)
        if got is None:
            got = self._groups[g.gid] = g
        return got

    def groups(self) -> Iterable[Group]:
        return self._groups.values()

    def free_groups(self) -> Iterable[Group]:
        """Groups holding at least one free block: the only ones a victim can come from."""
        return self._headed.keys()

    def get_group(self, gid: Hashable) -> Group | None:
        return self._groups.get(gid)

    def prune_groups(self) -> int:
        """Forget groups that hold no block (callers must fetch groups through `group` again)."""
        keep = (self.default_group, self.spent_group)
        empty = [gid for gid, g in self._groups.items() if g.n_blocks == 0 and g not in keep]
        for gid in empty:
            del self._groups[gid]
        return len(empty)

    # -- blocks -------------------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def block(self, key: Hashable) -> Block | None:
        return self._blocks.get(key)

    def add(self, key: Hashable, group: Group | None = None, depth: int = 0) -> Block:
        """Track a newly cached block (in use, not free) at prompt position `depth`. Re-adding
        moves it to `group` (and sets a depth that was not known)."""
        b = self._blocks.get(key)
        if b is None:
            g = group or self.default_group
            b = self._blocks[key] = Block(key, g, depth)
            g.n_blocks += 1
        else:
            if group is not None and b.group is not group:
                self.assign(b, group)
            if depth > b.depth:
                b.depth = depth
        return b

    def assign(self, b: Block, group: Group) -> None:
        """Move a block to another group, keeping its place in free order."""
        old = b.group
        if old is group:
            return
        was_free = b.free
        if was_free:
            self._unlink(b)
        old.n_blocks -= 1
        group.n_blocks += 1
        b.group = group
        if was_free:
            self._link_sorted(b)

    def release(self, keys: Iterable[Hashable], now: float) -> None:
        """Blocks whose last user finished: they join the tail of their group's free list."""
        # Free times never go back (a clock that does is held), so along every group's list blocks
        # were freed in order and their keys only fall: `victims` and `evict` rely on it.
        if now < self._last_freed_at:
            now = self._last_freed_at
        self._last_freed_at = now
        # `_append` and `_mark_free` inlined: this runs once per block of every finished request.
        blocks = self._blocks
        seq = self._seq
        freed = 0
        for key in keys:
            b = blocks.get(key)
            if b is None or b.free:
                continue
            seq += 1
            b.seq = seq
            b.freed_at = now
            g = b.group
            b.prev = tail = g.tail
            b.next = None
            g.tail = b
            b.free = True
            g.n_free += 1
            if b.backed:
                g.n_backed_free += 1
            if tail is None:
                g.head = b
                self._head_changed(g)
            else:
                tail.next = b
            b.gprev = lru_tail = self._lru_tail
            if lru_tail is None:
                self._lru_head = b
            else:
                lru_tail.gnext = b
            self._lru_tail = b
            freed += 1
        self._seq = seq
        if freed:
            self.n_free += freed
            self.version += freed

    def acquire(self, keys: Iterable[Hashable]) -> int:
        """Blocks reused by a request (a cache hit): no longer candidates for eviction. Returns how
        many of them were spent (used again after all: no longer spent)."""
        spent = 0
        for key in keys:
            b = self._blocks.get(key)
            if b is None:
                continue
            if b.spent:
                b.spent = False
                spent += 1
            if b.free:
                self._global_unlink(b)
                self._unlink(b)
        return spent

    def set_backed(self, key: Hashable, backed: bool) -> None:
        b = self._blocks.get(key)
        if b is None or b.backed == backed:
            return
        if b.free:
            b.group.n_backed_free += 1 if backed else -1
        b.backed = backed

    def discard(self, key: Hashable) -> None:
        """Forget a block that left the tier by other means."""
        b = self._blocks.pop(key, None)
        if b is None:
            return
        if b.free:
            self._global_unlink(b)
            self._unlink(b)
        b.group.n_blocks -= 1
        if b.spent:
            self.spent_evicted.append(key)

    def oldest_free_age(self, now: float) -> float:
        """How long the block freed first of those still free has been free (inf: none is)."""
        head = self._lru_head
        return math.inf if head is None else max(now - head.freed_at, 0.0)

    def lru_victims(self, n: int) -> list[Hashable]:
        """What plain LRU would evict next (the oldest free blocks). Changes nothing."""
        out: list[Hashable] = []
        b = self._lru_head
        while b is not None and len(out) < n:
            out.append(b.key)
            b = b.gnext
        return out

    # -- choosing and evicting ----------------------------------------------------------------
    def victims(self, n: int, now: float) -> list[Hashable]:
        """Keys of the next `n` free blocks to evict, best victim first. Changes nothing.
        Between two calls with the same `version` only time has passed: the order is the same up
        to the slow drift of blocks' ages (a cache may keep the answer until the version moves)."""
        if n <= 0 or self.n_free == 0:
            return []
        heap = [_entry(g, now, i) for i, g in enumerate(self._headed)]
        pushes = len(heap)
        _heapify(heap)
        out: list[Hashable] = []
        log = math.log
        while heap and len(out) < n:
            b = _heap_pop(heap).block
            out.append(b.key)
            # Take the group's next blocks for as long as they still beat every other group's head
            # (a whole group often goes before the next: one heap operation instead of one each).
            # The key is `_key`'s, inlined: this loop runs once per victim.
            g = b.group
            c = g.conf
            cm, w = c * g.model, 1.0 - c
            nxt = b.next
            top_key, top_seq = (heap[0].neg, heap[0].seq) if heap else (math.inf, 0)
            if nxt is not None:
                # Keys only fall along a group's list (see `release`): when its last block beats
                # the top, all of its blocks do.
                tail = g.tail
                assert tail is not None
                neg = -_key(g, tail, now)
                if neg < top_key or (neg == top_key and tail.seq < top_seq):
                    while nxt is not None and len(out) < n:
                        out.append(nxt.key)
                        nxt = nxt.next
                    continue
            while nxt is not None and len(out) < n:
                age = log(max(now - nxt.freed_at, 0.0) + _AGE_FLOOR_S)
                neg = -age if c <= 0.0 else -(cm + w * age)
                if neg > top_key or (neg == top_key and nxt.seq > top_seq):
                    pushes += 1
                    _heap_push(heap, _Entry(neg, nxt.seq, pushes, nxt, g, g.stamp))
                    break
                out.append(nxt.key)
                nxt = nxt.next
        return out

    def next_victim_group(self, now: float) -> Group | None:
        """The group the next victim would come from (None when nothing is free). O(free groups)."""
        best: Group | None = None
        best_key = -math.inf
        for g in self._headed:
            head = g.head
            assert head is not None
            key = _key(g, head, now)
            if best is None or key > best_key:
                best, best_key = g, key
        return best

    def head_key(self, g: Group, now: float) -> float | None:
        """The eviction key of group `g`'s next victim at `now` (None: it has no free block)."""
        return None if g.head is None else _key(g, g.head, now)

    def eviction_profile(self, now: float) -> tuple[list[float], list[int]]:
        """The free groups by the key of their next victim at `now`, first to go first, as
        (negated keys, ascending; free blocks of the groups up to and including each): for
        `bisect`, how many free blocks go before a given key. O(free groups log free groups)."""
        heads = sorted((-_key(g, g.head, now), g.n_free) for g in self._headed if g.head is not None)
        negated = [k for k, _ in heads]
        total = 0
        cumulative = []
        for _, n in heads:
            total += n
            cumulative.append(total)
        return negated, cumulative

    def evict(self, n: int, now: float) -> list[Hashable]:
        """Remove and return the next `n` victims (the same ones `victims` names).

        The heap is not rebuilt at every call: its keys are taken at a time `_heap_until` a little
        ahead, and a key only grows with time, so they bound from above the keys at any `now`
        before then. `_pop_best` computes exact keys only for the entries those bounds cannot rule
        out (mostly the heads freed last, whose keys move fastest), and the choice stays exact."""
        if self._heap_epoch != self.epoch or self._heap_until is None or now > self._heap_until:
            self._heap_epoch = self.epoch
            self._heap_until = until = now + _HEAP_HORIZON_S
            heap = self._heap = [_entry(g, until, self._pushes + i) for i, g in enumerate(self._headed)]
            self._pushes += len(heap)
            _heapify(heap)
        heap = self._heap
        out: list[Hashable] = []
        blocks = self._blocks
        log = math.log
        while len(out) < n:
            b = self._pop_best(now)
            if b is None:
                break
            # Take the group's blocks from its head for as long as they beat every other group's
            # bound, unlinking each: one heap operation per run, not per block.
            g = b.group
            c = g.conf
            cm, w = c * g.model, 1.0 - c
            while heap and heap[0].group.stamp != heap[0].stamp:
                _heap_pop(heap)   # stale: its group's head changed since
            top_key, top_seq = (heap[0].neg, heap[0].seq) if heap else (math.inf, 0)
            tail = g.tail
            assert tail is not None
            neg = -_key(g, tail, now)
            whole = neg < top_key or (neg == top_key and tail.seq < top_seq)   # as in `victims`
            taken = 0
            while True:
                out.append(b.key)
                del blocks[b.key]
                if b.spent:
                    self.spent_evicted.append(b.key)
                self._global_unlink(b)
                nxt = b.next
                b.next = None
                b.free = False
                if b.backed:
                    g.n_backed_free -= 1
                taken += 1
                if nxt is None or len(out) >= n:
                    break
                if not whole:
                    age = log(max(now - nxt.freed_at, 0.0) + _AGE_FLOOR_S)
                    neg = -age if c <= 0.0 else -(cm + w * age)
                    if neg > top_key or (neg == top_key and nxt.seq > top_seq):
                        break
                b = nxt
            g.head = nxt
            if nxt is None:
                g.tail = None
            else:
                nxt.prev = None
            g.n_free -= taken
            g.n_blocks -= taken
            self.n_free -= taken
            self._head_changed(g)
        return out

    def _pop_best(self, now: float) -> Block | None:
        """Pop the heap entry of the group whose head is the next victim at `now` (its exact key is
        the highest, ties to the block freed first); None when nothing is free."""
        heap = self._heap
        best: _Entry | None = None
        best_key = 0.0
        best_seq = 0
        passed: list[_Entry] = []
        while heap:
            top = heap[0]
            g = top.group
            if g.stamp != top.stamp:
                _heap_pop(heap)   # stale
                continue
            bound, seq = -top.neg, top.seq
            if best is not None and (bound < best_key or (bound == best_key and seq > best_seq)):
                break   # nothing left can beat the best
            _heap_pop(heap)
            key = _key(g, top.block, now)
            if best is None or key > best_key or (key == best_key and seq < best_seq):
                if best is not None:
                    passed.append(best)
                best, best_key, best_seq = top, key, seq
            else:
                passed.append(top)
        for entry in passed:
            _heap_push(heap, entry)
        return None if best is None else best.block

    def rescored(self, g: Group) -> None:
        """A scorer rewrote one group's `model`/`conf` (not all of them): re-key its head."""
        self.version += 1
        if g.head is not None:
            self._head_changed(g)

    def scores_changed(self) -> None:
        """The scorer rewrote `model`/`conf` of some groups: the next eviction re-sorts."""
        self.epoch += 1
        self.version += 1

    def _head_changed(self, g: Group) -> None:
        g.stamp += 1
        if g.head is None:
            self._headed.pop(g, None)
        else:
            self._headed[g] = None
        if self._heap_until is not None and g.head is not None:
            self._pushes += 1
            _heap_push(self._heap, _entry(g, self._heap_until, self._pushes))

    # -- linked-list plumbing (O(1), no allocation) --------------------------------------------
    def _link_sorted(self, b: Block) -> None:
        """Insert by free order (used when a free block changes group)."""
        g = b.group
        node = g.tail
        while node is not None and node.seq > b.seq:
            node = node.prev
        if node is None:
            b.prev = None
            b.next = g.head
            if g.head is not None:
                g.head.prev = b
            g.head = b
            if g.tail is None:
                g.tail = b
            self._mark_free(b, g)
            self._head_changed(g)
            return
        else:
            b.prev = node
            b.next = node.next
            if node.next is not None:
                node.next.prev = b
            else:
                g.tail = b
            node.next = b
        self._mark_free(b, g)

    def _mark_free(self, b: Block, g: Group) -> None:
        self.version += 1
        b.free = True
        g.n_free += 1
        if b.backed:
            g.n_backed_free += 1
        self.n_free += 1

    def _global_unlink(self, b: Block) -> None:
        if b.gprev is None:
            self._lru_head = b.gnext
        else:
            b.gprev.gnext = b.gnext
        if b.gnext is None:
            self._lru_tail = b.gprev
        else:
            b.gnext.gprev = b.gprev
        b.gprev = b.gnext = None

    def _unlink(self, b: Block) -> None:
        g = b.group
        prev, nxt = b.prev, b.next
        was_head = prev is None
        if prev is None:   # (not `was_head`: mypy narrows `prev` only on the test itself)
            g.head = nxt
        else:
            prev.next = nxt
        if nxt is None:
            g.tail = prev
        else:
            nxt.prev = prev
        b.prev = b.next = None
        b.free = False
        g.n_free -= 1
        if b.backed:
            g.n_backed_free -= 1
        self.n_free -= 1
        if was_head:
            self._head_changed(g)
