"""`CacheScoutConnector`: CacheScout inside vLLM, loaded through `kv_transfer_config`.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "CacheScoutConnector",
        "kv_connector_module_path": "cachescout.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {...see settings.py...}}'

Scheduler side: every new request is handed to the policy core (agent, session, transitions), and
once per step (`build_connector_meta`) the GPU prefix cache's free queue is reordered by the
policy's eviction order (gpu_steering.py). The worker side moves no KV itself: with LMCache's
connector beside it (vLLM's MultiConnector, see deploy_config.py) it registers LMCache's
`cachescout` CPU-tier policy and hands it the scheduler's per-agent reuse probabilities, sent with
each step's connector metadata when they change (lmcache_tier.py).

Each callback does O(1) work and queues the rest for the step (`request_finished` also files the
blocks its request filled while decoding); a failure inside CacheScout is counted and logged once,
and vLLM keeps serving with its own LRU order (the callbacks then queue nothing).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from cachescout.policy import CacheScoutPolicy
from cachescout.policy.costs import RebuildCost

from .gpu_steering import GpuSteering
from .settings import ConnectorSettings
from .shared_state import SharedLearnedState

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("cachescout.connector")
_SCORES_INTERVAL_S = 1.0   # agent scores go to the workers at most this often


class CacheScoutMetadata(KVConnectorMetadata):
    """What the workers get each step: the per-agent reuse probabilities, when they changed (for
    the CPU-tier policy in LMCache, lmcache_tier.py). The GPU steering happens on the scheduler."""

    def __init__(self, agent_scores: dict[str, float] | None = None,
                 prefetch: list[tuple[list[int], dict]] | None = None) -> None:
        self.agent_scores = agent_scores
        self.prefetch = prefetch   # (anchor tokens, LMCache request configs) of agents predicted next


@dataclasses.dataclass
class CacheScoutStats(KVConnectorStats):
    """Counters since the last report, summed across reports (vLLM's connector stats)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = dict(self.data)
        steps = d.get("steps", 0)
        if steps:
            d["decision_us_per_step"] = round(1e6 * d.get("decision_s", 0.0) / steps, 2)
        if d.get("predictions"):
            d["prediction_accuracy"] = round(d.get("predictions_correct", 0) / d["predictions"], 4)
        return d

    def is_empty(self) -> bool:
        return not self.data


# Counters reported to Prometheus (each as vllm:cachescout_<name>_total): key -> help text.
PROM_COUNTERS = {
    "requests": "requests CacheScout observed",
    "recognised": "requests whose agent CacheScout recognised",
    "predictions": "next-agent predictions made",
    "predictions_correct": "next-agent predictions that came true",
    "prompt_tokens": "prompt tokens of requests allocated",
    "gpu_hit_tokens": "of which GPU prefix-cache hits (vLLM's, under CacheScout's eviction order)",
    "steered_blocks": "free cached blocks moved to the head of vLLM's free queue",
    "steer_steps": "steps that reordered the free queue",
    "evictions_seen": "evictions of blocks CacheScout tracked",
    "bad_hints": "malformed cachescout.* hints in kv_transfer_params (ignored)",
    "steps": "scheduler steps seen",
    "decision_s": "CPU seconds of the scheduler's thread spent in CacheScout's per-step work",
    "state_flushes": "flushes of this replica's learned counts to the shared state",
    "state_merges": "merged models built from every replica's counts",
    "state_errors": "failed rounds with the shared-state Redis (auth errors included)",
    "state_rejected_blobs": "shared-state entries rejected (corrupt, oversized, incompatible)",
    # Worker side (LMCache's CPU tier and CacheScout's prefetcher), summed over workers.
    "cpu_evictions": "LMCache CPU-tier evictions chosen by CacheScout's policy",
    "cpu_steered": "of which differed from LRU's choice",
    "cpu_no_evictable": "CPU-tier eviction attempts that found every chunk pinned by an unfinished Redis write",
    "store_waits": "LMCache stores that waited (at most store_wait_ms) for CPU-tier room, then fit",
    "stores_dropped": "LMCache stores cut short: no CPU-tier room within store_wait_ms",
    "prefetch_submitted": "anchor prefetches requested from the workers",
    "prefetch_chunks_loaded": "chunks prefetched from Redis into the CPU tier",
    "prefetch_skipped_slower": "prefetches skipped: loading would be slower than recomputing",
    "prefetch_errors": "prefetches that failed (logged; serving unaffected)",
    "prefetch_used": "prefetched chunks read from the CPU tier before being evicted",
    "prefetch_wasted": "prefetched chunks evicted from the CPU tier unread",
}

# Worker-side counters: name reported -> (source, its own name).
_WORKER_COUNTERS = {"cpu_evictions": ("cpu", "evictions"), "cpu_steered": ("cpu", "steered"),
                    "cpu_no_evictable": ("cpu", "no_evictable"), "store_waits": ("store", "waited"),
                    "stores_dropped": ("store", "dropped"), "prefetch_submitted": ("prefetch", "submitted"),
                    "prefetch_chunks_loaded": ("prefetch", "chunks_loaded"),
                    "prefetch_skipped_slower": ("prefetch", "skipped_slower_than_recompute"),
                    "prefetch_errors": ("prefetch", "errors"), "prefetch_used": ("cpu", "prefetch_used"),
                    "prefetch_wasted": ("cpu", "prefetch_wasted")}


class CacheScoutPromMetrics(KVConnectorPromMetrics):
    """vLLM's Prometheus hook for connector stats: one counter per CacheScout count, plus a gauge
    that is 1 once steering has failed and vLLM's own LRU order is in use."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for key, doc in PROM_COUNTERS.items():
            name = "vllm:cachescout_decision_seconds_total" if key == "decision_s" else f"vllm:cachescout_{key}_total"
            metric = self._counter_cls(name=name, documentation=f"CacheScout: {doc}", labelnames=labelnames)
            self.counters[key] = create_metric_per_engine(metric, per_engine_labelvalues)
        fallback = self._gauge_cls(name="vllm:cachescout_fallback_to_lru",
                                   documentation="CacheScout: 1 when steering failed and vLLM's LRU order is used",
                                   labelnames=labelnames, multiprocess_mode="mostrecent")
        self.fallback = create_metric_per_engine(fallback, per_engine_labelvalues)
        degraded = self._gauge_cls(name="vllm:cachescout_shared_state_degraded",
                                   documentation="CacheScout: 1 while the shared learned state is unreachable "
                                                 "or misconfigured (serving and local learning go on)",
                                   labelnames=labelnames, multiprocess_mode="mostrecent")
        self.degraded = create_metric_per_engine(degraded, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self.counters.items():
            v = transfer_stats_data.get(key, 0)
            if v > 0:
                per_engine[engine_idx].inc(v)
        if transfer_stats_data.get("failed"):
            self.fallback[engine_idx].set(1)
        if "state_degraded" in transfer_stats_data:
            self.degraded[engine_idx].set(1 if transfer_stats_data["state_degraded"] > 0 else 0)


class CacheScoutConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.settings = ConnectorSettings.from_extra_config(extra, block_size=vllm_config.cache_config.block_size)
        self._steering: GpuSteering | None = None
        self._failed = False
        self._reported: dict[str, float] = {}
        self._reported_at = float("-inf")
        self._open_requests = 0     # seen by on_new_request, not yet finished
        self._reported_degraded = 0
        self._shared: SharedLearnedState | None = None
        self._decision_s = 0.0
        self._steps = 0
        self._scores_epoch = -1
        self._scores_sent_at = float("-inf")
        self._prefetch_sent: set[str] = set()
        self._prefetcher: Any = None
        self._lmcache: Any = None   # lmcache_tier, on workers where LMCache is installed
        self._store_bounded = False
        if role == KVConnectorRole.WORKER:
            try:
                from . import lmcache_tier
            except ImportError:
                log.info("CacheScout: LMCache is not installed; its CPU-tier policy is not registered")
            else:
                lmcache_tier.register()   # before LMCache's connector (after ours) builds its engine
                self._lmcache = lmcache_tier
                from . import lmcache_cpu
                if lmcache_cpu.install():  # vLLM's CPU backend: LMCache has no connector of its own for it
                    log.info("CacheScout: LMCache will use CacheScout's connector for vLLM's CPU KV layout")
        if role == KVConnectorRole.SCHEDULER:
            self.policy = CacheScoutPolicy(self.settings.policy)
            self._steering = GpuSteering(self.policy, ahead_blocks=self.settings.steer_ahead_blocks,
                                         ahead_factor=self.settings.steer_ahead_factor,
                                         budget_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                                         max_seqs=vllm_config.scheduler_config.max_num_seqs,
                                         steer=self.settings.steer_gpu)
            if self.settings.shared_state is not None:
                self._shared = SharedLearnedState(
                    self.settings.shared_state, half_life=self.settings.policy.transition_half_life,
                    confidence_count_scale=self.settings.policy.confidence_count_scale,
                    model=_model_name(vllm_config), hash_domain=_hash_domain(vllm_config),
                    replica_suffix=_dp_suffix(vllm_config))
                self._shared.attach(self.policy)
                self._shared.start()

    @property
    def steering(self) -> GpuSteering | None:
        return self._steering

    @property
    def decision_s(self) -> float:
        """Seconds spent in CacheScout's per-step work so far."""
        return self._decision_s

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Replace the wall clock (the benchmark replays on a virtual one)."""
        if self._steering is not None:
            self.policy.clock = clock
            self._steering.clock = clock

    @property
    def requires_kv_delivery(self) -> bool:
        # A property, as vLLM declares it: the scheduler reads it once as a flag (a bound method would
        # be truthy and make vLLM drop a preempted request's output as if its KV had to be handed off).
        return False   # a cache: vLLM never waits on us to hand KV over

    # -- scheduler side -------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._steering is None:
            return
        managers = kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1:
            log.warning("CacheScout: %d KV cache groups; GPU steering supports one and is off", len(managers))
            return
        req_to_blocks = managers[0].req_to_blocks
        self._steering.bind(kv_cache_manager.block_pool, lambda rid: req_to_blocks.get(rid) or ())

    def on_new_request(self, request: Request) -> None:
        self._open_requests += 1
        if self._steering is not None and not self._failed:
            self._steering.arrived(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._steering is not None and not self._failed:
            self._steering.matched(request.request_id, num_computed_tokens)
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._steering is not None and not self._failed:
            self._steering.allocated(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        steering = self._steering
        if steering is not None and not self._failed:
            # CPU time of this (the scheduler's) thread: what CacheScout adds to a step, without
            # other processes' or threads' turns on a shared machine.
            t0 = time.thread_time()
            self._steer_safely(steering.step)
            if self._shared is not None:
                try:
                    self._shared.on_step(self.policy)
                except Exception:   # a bad merged model: keep predicting from what we have
                    log.exception("CacheScout: could not install the shared model; sharing is off")
                    self._shared.close(final_flush=False)
                    self._shared = None
            self._steps += 1
            meta = CacheScoutMetadata()
            # Workers get the agents' scores after a rescoring, at most once a second (LMCache's
            # CPU tier changes on that scale; computing them costs a pass over live sessions).
            epoch = self.policy.rescore_epoch
            now = steering.clock()
            if epoch != self._scores_epoch and now - self._scores_sent_at >= _SCORES_INTERVAL_S and not self._failed:
                self._scores_epoch = epoch
                self._scores_sent_at = now
                try:
                    probs = self.policy.next_agent_probabilities()
                    scores = {agent: p * conf for agent, (p, conf) in probs.items()}   # 0 when unsure: LRU
                    meta = CacheScoutMetadata(scores, self._prefetch_requests(probs))
                except Exception:
                    log.exception("CacheScout: could not compute agent scores for the workers")
            self._decision_s += time.thread_time() - t0   # all of CacheScout's work in this step
            return meta
        return CacheScoutMetadata()

    def _prefetch_requests(self, probs: dict[str, tuple[float, float]]) -> list[tuple[list[int], dict]]:
        """Anchors of agents that just became likely enough to be called next (each once per
        crossing of the thresholds, so a steady prediction is not re-sent every rescoring)."""
        cfg = self.policy.cfg
        assert self._steering is not None   # the scheduler side, where prefetches are planned
        anchors = self._steering.anchors
        likely = {a for a, (p, conf) in probs.items()
                  if p >= cfg.prefetch_min_probability and conf >= cfg.prefetch_min_confidence and a in anchors}
        new = likely - self._prefetch_sent
        self._prefetch_sent = likely
        return [anchors[a] for a in sorted(new)]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._open_requests = max(0, self._open_requests - 1)
        if self._steering is not None and not self._failed:
            # Files the blocks the request filled since its allocation: CacheScout's work, timed.
            t0 = time.thread_time()
            self._steer_safely(self._steering.finished, request)
            self._decision_s += time.thread_time() - t0
        return False, None

    def _steer_safely(self, work: Callable[..., None], *args: Any) -> None:
        """Run steering work; on any failure never take the scheduler down: steering goes off
        for good and vLLM's own order stands."""
        try:
            work(*args)
        except Exception:
            self._failed = True
            log.exception("CacheScout: steering failed; vLLM's LRU order is used from now on")

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counters since the last report; vLLM asks every step, we answer about once a second."""
        if self._steering is None:
            return self._worker_stats()
        t = self._steering.clock()
        # About once a second, and at once when the last request in flight has finished: an idle
        # server takes no steps, so what its last requests did would otherwise never be reported.
        if t - self._reported_at < 1.0 and self._open_requests:
            return None
        self._reported_at = t
        now: dict[str, float] = dict(self._steering.stats)
        for k in ("predictions", "predictions_correct", "requests", "recognised"):
            now[k] = self.policy.stats.get(k, 0)
        now["decision_s"] = self._decision_s
        now["steps"] = self._steps
        now["failed"] = int(self._failed)
        if self._shared is not None:
            st = self._shared.stats
            now["state_flushes"] = st["flush_ok"]
            now["state_merges"] = st["merges"]
            now["state_errors"] = st["errors"] + st["auth_errors"] + st["internal_errors"]
            now["state_rejected_blobs"] = st["rejected_blobs"]
        delta = self._since_reported(now)
        if self._shared is not None:
            # A level, not a count: sent while degraded and once when it clears.
            degraded = int(self._shared.degraded)
            if degraded or self._reported_degraded:
                delta["state_degraded"] = degraded
            self._reported_degraded = degraded
        return CacheScoutStats(data=delta) if delta else None

    def _worker_stats(self) -> KVConnectorStats | None:
        """A worker's counts (CPU-tier policy, prefetcher) since its last report; vLLM sums them
        with the scheduler's."""
        if self._lmcache is None:
            return None
        t = time.monotonic()
        if t - self._reported_at < 1.0:
            return None
        self._reported_at = t
        sources = {"cpu": self._lmcache.cpu_tier_stats(), "store": self._lmcache.STORE_STATS,
                   "prefetch": self._prefetcher.stats if self._prefetcher is not None else {}}
        delta = self._since_reported({name: sources[src].get(key, 0) for name, (src, key) in _WORKER_COUNTERS.items()})
        return CacheScoutStats(data=delta) if delta else None

    def _since_reported(self, now: dict[str, Any]) -> dict[str, Any]:
        """The counters that moved since the last report, as differences; `now` becomes the last."""
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items() if v != self._reported.get(k, 0)}
        self._reported = now
        return delta

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return CacheScoutStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return CacheScoutPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side: KV moves are LMCache's; CacheScout ranks its CPU tier -------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._lmcache is None:
            return
        if not self._store_bounded:   # LMCache's connector builds its engine after ours: bind once it exists
            engine = self._lmcache.current_engine()
            if engine is not None:
                self._lmcache.bound_store_waits(engine, self.settings.store_wait_ms / 1e3)
                self._store_bounded = True
        scores = getattr(connector_metadata, "agent_scores", None)
        if scores is not None:
            self._lmcache.RANKING.update(scores)
        for tokens, configs in getattr(connector_metadata, "prefetch", None) or ():
            prefetcher = self._prefetcher or self._start_prefetcher()
            if prefetcher is not None:
                prefetcher.submit(tokens, {k[len("lmcache.tag."):]: v for k, v in configs.items()
                                           if k.startswith("lmcache.tag.")})

    def _start_prefetcher(self) -> Any:
        """The prefetcher of this worker's LMCache engine (built by LMCache's connector), if any."""
        engine = self._lmcache.current_engine()
        if engine is None:
            return None
        # Worth prefetching only if LMCache's later load from the CPU tier beats recomputing.
        cost = RebuildCost(self.settings.policy)
        bs = self.settings.policy.block_size
        self._prefetcher = self._lmcache.Prefetcher(
            engine, worth_it=lambda tokens: cost.worth_loading("cpu", max(1, tokens // bs)))
        return self._prefetcher

    def shutdown(self) -> None:
        if self._shared is not None:
            self._shared.close()   # last flush, bounded by the client's short timeouts
            self._shared = None
        if self._prefetcher is not None:
            self._prefetcher.close()
        # vLLM shuts connectors down in order, ours before LMCache's: make LMCache's safe to run.
        if self._lmcache is not None:
            self._lmcache.defuse_shutdown_hang()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def _model_name(vllm_config: VllmConfig) -> str:
    """The served model's name as a key part (characters Redis keys and hash tags can carry)."""
    mc = vllm_config.model_config
    served = getattr(mc, "served_model_name", None)
    if isinstance(served, (list, tuple)):      # `--served-model-name a b`: the first is the model's name
        served = served[0] if served else None
    name = served if isinstance(served, str) and served else mc.model
    return "".join(c if c.isalnum() or c in "._:/@=+-" else "-" for c in str(name))[:128] or "model"


def _dp_suffix(vllm_config: VllmConfig) -> str:
    """Each data-parallel rank runs its own scheduler, hence its own writer: name them apart."""
    pc = vllm_config.parallel_config
    return f"-dp{pc.data_parallel_rank}" if getattr(pc, "data_parallel_size", 1) > 1 else ""


def _hash_domain(vllm_config: VllmConfig) -> str:
    """Names agents are derived from vLLM's block hashes, which depend on the hash algorithm and
    its seed (PYTHONHASHSEED); replicas can share what they learned only if both agree. A digest
    of the two (a random seed gives a random digest, so such replicas refuse to share)."""
    import hashlib

    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

    algo = vllm_config.cache_config.prefix_caching_hash_algo
    seed = resolve_none_hash_seed(get_hash_fn_by_name(algo))
    return hashlib.sha256(f"{algo}\0{seed}".encode()).hexdigest()[:16]
