"""CacheScout on vLLM's workers: KV moves are LMCache's; CacheScout ranks its CPU tier, holds queued
requests' prefixes in it until their admission, and prefetches predicted anchors from Redis into it.

`CacheScoutConnector` (vllm_connector.py) hands its worker-role callbacks here. Without LMCache
installed the worker side does nothing (logged once).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from cachescout.policy.costs import RebuildCost

from .reporting import CounterReport
from .settings import ConnectorSettings

log = logging.getLogger("cachescout.connector")
_REPORT_INTERVAL_S = 1.0
_TAG_PREFIX = "lmcache.tag."

# Worker-side counters: name reported -> (source, its own name).
WORKER_COUNTERS = {"cpu_evictions": ("cpu", "evictions"), "cpu_steered": ("cpu", "steered"),
                   "cpu_no_evictable": ("cpu", "no_evictable"), "store_waits": ("store", "waited"),
                   "stores_dropped": ("store", "dropped"), "prefetch_submitted": ("prefetch", "submitted"),
                   "prefetch_chunks_loaded": ("prefetch", "chunks_loaded"),
                   "prefetch_skipped_slower": ("prefetch", "skipped_slower_than_recompute"),
                   "prefetch_errors": ("prefetch", "errors"), "prefetch_used": ("cpu", "prefetch_used"),
                   "prefetch_wasted": ("cpu", "prefetch_wasted"), "queued_holds": ("holds", "holds"),
                   "hold_chunks": ("holds", "hold_chunks"), "holds_cut_by_limit": ("holds", "holds_cut_by_limit"),
                   "holds_dropped": ("holds", "holds_dropped"), "holds_expired": ("holds", "holds_expired"),
                   "hold_errors": ("holds", "hold_errors")}


class WorkerSide:
    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.prefetcher: Any = None
        self.holds: Any = None      # lmcache_tier.QueuedHolds, once LMCache's engine exists
        self.report = CounterReport()
        self._lmcache: Any = None   # lmcache_tier, where LMCache is installed
        self._store_bounded = False
        try:
            from . import lmcache_tier
        except ImportError:
            log.info("CacheScout: LMCache is not installed; its CPU-tier policy is not registered")
            return
        lmcache_tier.register()   # before LMCache's connector (after ours) builds its engine
        self._lmcache = lmcache_tier
        from . import lmcache_cpu
        if lmcache_cpu.install():  # vLLM's CPU backend: LMCache has no connector of its own for it
            log.info("CacheScout: LMCache will use CacheScout's connector for vLLM's CPU KV layout")

    def received(self, metadata: Any) -> None:
        """A step's metadata from the scheduler: agent scores for the CPU tier, anchors to prefetch."""
        lmcache = self._lmcache
        if lmcache is None:
            return
        if not self._store_bounded:   # LMCache's connector builds its engine after ours: bind once it exists
            engine = lmcache.current_engine()
            if engine is not None:
                lmcache.bound_store_waits(engine, self.settings.store_wait_ms / 1e3)
                self._store_bounded = True
        scores = getattr(metadata, "agent_scores", None)
        if scores is not None:
            lmcache.RANKING.update(scores)
        for tokens, configs in getattr(metadata, "prefetch", None) or ():
            prefetcher = self.prefetcher or self._start_prefetcher()
            if prefetcher is not None:
                prefetcher.submit(tokens, {k[len(_TAG_PREFIX):]: v for k, v in configs.items()
                                           if k.startswith(_TAG_PREFIX)})
        holds = getattr(metadata, "holds", None)
        releases = getattr(metadata, "releases", None)
        if holds or releases or getattr(metadata, "release_all", False):
            self._holds(holds or (), releases or (), getattr(metadata, "release_all", False))

    def _holds(self, holds: Any, releases: Any, release_all: bool) -> None:
        keeper = self.holds
        if keeper is None:
            engine = self._lmcache.current_engine() if holds else None
            if engine is None:
                return
            keeper = self.holds = self._lmcache.QueuedHolds(engine)
        for rid in releases:
            keeper.release(rid)
        if release_all:   # the scheduler side turned itself off: hold nothing from now on
            keeper.close()   # (kept: its counts stay reported; a closed keeper holds nothing)
            return
        for rid, tokens, configs in holds:
            keeper.hold(rid, tokens, configs)

    def _start_prefetcher(self) -> Any:
        """The prefetcher of this worker's LMCache engine (built by LMCache's connector), if any."""
        engine = self._lmcache.current_engine()
        if engine is None:
            return None
        # Worth prefetching only if LMCache's later load from the CPU tier beats recomputing.
        cost = RebuildCost(self.settings.policy)
        bs = self.settings.policy.block_size
        self.prefetcher = self._lmcache.Prefetcher(
            engine, worth_it=lambda tokens, start: cost.worth_loading("cpu", max(1, tokens // bs), start // bs))
        return self.prefetcher

    def counters(self) -> dict[str, Any] | None:
        """This worker's counts (CPU-tier policy, prefetcher) that moved since its last report,
        about once a second; vLLM sums them with the scheduler's."""
        lmcache = self._lmcache
        if lmcache is None:
            return None
        t = time.monotonic()
        if t - self.report.at < _REPORT_INTERVAL_S:
            return None
        self.report.at = t
        sources = {"cpu": lmcache.cpu_tier_stats(), "store": lmcache.STORE_STATS,
                   "prefetch": self.prefetcher.stats if self.prefetcher is not None else {},
                   "holds": self.holds.stats if self.holds is not None else {}}
        delta = self.report.since_last({name: sources[src].get(key, 0) for name, (src, key) in WORKER_COUNTERS.items()})
        return delta or None

    def shutdown(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.holds is not None:
            self.holds.close()
        # vLLM shuts connectors down in order, ours before LMCache's: make LMCache's safe to run.
        if self._lmcache is not None:
            self._lmcache.defuse_shutdown_hang()
