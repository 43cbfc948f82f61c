"""Steer vLLM's GPU prefix-cache eviction by CacheScout's order, through the scheduler's BlockPool.

vLLM evicts cached blocks from the head of its free queue (`BlockPool.free_block_queue`, LRU
order). Once per scheduler step this module puts the policy's next victims right behind the
queue's run of empty blocks, so the next step's allocations evict what CacheScout ranks coldest
and leave likely-reused anchors in place. It never pins a block and never changes a reference
count: a block still leaves only when vLLM needs room, and vLLM's own bookkeeping stays exact.

The policy core keeps a mirror of the pool's cached blocks (its `EvictionIndex`). vLLM tells a
connector about requests, not blocks, so the mirror is kept by reading the pool, and is checked
against it before any block is moved:
- a request's blocks are filed when it is first allocated (`update_state_after_alloc`), and the
  blocks it fills later (chunked prefill, decode) when it finishes (`request_finished`, while
  vLLM still lists them): in use until then, they cannot be victims, and not scanning every
  running request each step for new blocks saves 8-9% of the steering's time;
- a finished request's blocks are released once vLLM has freed them (`request_finished` runs just
  before the free, so this happens at the next step), for those whose reference count is now 0;
- an eviction is noticed when a block that held a filed hash holds another one (or none), or
  when a placed victim has left the free queue; content vLLM computed into a second block is
  found again through the pool's hash map (`cached_block_hash_to_block`) instead.

How many victims to place: the blocks the next step can allocate (prompt blocks still to compute
of running requests, and of waiting ones past the prefix the mirror holds cached, a decayed peak of
what requests arriving between steps took, one per running decode about to open a block), times
`ahead_factor`, twice over so that a placement lasts a few steps. A placement stands while only
blocks were freed since, for up to one rescoring interval.

This module imports nothing from vLLM: it reads the pool's attributes (`free_block_queue`,
`cached_block_hash_to_block`, `KVCacheBlock.block_hash`/`ref_cnt`/`block_id`) and uses the queue's
own operations (`popleft_n`, `remove`, `prepend_n`).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Final

from cachescout.policy import CacheScoutPolicy, Hints, block_keys, output_ending

from .gpu_warmup import WARMUP_KEY
from .lmcache_model import CpuTierModel, lmcache_configs

_MAX_STALE_ROUNDS: Final = 4   # victim lists re-asked after dropping evicted blocks from the mirror
_ARRIVAL_DECAY: Final = 0.9    # per step, of the peak of blocks taken by requests arriving between steps
_PLACE_FACTOR: Final = 2       # victims placed per victim wanted: the list lasts a few steps
_block_id = operator.attrgetter("block_id")


@dataclasses.dataclass(slots=True)
class _Tracked:
    """A request the steering follows: its blocks, and how many of them are filed."""

    request: Any
    keys: list = dataclasses.field(default_factory=list)   # block keys of its full blocks so far
    filed: int = 0          # leading blocks whose (key -> block) is recorded
    prompt_blocks: int = 0  # full blocks of the prompt (the rest were filled by decode)
    local_hit_tokens: int = 0
    warmup: str | None = None   # a warm-up of this agent's anchor (gpu_warmup.py), not a call
    anchor_blocks: int = 0      # a call of an agent with a known anchor: that anchor's length
    warmed: bool = False        # ... and a warm-up of that anchor was sent since its agent's last call


class GpuSteering:
    """Mirror of the GPU prefix cache for the policy core, and the free-queue reordering."""

    def __init__(self, policy: CacheScoutPolicy, *, ahead_blocks: int = 16, ahead_factor: float = 1.5,
                 budget_tokens: int = 8192, max_seqs: int = 256, steer: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`budget_tokens`: vLLM's max_num_batched_tokens (what one step may compute); `max_seqs`:
        its max_num_seqs (how many requests may run); `steer`: False observes, learns and reports
        but leaves vLLM's order alone."""
        self.policy = policy
        self.steer = steer
        self.ahead_blocks = ahead_blocks
        self.ahead_factor = ahead_factor
        self.budget_tokens = budget_tokens
        self.max_seqs = max_seqs
        self._arrival_blocks = 0.0                           # decayed peak of blocks arrivals took in a step
        self.clock = clock
        self.pool: Any = None
        self._cached: Any = None
        self.req_blocks: Callable[[str], Sequence[Any]] = lambda rid: ()
        self._where: dict[Hashable, tuple[Any, Any]] = {}   # key -> (block, its block_hash when filed)
        self._key_at: dict[int, Hashable] = {}               # block_id -> key filed there
        self._new: list[Any] = []                            # requests that arrived this step
        self._allocated: dict[str, _Tracked] = {}            # first allocation this step
        self._running: dict[str, _Tracked] = {}
        self._finished: list[Any] = []                       # requests that ended since the last step
        self._hit_tokens: dict[str, int] = {}
        self._keys: dict[str, list] = {}                     # block keys of requests not yet allocated (FCFS)
        self._placed: list[Any] = []              # the victims last put at the head, in order
        self._placed_at: dict[int, int] = {}      # their block_id -> position
        self._placed_version = -1                 # the policy index's version when placed
        self._placed_epoch = -1                   # ... its scoring epoch
        self._placed_time = float("-inf")
        self.refresh_s: float | None = policy.cfg.rescore_interval_s   # None: re-place on any change
        self.stats: Counter[str] = Counter()
        # agent -> (its anchor's token ids, the LMCache request configs its prompts carried)
        self.anchors: dict[str, tuple[list[int], dict]] = {}
        self.anchor_keys: dict[str, list] = {}               # agent -> its anchor's block keys
        self.warmed: set[str] = set()     # agents warmed up since their last call (scheduler_side.py)
        self._warmups: dict[str, str] = {}                   # request id -> agent, of warm-ups not yet allocated
        self._anchor_of: dict[str, tuple[int, bool]] = {}    # request id -> (anchor blocks, warmed), until allocated
        self._decode_only = False   # at the last step: nothing waited, no prompt left to compute
        self.cpu_tier: CpuTierModel | None = None   # LMCache's CPU tier beside us, as far as we can follow it

    # -- binding ----------------------------------------------------------------------------------
    def bind(self, pool: Any, req_blocks: Callable[[str], Sequence[Any]]) -> None:
        """`pool`: vLLM's BlockPool; `req_blocks(request_id)`: the request's blocks of group 0."""
        self.pool = pool
        self.req_blocks = req_blocks
        self._cached = getattr(pool, "cached_block_hash_to_block", None)   # hash -> block(s), vLLM's

    # -- events, O(1) each but `finished`: the work happens once per step in `step` ------------------
    def arrived(self, request: Any) -> None:
        self._new.append(request)

    def matched(self, request_id: str, local_hit_tokens: int) -> None:
        """vLLM's local prefix hit for a request about to be allocated (may be called repeatedly)."""
        self._hit_tokens[request_id] = local_hit_tokens

    def allocated(self, request: Any) -> None:
        rid = request.request_id
        t = self._running.get(rid)
        if t is not None:   # preempted, now allocated again: its blocks are new, file them afresh
            t.filed = 0
            return
        if rid in self._allocated:
            return
        self._allocated[rid] = _Tracked(request, local_hit_tokens=self._hit_tokens.pop(rid, 0))
        self.stats["allocated"] += 1

    def finished(self, request: Any) -> None:
        """Called before vLLM frees the request's blocks: they are released at the next step.
        The blocks it filled since its first allocation (decode, later prefill chunks) are filed
        now, while vLLM still lists them: until it ends they are in use, so never a victim."""
        t = self._running.get(request.request_id)
        if t is not None and t.filed < len(request.block_hashes):
            self._file_new_blocks(t)
        self._finished.append(request)

    # -- once per scheduler step --------------------------------------------------------------------
    def step(self) -> None:
        """Bring the mirror up to date, then reorder the head of the free queue for the next step."""
        if self.pool is None:
            return
        now = self.clock()
        policy = self.policy
        keys_of = self._keys
        arrived_now = set()
        for request in self._new:
            rid = request.request_id
            arrived_now.add(rid)
            params = getattr(request, "kv_transfer_params", None)
            keys = keys_of[rid] = block_keys(request.block_hashes)
            warmup = params.get(WARMUP_KEY) if isinstance(params, dict) else None
            if isinstance(warmup, str) and warmup in self.anchor_keys:
                self._warmups[rid] = warmup    # not a call: the policy learns nothing from it
                continue
            hints, bad = Hints.from_params(params)
            if bad or warmup is not None:
                self.stats["bad_hints"] += len(bad) + (warmup is not None)
            obs = policy.observe(rid, keys, tokens=request.prompt_token_ids, hints=hints, now=now)
            self._note_anchor(request, obs, keys)
        self._new.clear()
        unplanned = 0
        for rid, t in self._allocated.items():
            got = keys_of.pop(rid, None)
            t.keys = keys = got if got is not None else block_keys(t.request.block_hashes)
            if rid in arrived_now:
                unplanned += len(keys) + 1 - t.local_hit_tokens // policy.cfg.block_size
            t.warmup = self._warmups.pop(rid, None)
            t.anchor_blocks, t.warmed = self._anchor_of.pop(rid, (0, False))
            self._admit(t)
            self._running[rid] = t
        self._allocated.clear()
        cpu_tier = self.cpu_tier
        if cpu_tier is not None and cpu_tier.holds:
            # Left waiting: the workers hold its CPU-tier prefix until it is admitted (lmcache_tier.py).
            for rid in arrived_now:
                waiting = keys_of.get(rid)
                if waiting is not None:
                    cpu_tier.hold(rid, waiting)
        # Requests that arrive between two steps are allocated in the very step that first shows
        # them to the connector: leave room for as many blocks as recent arrivals took at once.
        self._arrival_blocks = max(float(unplanned), self._arrival_blocks * _ARRIVAL_DECAY)
        for request in self._finished:
            rid = request.request_id
            self._hit_tokens.pop(rid, None)
            self._keys.pop(rid, None)   # finished (aborted) before it was ever allocated
            self._warmups.pop(rid, None)
            self._anchor_of.pop(rid, None)
            tracked = self._running.pop(rid, None)
            if tracked is None and self.cpu_tier is not None:
                self.cpu_tier.release(rid)   # ended while it waited
            self._release(tracked if tracked is not None else _Tracked(request), now)
        self._finished.clear()
        # The next step allocates at most: the prompt blocks still to compute (of running and
        # waiting requests, past what is cached of them) up to the step's token budget, and one per
        # running decode opening a block.
        bs = policy.cfg.block_size
        budget = self.budget_tokens // bs + 1
        prefill = 0
        # In arrival order, as vLLM admits them, and no more than it can admit next step.
        for keys in itertools.islice(keys_of.values(), max(0, self.max_seqs - len(self._running))):
            prefill += len(keys) + 1 - self._cached_prefix(keys)
            if prefill >= budget:
                break
        decode = 0
        for t in self._running.values():
            r = t.request
            computed = r.num_computed_tokens
            left = r.num_prompt_tokens - computed
            if left > 0:
                prefill += left // bs + 1
            elif computed % bs <= 1 or bs == 1:
                decode += 1   # its next token or the one after opens a block (one in `bs` do)
        upcoming = min(prefill + int(self._arrival_blocks), budget) + decode
        self._decode_only = not prefill and len(self._running) < self.max_seqs   # for GPU warm-ups
        if self.steer:
            self._steer(max(self.ahead_blocks, int(self.ahead_factor * upcoming)), now)

    def _cached_prefix(self, keys: list) -> int:
        """How many leading blocks of a waiting request the mirror holds (a binary search: vLLM
        frees a request's blocks tail first, so a prompt's cached blocks are nearly always a
        prefix; an estimate either way, for how much room to prepare)."""
        where_of = self._where
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi) // 2
            where = where_of.get(keys[mid])
            if where is not None and where[0].block_hash == where[1]:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _note_anchor(self, request: Any, obs: Any, keys: list) -> None:
        """Remember each agent's anchor tokens (and LMCache tags), for prefetching it on workers
        and warming it up on the GPU; count the calls that could find it cached."""
        agent = obs.agent
        blocks = obs.fingerprint.anchor_blocks
        n = blocks * self.policy.cfg.block_size
        if agent is None or not n or obs.fingerprint.agent is None:
            return
        self._anchor_of[request.request_id] = (blocks, agent in self.warmed)
        self.warmed.discard(agent)      # a warm-up serves the agent's next call only
        known = self.anchors.get(agent)
        if known is not None and len(known[0]) == n:
            return
        if known is None and len(self.anchors) >= self.policy.cfg.max_agents:
            return
        self.anchors[agent] = (list(request.prompt_token_ids[:n]), lmcache_configs(request))
        self.anchor_keys[agent] = list(keys[:blocks])

    # -- what GPU warm-ups ask (scheduler_side.py) ----------------------------------------------------
    def anchor_missing(self, agent: str) -> int:
        """How many of `agent`'s anchor blocks the GPU cache lacks (its leading cached run counted)."""
        keys = self.anchor_keys.get(agent)
        return 0 if not keys else len(keys) - self._cached_prefix(keys)

    def prefill_idle(self) -> bool:
        """Nothing waits to be scheduled and every running request is decoding: a prefill now
        takes only compute the running requests leave unused. As of the last step's count of
        prompt blocks still to compute, and no request arrived since."""
        return self._decode_only and not self._new and not self._allocated

    def empty_blocks(self, at_most: int) -> int:
        """Free blocks holding nothing cached at the free queue's head (up to `at_most`): room a
        prefill takes without evicting anything."""
        queue = self.pool.free_block_queue
        tail = queue.fake_free_list_tail
        b = queue.fake_free_list_head.next_free_block
        n = 0
        while b is not tail and b.block_hash is None and n < at_most:
            n += 1
            b = b.next_free_block
        return n

    def _admit(self, t: _Tracked) -> None:
        """A request's first allocation: file its prompt blocks (hits are acquired)."""
        request = t.request
        policy = self.policy
        keys = t.keys
        num_cached = t.local_hit_tokens // policy.cfg.block_size
        t.prompt_blocks = len(keys)
        if self.cpu_tier is not None:   # LMCache looks the prompt up and stores it (warm-ups too)
            self.cpu_tier.release(request.request_id)   # its hold, if it waited: LMCache's lookup pins now
            self.cpu_tier.admitted(keys, num_cached)
        if t.warmup is not None:
            # Its blocks are filed where vLLM put them; the policy hears of them when it ends.
            self.stats["warmup_tokens"] += request.num_prompt_tokens
            self._file_new_blocks(t)
            return
        self.stats["prompt_tokens"] += request.num_prompt_tokens
        self.stats["gpu_hit_tokens"] += t.local_hit_tokens
        policy.prefetch_hits(keys[:num_cached])     # warm-ups' blocks this call used
        if t.anchor_blocks:
            on_gpu = num_cached >= t.anchor_blocks
            self.stats["anchor_calls"] += 1
            self.stats["anchor_on_gpu"] += on_gpu
            if t.warmed:
                self.stats["warmed_calls"] += 1
                self.stats["warmed_on_gpu"] += on_gpu
        # Keys the mirror still has past the hit may have been evicted since: check them first.
        for key in keys[num_cached:]:
            if key in self._where:
                self._check(key)
        bs = policy.cfg.block_size
        policy.admit_blocks(request.request_id, keys, num_cached, keys[:(request.num_prompt_tokens - 1) // bs])
        self._file_new_blocks(t)

    def _file_new_blocks(self, t: _Tracked) -> None:
        """Record where the request's newly hashed blocks are; decode-filled ones join the policy."""
        hashes = t.request.block_hashes
        if t.filed >= len(hashes):
            return
        blocks = self.req_blocks(t.request.request_id)
        keys = t.keys
        if len(keys) < len(hashes):
            keys.extend(block_keys(hashes[len(keys):]))
        start = i = t.filed
        n = min(len(hashes), len(blocks))
        where_of, key_at = self._where, self._key_at
        # A prefix hit on a block filed before (the common case): nothing to update.
        get = where_of.get
        while i < n:
            where = get(keys[i])
            if where is not None and where[0] is blocks[i]:
                i += 1
                continue
            blk = blocks[i]
            key = keys[i]
            bh = blk.block_hash
            if bh is None:
                break
            old = key_at.get(blk.block_id)
            if old is not None and old != key:
                self._forget(old, blk)   # the block was evicted and now holds other content
            where_of[key] = (blk, bh)
            key_at[blk.block_id] = key
            i += 1
        t.filed = i
        if i > t.prompt_blocks and t.prompt_blocks and t.warmup is None:
            self.policy.extend_blocks(t.request.request_id, keys[max(start, t.prompt_blocks):i])

    def _release(self, t: _Tracked, now: float) -> None:
        """After vLLM freed a finished request's blocks: those nobody holds become evictable."""
        request = t.request
        if t.warmup is None:
            # Only the output's first `session_window_tokens` are read (its leading content chunks).
            window = self.policy.cfg.session_window_tokens
            out = request.output_token_ids
            self.policy.finish(request.request_id, now, output_tokens=out[:window], ending=output_ending(out))
        freed = []
        for key in reversed(t.keys[:t.filed]):   # tail first, the order vLLM frees in
            blk = self._located(key)
            if blk is not None and blk.ref_cnt == 0:
                freed.append(key)
        if t.warmup is not None:
            # The anchor blocks it brought in are a prefetch of that anchor: filed in its group,
            # then judged used or wasted (the policy's prefetch precision).
            hit = t.local_hit_tokens // self.policy.cfg.block_size
            new = set(t.keys[hit:t.filed])
            brought = [k for k in freed if k in new]
            if brought:
                self.policy.blocks_prefetched(brought, t.warmup, now)
                self.stats["warmup_blocks"] += len(brought)
            freed = [k for k in freed if k not in new]
        if freed:
            self.policy.blocks_freed(freed, now)

    def _located(self, key: Hashable) -> Any:
        """The block that caches `key` now, or None (then the policy has dropped the key too)."""
        where = self._where.get(key)
        if where is None:
            return None
        if where[0].block_hash != where[1]:
            self._forget(key)
            where = self._where.get(key)
        return None if where is None else where[0]

    def _forget(self, key: Hashable, blk: Any = None) -> None:
        """The block filed for `key` (or `blk`, which held it) holds other content now."""
        where = self._where.get(key)
        if blk is not None and where is not None and where[0] is not blk:
            # `blk` held `key` once, but it was filed in another block since: still cached there.
            if self._key_at.get(blk.block_id) == key:
                del self._key_at[blk.block_id]
            return
        if where is not None:
            del self._where[key]
            if self._key_at.get(where[0].block_id) == key:
                del self._key_at[where[0].block_id]
            # vLLM may hold the same content in a second block (computed twice, or again after the
            # eviction): then it is still cached, there.
            other = self._cached.get_one_block(where[1]) if self._cached is not None else None
            if other is not None:
                self._where[key] = (other, where[1])
                self._key_at[other.block_id] = key
                return
        self.policy.blocks_evicted([key])
        self.stats["evictions_seen"] += 1

    def _check(self, key: Hashable) -> Any:
        """The block holding `key` if it is still cached and free; fixes the mirror otherwise."""
        where = self._where.get(key)
        if where is None:
            self.policy.blocks_evicted([key])   # never located: the policy must not keep it either
            return None
        blk = where[0]
        if blk.block_hash is where[1] and not blk.ref_cnt:
            return blk   # unchanged since filed and free: the common case
        blk = self._located(key)
        if blk is None:
            return None
        if blk.ref_cnt:
            self.policy.blocks_reused([key])
            return None
        return blk

    def _still_valid(self, now: float) -> bool:
        """May the last placement stand? Yes while the policy's order is unchanged, and also while
        only blocks were freed since (no rescoring) for up to one rescoring interval: a block freed
        meanwhile waits at most that long to be ranked, as the scores themselves do."""
        policy = self.policy
        if policy.order_version == self._placed_version:
            return True
        if self.refresh_s is None:
            return False
        return policy.rescore_epoch == self._placed_epoch and now - self._placed_time < self.refresh_s

    def _steer(self, need: int, now: float) -> None:
        """Put the policy's next victims at the head of the free queue, behind its empty blocks."""
        queue = self.pool.free_block_queue
        tail = queue.fake_free_list_tail
        empty = 0
        b = queue.fake_free_list_head.next_free_block
        while b is not tail and b.block_hash is None and empty < need:
            empty += 1
            b = b.next_free_block
        if empty >= need:
            return   # the next step's allocations are served by empty blocks: nothing is evicted
        want = need - empty
        # Nothing changed in the policy's order since the last placement, and enough of what was
        # placed is still at the head (vLLM evicts from there): keep it.
        placed = self._placed
        # vLLM evicts from the head, so what is left of the list starts at the head block.
        # (A hit may have taken one out of the middle: then one fewer is left, harmlessly.)
        j = self._placed_at.get(b.block_id, -1)
        left = j >= 0 and placed[j] is b
        if placed and left and len(placed) - j >= want and self._still_valid(now):
            self.stats["steer_kept"] += 1
            return
        # vLLM evicted (from the head) some of what was placed last time, all of it before the head
        # block: tell the policy now, so its victims below are all still cached.
        key_at, where_of = self._key_at, self._where
        for blk in placed[:j] if left else placed:
            if blk.ref_cnt:
                key = key_at.get(blk.block_id)
                where = where_of.get(key)
                if where is not None and where[0] is blk and blk.block_hash != where[1]:
                    self._forget(key, blk)
        # Place twice what is wanted, so the list lasts while vLLM consumes it: each placed block
        # is computed about twice, not once per step.
        victims: list[Any] = []
        for _ in range(_MAX_STALE_ROUNDS):
            self.stats["victim_rounds"] += 1
            victims.clear()
            stale = False
            for key in self.policy.victims(_PLACE_FACTOR * want, now):
                blk = self._check(key)
                if blk is None:
                    stale = True
                else:
                    victims.append(blk)
            if not stale or len(victims) >= _PLACE_FACTOR * want:
                break
        self._placed = victims
        self._placed_at = dict(zip(map(_block_id, victims), itertools.count()))
        self._placed_version = self.policy.order_version
        self._placed_epoch = self.policy.rescore_epoch
        self._placed_time = now
        if not victims:
            return
        # Already in place? (b: the first cached block after the empty run.)
        b = queue.fake_free_list_head.next_free_block
        for _ in range(empty):
            b = b.next_free_block
        for blk in victims:
            if b is not blk:
                break
            b = b.next_free_block
        else:
            self.stats["steer_in_place"] += 1
            return
        head_run = queue.popleft_n(empty) if empty else []
        for blk in victims:
            queue.remove(blk)
        queue.prepend_n(victims)
        if head_run:
            queue.prepend_n(head_run)
        self.stats["steered_blocks"] += len(victims)
        self.stats["steer_steps"] += 1
