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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from cachescout.policy import CacheScoutPolicy, measured_gain

from .gpu_steering import GpuSteering
from .gpu_warmup import LOWEST_PRIORITY, WarmupSender
from .reporting import CacheScoutMetadata
from .scheduler_side import SchedulerSide
from .settings import ConnectorSettings
from .shared_state import SharedLearnedState
from .worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["CacheScoutConnector", "CacheScoutMetadata", "CacheScoutPromMetrics", "CacheScoutStats", "PROM_COUNTERS"]


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
        gain = measured_gain(d)
        if gain is not None:
            d["guard_gain"] = round(gain, 4)
        if d.get("predictions"):
            d["prediction_accuracy"] = round(d.get("predictions_correct", 0) / d["predictions"], 4)
        if "state_degraded" in d:
            d["state_degraded"] = int(d["state_degraded"] > 0)   # a level: summed reports say "some were"
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
    "guard_compared": "sampled block accesses the LRU guard compared with its shadow LRU cache",
    "guard_hits": "of which the GPU prefix cache hit (under CacheScout's order)",
    "guard_lru_hits": "of which plain LRU would have hit (queued requests' blocks kept last)",
    "guard_trusted_windows": "guard windows in which the learned order was used",
    "guard_lru_windows": "guard windows on plain LRU order (after the order lost to LRU)",
    "guard_cuts": "times the guard fell back to plain LRU order",
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
    "queued_holds": "queued requests whose CPU-tier prefix was held from arrival to admission",
    "hold_chunks": "CPU-tier chunks pinned for queued requests",
    "holds_cut_by_limit": "holds cut short: half the CPU tier was already held for earlier queued requests",
    "holds_dropped": "queued requests not held: too many already waiting to be held",
    "holds_expired": "holds let go after an hour while their request still waited",
    "hold_errors": "holds that failed (logged; serving unaffected)",
    # GPU warm-ups (gpu_warmup.py) and what they are for: a call finding its anchor on the GPU.
    "anchor_calls": "calls of an agent whose anchor CacheScout knows",
    "anchor_on_gpu": "of which found the whole anchor in the GPU prefix cache",
    "warmed_calls": "calls of an agent whose anchor was warmed up since its previous call",
    "warmed_on_gpu": "of which found the whole anchor in the GPU prefix cache",
    "warmups_offered": "GPU warm-ups of a predicted agent's anchor handed to the sender",
    "warmups_sent": "GPU warm-up requests the server answered",
    "warmups_failed": "GPU warm-up requests that failed (logged once; serving unaffected)",
    "warmups_no_room": "GPU warm-ups not sent: they would have displaced blocks predicted to be reused",
    "warmup_idle_checks": "checks for a warm-up made while nothing waited and every running request decoded",
    "warmups_unsure": "of which sent nothing though a likely agent's anchor was missing: the model was not sure enough",
    "warmup_tokens": "prompt tokens of GPU warm-up requests (not counted in prompt_tokens)",
    "warmup_blocks": "blocks GPU warm-ups brought into the GPU prefix cache",
}

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
    """vLLM's view of CacheScout: one instance per role, each a thin shell over its half
    (scheduler_side.py, worker_side.py)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.settings = settings = ConnectorSettings.from_extra_config(
            extra, block_size=vllm_config.cache_config.block_size)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.WORKER:
            self.worker_side = WorkerSide(settings)
        elif role == KVConnectorRole.SCHEDULER:
            shared, warmup_url = settings.shared_state, settings.gpu_warmup_url
            self.scheduler_side = SchedulerSide(
                settings, budget_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                block_bytes=_block_bytes(kv_cache_config),
                max_seqs=vllm_config.scheduler_config.max_num_seqs,
                shared=None if shared is None else lambda: SharedLearnedState(
                    shared, half_life=settings.policy.transition_half_life,
                    confidence_count_scale=settings.policy.confidence_count_scale,
                    model=_model_name(vllm_config), hash_domain=_hash_domain(vllm_config),
                    replica_suffix=_dp_suffix(vllm_config)),
                warmup=None if warmup_url is None else lambda: WarmupSender(
                    warmup_url, _served_name(vllm_config), timeout_s=settings.gpu_warmup_timeout_s,
                    priority=LOWEST_PRIORITY if vllm_config.scheduler_config.policy == "priority" else None))

    @property
    def policy(self) -> CacheScoutPolicy:
        """The scheduler's policy core."""
        if self.scheduler_side is None:
            raise AttributeError("a worker-role CacheScoutConnector has no policy (it lives on the scheduler)")
        return self.scheduler_side.policy

    @property
    def steering(self) -> GpuSteering | None:
        return self.scheduler_side.steering if self.scheduler_side is not None else None

    @property
    def decision_s(self) -> float:
        """Seconds spent in CacheScout's per-step work so far."""
        return self.scheduler_side.decision_s if self.scheduler_side is not None else 0.0

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Replace the wall clock (the benchmark replays on a virtual one)."""
        if self.scheduler_side is not None:
            self.scheduler_side.set_clock(clock)

    def _scheduler(self) -> SchedulerSide:
        if self.scheduler_side is None:   # vLLM calls scheduler callbacks on the scheduler's connector only
            raise RuntimeError("CacheScoutConnector: a scheduler-side call on a worker-role connector")
        return self.scheduler_side

    @property
    def requires_kv_delivery(self) -> bool:
        # A property, as vLLM declares it: the scheduler reads it once as a flag (a bound method would
        # be truthy and make vLLM drop a preempted request's output as if its KV had to be handed off).
        return False   # a cache: vLLM never waits on us to hand KV over

    # -- scheduler side -------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler().bind(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        self._scheduler().arrived(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._scheduler().matched(request.request_id, num_computed_tokens)
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().allocated(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().step()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().finished(request)
        return False, None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counters since the last report; vLLM asks every step, each half answers about once a second."""
        if self.scheduler_side is not None:
            delta = self.scheduler_side.counters()
        elif self.worker_side is not None:
            delta = self.worker_side.counters()
        else:
            delta = None
        return CacheScoutStats(data=delta) if delta else None

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
        if self.worker_side is not None:
            self.worker_side.received(connector_metadata)

    def shutdown(self) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()
        if self.worker_side is not None:
            self.worker_side.shutdown()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def _served_name(vllm_config: VllmConfig) -> str:
    """The name clients give the model in API requests."""
    mc = vllm_config.model_config
    served = getattr(mc, "served_model_name", None)
    if isinstance(served, (list, tuple)):      # `--served-model-name a b`: the first is the model's name
        served = served[0] if served else None
    return served if isinstance(served, str) and served else str(mc.model)


def _block_bytes(kv_cache_config: KVCacheConfig | None) -> int:
    """Bytes of one GPU block over every layer from vLLM's KV cache tensors; 0 where there are none
    (the benchmark's scheduler): SchedulerSide then takes the policy's `kv_bytes_per_token`."""
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None) or ()
    blocks = getattr(kv_cache_config, "num_blocks", 0) or 0
    total = sum(int(t.size) for t in tensors)
    return max(total // blocks, 1) if total > 0 and blocks > 0 else 0


def _model_name(vllm_config: VllmConfig) -> str:
    """The served model's name as a key part (characters Redis keys and hash tags can carry)."""
    name = _served_name(vllm_config)
    return "".join(c if c.isalnum() or c in "._:/@=+-" else "-" for c in name)[:128] or "model"


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
