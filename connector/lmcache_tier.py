"""CacheScout in LMCache's tiers: a CPU-tier eviction policy and a Redis-to-CPU prefetcher.

LMCache builds its CPU tier's policy by name (`cache_policy: cachescout` in its YAML) with no
arguments, so the policy reads a process-wide `AgentRanking`. The scheduler side of the connector
sends its per-agent reuse predictions to the workers with each step's connector metadata, and the
worker side puts them there (vllm_connector.py). Chunks know their agent through LMCache's request
tags (`lmcache.tag.agent`, part of LMCache's chunk key).

- `CacheScoutCachePolicy`: among the oldest evictable chunks (a bounded window in LRU order) it
  evicts the one whose agent is least likely to run soon; ties, untagged chunks and an empty
  ranking give exactly LRU. Never returns a chunk LMCache marks as not evictable.
- `Prefetcher`: one background thread with a bounded queue. `submit(tokens, tags)` asks for the
  chunks of a predicted agent's anchor: those in Redis and not in the CPU tier are copied into the
  CPU tier, at most `max_chunks` per request, and only if loading beats recomputing (`worth_it`).
  A full queue drops the request (counted); `cancel()` drops what is queued; Redis errors are
  counted and logged, never raised. Nothing here runs on vLLM's serving path.
- `bound_store_waits`: LMCache 0.5.6 drops a store at once when its CPU tier has nothing evictable
  (every chunk pinned by a Redis write still in flight), though the writes often finish within
  milliseconds; waiting without a bound (its `force_store_wait`) stalls the forward pass as long as
  Redis stalls. The store path waits up to `store_wait_ms`, then drops (counted).

Importing this module imports LMCache (a few seconds); nothing else in the connector does unless
the LMCache tier is in use.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lmcache.v1.storage_backend import cache_policy as _lmcache_policies
from lmcache.v1.storage_backend.cache_policy.base_policy import BaseCachePolicy

from .deploy_config import POLICY_NAME   # `cache_policy: cachescout` in LMCache's YAML
from .lmcache_model import HOLD_SHARE

log = logging.getLogger("cachescout.connector")

AGENT_TAG = "agent"             # LMCache request config `lmcache.tag.agent`
EVICTION_WINDOW = 64            # oldest evictable chunks compared per eviction
_YIELD_EVERY = 16               # chunks hashed by QueuedHolds between two GIL releases


class AgentRanking:
    """Per-agent probability of being called soon, replaced as a whole (readers never lock)."""

    def __init__(self) -> None:
        self._scores: Mapping[str, float] = {}
        self.version = 0

    def update(self, scores: Mapping[str, float]) -> None:
        clean = {str(a): float(p) for a, p in scores.items() if isinstance(p, (int, float)) and 0.0 <= p <= 1.0}
        self._scores = clean   # one reference swap: atomic for readers in other threads
        self.version += 1

    def scores(self) -> Mapping[str, float]:
        return self._scores


RANKING = AgentRanking()


def agent_of(key: Any) -> str | None:
    for name, value in getattr(key, "tags", None) or ():
        if name == AGENT_TAG:
            return value
    return None


class CacheScoutCachePolicy(BaseCachePolicy):
    """LMCache CPU-tier policy: LRU order, the least likely agent first within the oldest chunks."""

    def __init__(self, ranking: AgentRanking | None = None) -> None:
        self.ranking = ranking if ranking is not None else RANKING
        self.stats: Counter[str] = Counter()
        _POLICIES.add(self)

    def init_mutable_mapping(self) -> OrderedDict:
        return OrderedDict()   # insertion order = LRU order; hits move to the end

    def update_on_hit(self, key: Any, cache_dict: OrderedDict) -> None:
        cache_dict.move_to_end(key)
        if PREFETCHED and PREFETCHED.take(key):
            self.stats["prefetch_used"] += 1

    def update_on_put(self, key: Any) -> None:
        pass

    def update_on_force_evict(self, key: Any) -> None:
        pass

    def get_evict_candidates(self, cache_dict: OrderedDict, num_candidates: int = 1) -> list:
        scores = self.ranking.scores()
        window: list[tuple[float, int, Any]] = []
        limit = max(EVICTION_WINDOW, num_candidates)
        for key, obj in cache_dict.items():
            if not obj.can_evict:
                continue
            agent = agent_of(key) if scores else None
            window.append((scores.get(agent, 0.0) if agent is not None else 0.0, len(window), key))
            if len(window) >= limit:
                break
        if not window:
            # Every chunk is pinned (typically: its Redis write is still in flight). LMCache's store
            # path does not wait here, so the chunk being stored is dropped: counted, so that it is
            # seen (vllm:cachescout_cpu_no_evictable_total) and the CPU tier can be sized up.
            self.stats["no_evictable"] += 1
            return []
        window.sort()   # lowest probability first, then oldest
        chosen = [key for _, _, key in window[:num_candidates]]
        if PREFETCHED:
            self.stats["prefetch_wasted"] += sum(PREFETCHED.take(key) for key in chosen)
        if window[0][1] != 0:
            self.stats["steered"] += 1   # differs from what LRU would have evicted
        self.stats["evictions"] += len(chosen)
        return chosen


class _Prefetched:
    """Keys the prefetcher brought into the CPU tier and nothing has read yet (bounded: the oldest
    are forgotten first). A hit makes one "used", an eviction "wasted"."""

    def __init__(self, limit: int = 100_000) -> None:
        self._keys: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.limit = limit

    def __bool__(self) -> bool:
        return bool(self._keys)

    def add(self, key: Any) -> None:
        with self._lock:
            self._keys[key] = None
            if len(self._keys) > self.limit:
                self._keys.popitem(last=False)

    def take(self, key: Any) -> bool:
        with self._lock:
            return self._keys.pop(key, 0) is None


PREFETCHED = _Prefetched()
_POLICIES: weakref.WeakSet = weakref.WeakSet()   # this process's CPU-tier policies (one per LMCache engine)


def cpu_tier_stats() -> Counter:
    """Counts of every CacheScout CPU-tier policy in this process."""
    total: Counter[str] = Counter()
    for policy in list(_POLICIES):
        total.update(policy.stats)
    return total


STORE_STATS: Counter[str] = Counter()   # this process's bounded store waits: "waited", "dropped"


def bound_store_waits(engine: Any, wait_s: float, poll_s: float = 0.002) -> bool:
    """Make `engine`'s store path wait up to `wait_s` for room in the CPU tier before it drops a
    chunk. Only allocations LMCache makes without its own wait (`busy_loop=False`, the store path)
    are changed. True if installed by this call (once per engine)."""
    manager = getattr(engine, "storage_manager", None)
    if manager is None or getattr(manager, "_cachescout_store_wait_s", None) is not None:
        return False
    for name in ("allocate", "batched_allocate"):
        allocate = getattr(manager, name, None)
        if allocate is not None:
            setattr(manager, name, _waiting(allocate, wait_s, poll_s))
    manager._cachescout_store_wait_s = wait_s
    return True


def _waiting(allocate: Callable[..., Any], wait_s: float, poll_s: float) -> Callable[..., Any]:
    def allocate_or_wait(*args: Any, busy_loop: bool = True, **kwargs: Any) -> Any:
        got = allocate(*args, busy_loop=busy_loop, **kwargs)
        if got is not None or busy_loop or wait_s <= 0:
            return got
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            time.sleep(poll_s)   # the Redis writes pinning the tier finish on LMCache's own thread
            got = allocate(*args, busy_loop=False, **kwargs)
            if got is not None:
                STORE_STATS["waited"] += 1
                return got
        STORE_STATS["dropped"] += 1   # LMCache stores the chunks before this one and stops there
        if STORE_STATS["dropped"] in (1, 10, 100) or STORE_STATS["dropped"] % 1000 == 0:
            log.warning("CacheScout: LMCache's CPU tier had no room for %.0f ms (Redis writes in flight); "
                        "%d stores cut short so far: give the CPU tier more room", 1e3 * wait_s,
                        STORE_STATS["dropped"])
        return None
    return allocate_or_wait


def current_engine() -> Any:
    """This process's LMCache engine (a vLLM worker has one), or None."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    engines = list(getattr(LMCacheEngineBuilder, "_instances", {}).values())
    return engines[0] if len(engines) == 1 else None


def register() -> None:
    """Make `cache_policy: cachescout` known to LMCache (before its engine is built)."""
    _lmcache_policies.POLICY_MAPPING[POLICY_NAME.upper()] = CacheScoutCachePolicy


class Prefetcher:
    """Copies chunks of predicted agents' anchors from Redis into the CPU tier, in the background."""

    def __init__(self, engine: Any, *, max_queue: int = 16, max_chunks: int = 64,
                 worth_it: Callable[[int, int], bool] = lambda num_tokens, start: True) -> None:
        """`engine`: an LMCacheEngine (post_init done). `worth_it(num_tokens, start)`: is loading
        that many tokens from Redis, from prompt position `start` on, faster than recomputing them
        (the cost model's answer)?"""
        self.engine = engine
        self.max_chunks = max_chunks
        self.worth_it = worth_it
        self.stats: Counter[str] = Counter()
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachescout-prefetch", daemon=True)
        self._thread.start()

    def submit(self, tokens: Sequence[int], tags: Mapping[str, str] | None = None) -> bool:
        """Queue a prefetch; False (and counted) when the queue is full or the prefetcher stopped."""
        if self._stop.is_set():
            return False
        configs = {f"lmcache.tag.{k}": v for k, v in (tags or {}).items()}
        try:
            self._queue.put_nowait((list(tokens), configs))
        except queue.Full:
            self.stats["dropped_queue_full"] += 1
            return False
        self.stats["submitted"] += 1
        return True

    def cancel(self) -> int:
        """Drop every queued request (the prediction changed); returns how many."""
        n = 0
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return n
            self._queue.task_done()
            n += 1

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """For tests and shutdown: True once everything queued has been handled."""
        done = threading.Event()

        def waiter() -> None:
            self._queue.join()
            done.set()
        threading.Thread(target=waiter, daemon=True).start()
        return done.wait(timeout)

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self.cancel()
        try:
            self._queue.put_nowait(None)   # wake the thread
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            item = self._queue.get()
            try:
                if item is not None:
                    self._prefetch(*item)
            except Exception as exc:   # Redis down, a bad chunk: count it, keep serving
                self.stats["errors"] += 1
                log.warning("CacheScout prefetch failed: %s", exc)
            finally:
                self._queue.task_done()

    def _prefetch(self, tokens: list[int], configs: dict) -> None:
        import torch

        engine = self.engine
        manager = engine.storage_manager
        cpu = manager.storage_backends.get("LocalCPUBackend")
        remote = manager.storage_backends.get("RemoteBackend")
        if cpu is None or remote is None:
            self.stats["skipped_no_tier"] += 1
            return
        wanted: list[Any] = []
        first = 0   # the first wanted chunk's first token: recomputing deeper tokens costs more
        for start, end, key in engine.token_database.process_tokens(torch.tensor(tokens), request_configs=configs):
            if len(wanted) >= self.max_chunks:
                break
            if cpu.contains(key):
                self.stats["already_in_cpu"] += 1
                continue
            if not wanted:
                first = start
            wanted.append((end - start, key))
        if not wanted:
            return
        if not self.worth_it(sum(n for n, _ in wanted), first):
            self.stats["skipped_slower_than_recompute"] += 1
            return
        keys = [key for _, key in wanted]
        present = [k for k in keys if remote.contains(k)]
        if not present:
            self.stats["not_in_redis"] += len(keys)
            return
        objs = manager.batched_get(present, location="RemoteBackend")
        loaded = 0
        for key, obj in zip(present, objs, strict=True):
            if obj is not None:
                obj.ref_count_down()   # the CPU tier holds its own reference now
                loaded += 1
                PREFETCHED.add(key)
        self.stats["chunks_loaded"] += loaded
        self.stats["requests_done"] += 1


class QueuedHolds:
    """Holds each queued request's prefix in LMCache's CPU tier from its arrival to its admission.

    LMCache pins what its lookup finds from that lookup on, and vLLM's scheduler makes it only when
    the request reaches the head of its queue; until then the prompts stored ahead of it (those
    admitted while it waits) push its copy out, and a request that waited long recomputes what it
    found on arrival. The scheduler side sends each request still waiting at the end of a step
    (`hold`) and each one admitted or ended (`release`); here, on one background thread, its
    chunks the CPU tier holds, from the first on (the run LMCache's lookup would hit), are pinned
    until the release. The same rule as the benchmark's tier model (`TierStore.hold_prefix`):

    - at most `share` of the tier's bytes is held (a chunk held by several requests counts once), so
      that stores always find room; the earliest queued are held first, a hold cut short by the
      limit holds what fits, and when a hold is released the requests still queued hold theirs
      again in queue order;
    - each request pins its chunks itself (LMCache counts pins, so its own lookups' pins are
      never undone by a release); pinning is not a lookup: LMCache's LRU order and hit statistics
      are untouched;
    - LMCache unpins by force whatever has not been pinned for its `pin_timeout_sec` (300 s by
      default: a guard against leaked pins), and a later unpin of ours would then undo someone
      else's pin; a request can wait longer than that. So the chunks held are pinned again (and
      unpinned, a net nothing) every quarter of that timeout, which LMCache's guard counts from.
      A hold of our own that vLLM never ends is guarded instead by `max_hold_s` (an hour): a
      request still waiting then lets its hold go (counted).

    The queue is bounded (`max_queued` requests waiting or being held; more are not held, counted);
    errors are counted and logged, never raised. Nothing here runs on vLLM's serving path: `hold`
    and `release` only queue."""

    def __init__(self, engine: Any, *, share: float = HOLD_SHARE, max_queued: int = 256,
                 max_hold_s: float = 3600.0, refresh_s: float | None = None) -> None:
        self.engine = engine
        config = engine.config
        self.limit_bytes = int(share * float(config.max_local_cpu_size) * 2**30)
        self.max_queued = max_queued
        self.max_hold_s = max_hold_s
        if refresh_s is None:
            refresh_s = float(getattr(config, "pin_timeout_sec", None) or 300.0) / 4
        self.refresh_s = refresh_s
        self.stats: Counter[str] = Counter()
        self.held_bytes = 0
        # Only the holding thread touches these three:
        self._queued: OrderedDict[str, _Queued] = OrderedDict()   # waiting requests, in arrival order
        self._pins: dict[Any, list] = {}          # chunk key -> [memory object, holders, last pinned]
        self._checked = time.monotonic()
        self._ops: queue.SimpleQueue = queue.SimpleQueue()        # ("hold", ...), ("release", rid), None
        # Each written by one thread only: holds queued (the worker's) and handled (the holder's).
        self._holds_put = self._holds_done = 0
        self._ops_put = self._ops_done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachescout-hold", daemon=True)
        self._thread.start()

    # -- from the worker's step (metadata), O(1) each ----------------------------------------------
    def hold(self, request_id: str, tokens: Sequence[int], configs: Mapping[str, Any] | None = None) -> bool:
        """Queue a hold of a waiting request's prefix; False (counted) when too many are queued."""
        if self._stop.is_set():
            return False
        if self._holds_put - self._holds_done + len(self._queued) >= self.max_queued:
            self.stats["holds_dropped"] += 1
            return False
        self._holds_put += 1
        self._ops_put += 1
        self._ops.put(("hold", request_id, tokens, dict(configs or {})))
        return True

    def release(self, request_id: str) -> None:
        """The request was admitted (LMCache's lookup pinned what it loads) or ended."""
        if not self._stop.is_set():
            self._ops_put += 1
            self._ops.put(("release", request_id))

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """For tests: True once every hold and release queued so far has been handled."""
        deadline = time.monotonic() + timeout
        while self._ops_done < self._ops_put:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread and unpin everything held."""
        self._stop.set()
        self._ops.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            for rid in list(self._queued):
                self._unpin(self._queued.pop(rid))

    # -- the holding thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                op = self._ops.get(timeout=self._tick())
            except queue.Empty:
                op = ("maintain",)
            if op is None or self._stop.is_set():
                return
            try:
                if op[0] == "hold":
                    self._add(*op[1:])
                elif op[0] == "release":
                    self._drop(op[1])
                self._maintain()
            except Exception as exc:   # a changed LMCache internal, a bad chunk: count it, keep serving
                self.stats["hold_errors"] += 1
                if self.stats["hold_errors"] in (1, 10, 100):
                    log.warning("CacheScout: holding a queued request's CPU-tier prefix failed: %s", exc)
            finally:
                if op[0] == "hold":
                    self._holds_done += 1
                if op[0] != "maintain":
                    self._ops_done += 1

    def _add(self, rid: str, tokens: Sequence[int], configs: dict) -> None:
        import torch

        if rid in self._queued:
            return
        db = self.engine.token_database
        keys = []
        for _, _, key in db.process_tokens(torch.tensor(tokens, dtype=torch.long), request_configs=configs or None):
            keys.append(key)
            if len(keys) % _YIELD_EVERY == 0:
                time.sleep(0)   # hashing holds the GIL: let the worker's own thread run between chunks
        entry = self._queued[rid] = _Queued(keys)
        self._pin(entry)
        self.stats["holds"] += bool(entry.held)
        self.stats["holds_cut_by_limit"] += entry.short

    def _tick(self) -> float:
        return max(0.01, min(1.0, self.refresh_s / 4, self.max_hold_s / 4))

    def _maintain(self) -> None:
        """Pin again what has been held for `refresh_s` (LMCache's guard then leaves it be), and let
        go of the holds that have lasted `max_hold_s` (those requests stay queued, unheld)."""
        now = time.monotonic()
        if now - self._checked < self._tick():
            return
        self._checked = now
        for rid, entry in list(self._queued.items()):
            if entry.held and now - entry.held_at > self.max_hold_s:
                del self._queued[rid]
                self.stats["holds_expired"] += 1
                self._drop_entry(entry)
        cpu = self.engine.storage_manager.storage_backends.get("LocalCPUBackend")
        if cpu is None:
            return
        for key, pin in self._pins.items():
            if now - pin[2] > self.refresh_s:
                with cpu.cpu_lock:
                    if cpu.hot_cache.get(key) is pin[0]:
                        pin[0].pin()      # LMCache's pin guard counts from the last pin...
                        pin[0].unpin()    # ... and the count is as it was
                pin[2] = now
                self.stats["hold_refreshes"] += 1

    def _drop(self, rid: str) -> None:
        entry = self._queued.pop(rid, None)
        if entry is not None:
            self._drop_entry(entry)

    def _drop_entry(self, entry: _Queued) -> None:
        if not entry.held:
            return
        self._unpin(entry)
        for other in self._queued.values():   # room came free: the queue holds again, in order
            if other.short:                   # (chunks held for another cost no room)
                self._unpin(other)
                self._pin(other)

    def _pin(self, entry: _Queued) -> None:
        """Pin the run of `entry`'s chunks the CPU tier holds from the first, within the limit."""
        cpu = self.engine.storage_manager.storage_backends.get("LocalCPUBackend")
        if cpu is None:
            return
        pins = self._pins
        entry.short = False
        entry.held_at = time.monotonic()
        for key in entry.keys:
            pin = pins.get(key)
            if pin is None and self.held_bytes >= self.limit_bytes:
                entry.short = True   # held again when room comes free
                break
            with cpu.cpu_lock:
                obj = cpu.hot_cache.get(key)
                if obj is None or (pin is not None and obj is not pin[0]):
                    break            # the run ends: LMCache's lookup would stop here too
                obj.pin()            # one pin per request: each release undoes its own
            if pin is None:
                pin = pins[key] = [obj, 0, 0.0]
                self.held_bytes += _bytes_of(obj)   # a chunk counts once, however many hold it
                self.stats["hold_chunks"] += 1
            pin[1] += 1
            pin[2] = entry.held_at
            entry.held.append(key)

    def _unpin(self, entry: _Queued) -> None:
        cpu = self.engine.storage_manager.storage_backends.get("LocalCPUBackend")
        pins = self._pins
        for key in entry.held:
            pin = pins[key]
            obj = pin[0]
            pin[1] -= 1
            if not pin[1]:
                del pins[key]
                self.held_bytes -= _bytes_of(obj)
            if cpu is None:
                continue
            with cpu.cpu_lock:
                # A chunk LMCache removed by force (a cache reset) lost its pins with it; one stored
                # again since is another object: neither is ours to unpin.
                if cpu.hot_cache.get(key) is obj:
                    obj.unpin()
        entry.held = []


class _Queued:
    __slots__ = ("keys", "held", "short", "held_at")

    def __init__(self, keys: list) -> None:
        self.keys = keys           # the prompt's LMCache chunk keys, first to last
        self.held: list = []       # those pinned for it (a leading run)
        self.short = False         # the limit cut its hold short
        self.held_at = 0.0         # when it was (last) pinned


def _bytes_of(obj: Any) -> int:
    size = getattr(obj, "get_physical_size", None) or obj.get_size
    return int(size())


# -- LMCache's destroy() hangs with a redis:// tier: its Redis connector's close blocks the event
# -- loop it runs on, waiting for work that needs that loop. The functions below avoid it.
def _stop_loops(engine: Any) -> bool:
    manager = getattr(engine, "storage_manager", None)
    loop, thread = getattr(manager, "loop", None), getattr(manager, "thread", None)
    if loop is None or thread is None:
        return True
    if loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
    thread.join(2.0)
    return not thread.is_alive()


def _defuse_redis_close(engine: Any, timeout: float) -> None:
    """LMCache's Redis connector closes its job executor with a blocking call made on the event
    loop that the executor needs (a deadlock). Shut the executor down asynchronously from here
    first, then make its blocking shutdown a no-op awaitable."""
    import asyncio

    manager = getattr(engine, "storage_manager", None)
    loop = getattr(manager, "loop", None)
    for backend in list(getattr(manager, "storage_backends", {}).values()):
        conn = getattr(backend, "connection", None)
        inner = getattr(conn, "_connector", conn)
        pq = getattr(inner, "pq_executor", None)
        if pq is None or loop is None or not hasattr(pq, "shutdown_async"):
            continue
        try:
            asyncio.run_coroutine_threadsafe(pq.shutdown_async(wait=False), loop).result(timeout)
        except Exception as exc:
            log.warning("CacheScout: could not stop LMCache's Redis executor cleanly: %s", exc)
        pq.shutdown = lambda wait=True: asyncio.sleep(0)


def close_engine(instance_id: str, timeout: float = 5.0) -> bool:
    """LMCacheEngineBuilder.destroy(instance_id), given `timeout` seconds; if it has not returned
    by then, its event loop is stopped so that nothing keeps the process alive. True if destroy
    finished by itself."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    engine = getattr(LMCacheEngineBuilder, "_instances", {}).get(instance_id)
    if engine is not None:
        _defuse_redis_close(engine, timeout)
    worker = threading.Thread(target=LMCacheEngineBuilder.destroy, args=(instance_id,),
                              name="cachescout-lmcache-destroy", daemon=True)
    worker.start()
    worker.join(timeout)
    if not worker.is_alive():
        return True
    log.warning("CacheScout: LMCache's destroy() did not return in %.0f s (its redis:// close waits on "
                "its own event loop); stopping the loop so the process can exit", timeout)
    if engine is not None:
        _stop_loops(engine)
    return False


def defuse_shutdown_hang(timeout: float = 2.0) -> int:
    """Before LMCache's own shutdown runs (vLLM calls ours first): make every LMCache engine of
    this process safe to destroy. Returns how many engines were handled."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    engines = list(getattr(LMCacheEngineBuilder, "_instances", {}).values())
    for engine in engines:
        _defuse_redis_close(engine, timeout)
    return len(engines)
