"""CacheScout on vLLM's scheduler: the policy core, the GPU steering, the shared state, and what
each step sends the workers.

`CacheScoutConnector` (vllm_connector.py) hands its scheduler-role callbacks here. Each does O(1)
work or the step's batch of it, timed on this thread's CPU clock. The first failure inside
CacheScout turns it off for good (logged once, counted in the `failed` gauge): from then on every
callback returns at once and vLLM's own LRU order stands.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cachescout.policy import CacheScoutPolicy

from .gpu_steering import GpuSteering
from .gpu_warmup import WarmupSender
from .lmcache_model import HOLD_SHARE, CpuTierModel, lmcache_configs
from .reporting import CacheScoutMetadata, CounterReport
from .settings import ConnectorSettings
from .shared_state import SharedLearnedState

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

log = logging.getLogger("cachescout.connector")
_SCORES_INTERVAL_S = 1.0   # agent scores go to the workers at most this often
_REPORT_INTERVAL_S = 1.0   # counters go to vLLM's metrics about this often
_POLICY_COUNTERS = ("predictions", "predictions_correct", "requests", "recognised")
_WARMUP_CHECK_S = 0.2      # GPU warm-ups are considered at most this often
_HOLD_TOKENS_PER_STEP = 1 << 18   # queued requests' tokens sent to the workers per step, at most
_HOLDS_OUTSTANDING = 256          # queued requests held at once, at most (QueuedHolds.max_queued)


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, *, budget_tokens: int, max_seqs: int, block_bytes: int = 0,
                 shared: Callable[[], SharedLearnedState] | None = None,
                 warmup: Callable[[], WarmupSender] | None = None) -> None:
        """`shared` builds the shared state (None: this replica learns alone); `warmup` the sender
        of GPU warm-ups (None: none are sent); `block_bytes`: one GPU block's KV over every layer
        (to size LMCache's CPU tier in blocks; 0: from the policy's `kv_bytes_per_token`)."""
        self.settings = settings
        self.policy = CacheScoutPolicy(settings.policy)
        self.steering = GpuSteering(self.policy, ahead_blocks=settings.steer_ahead_blocks,
                                    ahead_factor=settings.steer_ahead_factor, budget_tokens=budget_tokens,
                                    max_seqs=max_seqs, steer=settings.steer_gpu)
        cpu_blocks = 0
        if settings.lmcache_cpu_gib > 0:
            # LMCache's CPU tier, followed from the prompts it sees (lmcache_model.py), in GPU blocks.
            block_bytes = block_bytes or settings.policy.block_size * settings.policy.kv_bytes_per_token
            cpu_blocks = round(settings.lmcache_cpu_gib * 2**30 / block_bytes)
            self.steering.cpu_tier = CpuTierModel(cpu_blocks, self.policy.block_backed, holds=settings.hold_queued)
        self.failed = False
        self.decision_s = 0.0      # this thread's CPU seconds in CacheScout's work
        self.steps = 0
        self.open_requests = 0     # seen by `arrived`, not yet finished
        self.report = CounterReport()
        self._scores_epoch = -1
        self._scores_sent_at = float("-inf")
        self._prefetch_sent: set[str] = set()
        # Queued requests' CPU-tier holds (lmcache_tier.QueuedHolds on the workers): a request still
        # waiting at the end of a step is sent to be held, in arrival order; once admitted or ended,
        # to be released. Both shrink as requests are admitted. What goes to the workers is bounded
        # (their copy travels with the step's metadata, serialized on this thread): a request's
        # tokens up to what a hold may pin (half the tier), `_HOLD_TOKENS_PER_STEP` per step, and at
        # most `_HOLDS_OUTSTANDING` held at once; the rest are sent as the queue moves.
        self.holds_on = settings.hold_queued and cpu_blocks > 0
        self._hold_tokens = max(1, int(HOLD_SHARE * cpu_blocks)) * settings.policy.block_size
        self._hold_new: dict[str, Request] = {}   # waiting, not sent yet (arrival order)
        self._hold_sent: set[str] = set()         # sent to be held, not yet released
        self._releases: list[str] = []
        self.warmup = warmup() if warmup is not None else None
        self._warm_checked_at = float("-inf")
        self.warm_stats: Counter[str] = Counter()
        self.shared: SharedLearnedState | None = None
        if shared is not None:
            self.shared = shared()
            self.shared.attach(self.policy)
            self.shared.start()

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Replace the wall clock (the benchmark replays on a virtual one)."""
        self.policy.clock = clock
        self.steering.clock = clock

    # -- vLLM's scheduler callbacks -------------------------------------------------------------
    def bind(self, kv_cache_manager: KVCacheManager) -> None:
        managers = kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1:
            log.warning("CacheScout: %d KV cache groups; GPU steering supports one and is off", len(managers))
            return
        req_to_blocks = managers[0].req_to_blocks
        self.steering.bind(kv_cache_manager.block_pool, lambda rid: req_to_blocks.get(rid) or ())

    def arrived(self, request: Request) -> None:
        self.open_requests += 1
        if self.holds_on and not self.failed:
            self._hold_new[request.request_id] = request
        self._safely(self.steering.arrived, request)

    def matched(self, request_id: str, num_computed_tokens: int) -> None:
        self._safely(self.steering.matched, request_id, num_computed_tokens)

    def allocated(self, request: Request) -> None:
        self._unhold(request.request_id)
        self._safely(self.steering.allocated, request)

    def _unhold(self, rid: str) -> None:
        """Admitted (LMCache's lookup has pinned what it loads) or ended: its hold goes."""
        if self._hold_new.pop(rid, None) is None and rid in self._hold_sent:
            self._hold_sent.discard(rid)
            self._releases.append(rid)

    def _holds_meta(self, meta: CacheScoutMetadata) -> CacheScoutMetadata:
        """Add the step's holds (waiting requests not sent yet, earliest first, within the bounds)
        and releases to `meta`."""
        pending = self._hold_new
        if pending:
            holds = []
            budget = _HOLD_TOKENS_PER_STEP
            sent = self._hold_sent
            while pending and budget > 0 and len(sent) < _HOLDS_OUTSTANDING:
                rid = next(iter(pending))
                request = pending.pop(rid)
                tokens = request.prompt_token_ids
                if not tokens:
                    continue
                tokens = tokens[:self._hold_tokens]
                budget -= len(tokens)
                holds.append((rid, tokens, lmcache_configs(request)))
                sent.add(rid)
            meta.holds = holds
        if self._releases:
            meta.releases, self._releases = self._releases, []
        return meta

    def finished(self, request: Request) -> None:
        """Files the blocks the request filled since its allocation: CacheScout's work, timed."""
        self.open_requests = max(0, self.open_requests - 1)
        self._unhold(request.request_id)
        if not self.failed:
            t0 = time.thread_time()
            self._safely(self.steering.finished, request)
            # vLLM takes no step while no request is in flight: the end of the last one is the
            # last chance to warm up what the next call will need.
            if self.warmup is not None:
                self._warm_up()
            self.decision_s += time.thread_time() - t0

    def step(self) -> CacheScoutMetadata:
        """Once per scheduler step: steer, install a merged model if one is ready, and send the
        workers the agents' scores when they changed."""
        if self.failed:
            if not (self._hold_sent or self._hold_new):
                return CacheScoutMetadata()
            self._hold_sent.clear()   # off for good: the workers let every hold go, once
            self._hold_new.clear()
            self._releases = []
            return CacheScoutMetadata(release_all=True)
        # CPU time of this (the scheduler's) thread: what CacheScout adds to a step, without
        # other processes' or threads' turns on a shared machine.
        t0 = time.thread_time()
        self._safely(self.steering.step)
        if self.shared is not None:
            try:
                self.shared.on_step(self.policy)
            except Exception:   # a bad merged model: keep predicting from what we have
                log.exception("CacheScout: could not install the shared model; sharing is off")
                self.shared.close(final_flush=False)
                self.shared = None
        if self.warmup is not None:
            self._warm_up()
        self.steps += 1
        meta = CacheScoutMetadata()
        # Workers get the agents' scores after a rescoring, at most once a second (LMCache's
        # CPU tier changes on that scale; computing them costs a pass over live sessions).
        epoch = self.policy.rescore_epoch
        now = self.steering.clock()
        if epoch != self._scores_epoch and now - self._scores_sent_at >= _SCORES_INTERVAL_S and not self.failed:
            self._scores_epoch = epoch
            self._scores_sent_at = now
            try:
                probs = self.policy.next_agent_probabilities()
                scores = {agent: p * conf for agent, (p, conf) in probs.items()}   # 0 when unsure: LRU
                meta = CacheScoutMetadata(scores, self._prefetch_requests(probs))
            except Exception:
                log.exception("CacheScout: could not compute agent scores for the workers")
        meta = self._holds_meta(meta)
        self.decision_s += time.thread_time() - t0   # all of CacheScout's work in this step
        return meta

    def _prefetch_requests(self, probs: dict[str, tuple[float, float]]) -> list[tuple[list[int], dict]]:
        """Anchors of agents that just became likely enough to be called next (each once per
        crossing of the thresholds, so a steady prediction is not re-sent every rescoring)."""
        cfg = self.policy.cfg
        anchors = self.steering.anchors
        likely = {a for a, (p, conf) in probs.items()
                  if p >= cfg.prefetch_min_probability and conf >= cfg.prefetch_min_confidence and a in anchors}
        new = likely - self._prefetch_sent
        self._prefetch_sent = likely
        return [anchors[a] for a in sorted(new)]

    def _warm_up(self) -> None:
        """Send a warm-up of the most likely next agent's anchor (gpu_warmup.py) when: none is in
        flight; nothing waits and every running request decodes (the prefill uses compute they
        leave unused); the agent is predicted as prefetches are (`prefetch_min_probability`,
        `prefetch_min_confidence`, which carry the LRU guard's trust: when the model is not
        trusted, nothing is sent); its anchor is not all on the GPU; the blocks it needs are empty
        or predicted dead (`room_is_dead`: a warm-up never displaces a likely hit); and the
        prefetches judged so far were mostly used. One per agent until that agent is called."""
        warmup = self.warmup
        steering = self.steering
        now = steering.clock()
        if warmup is None or warmup.busy or now - self._warm_checked_at < _WARMUP_CHECK_S:
            return
        try:
            if not steering.prefill_idle():
                return
            self._warm_checked_at = now
            self.warm_stats["warmup_idle_checks"] += 1
            policy = self.policy
            cfg = policy.cfg
            probs = policy.next_agent_probabilities()
            likely = sorted(((p, conf, a) for a, (p, conf) in probs.items()
                             if p >= cfg.prefetch_min_probability and a in steering.anchors
                             and a not in steering.warmed), reverse=True)
            unsure = False
            for _, conf, agent in likely:
                missing = steering.anchor_missing(agent)
                if not missing:
                    continue
                if conf < cfg.prefetch_min_confidence:
                    unsure = True
                    continue
                if not policy.prefetch_round():
                    return
                if steering.empty_blocks(missing + 1) <= missing and not policy.room_is_dead(now):
                    self.warm_stats["warmups_no_room"] += 1
                    return
                tokens, tags = steering.anchors[agent]
                if warmup.offer(agent, tokens, tags):
                    steering.warmed.add(agent)
                    self.warm_stats["warmups_offered"] += 1
                return
            # Nothing sent, though a likely agent's anchor was missing: the model was not sure enough.
            self.warm_stats["warmups_unsure"] += unsure
        except Exception:
            log.exception("CacheScout: GPU warm-ups failed and are off; serving and steering go on")
            warmup.close()
            self.warmup = None

    def _safely(self, work: Callable[..., None], *args: Any) -> None:
        """Run steering work unless CacheScout is off; on any failure never take the scheduler
        down: steering goes off for good and vLLM's own order stands."""
        if self.failed:
            return
        try:
            work(*args)
        except Exception:
            self.failed = True
            log.exception("CacheScout: steering failed; vLLM's LRU order is used from now on")

    # -- reporting ------------------------------------------------------------------------------
    def counters(self) -> dict[str, Any] | None:
        """The counters that moved since the last report, about once a second (and at once when
        the last request in flight has finished: an idle server takes no steps, so what its last
        requests did would otherwise never be reported); None when there is nothing to send."""
        t = self.steering.clock()
        if t - self.report.at < _REPORT_INTERVAL_S and self.open_requests:
            return None
        self.report.at = t
        now: dict[str, float] = dict(self.steering.stats)
        for k in _POLICY_COUNTERS:
            now[k] = self.policy.stats.get(k, 0)
        now.update(self.policy.guard_counters())
        now.update(self.warm_stats)
        if self.warmup is not None:
            now.update(self.warmup.stats)
        now["decision_s"] = self.decision_s
        now["steps"] = self.steps
        now["failed"] = int(self.failed)
        shared = self.shared
        if shared is not None:
            st = shared.stats
            now["state_flushes"] = st["flush_ok"]
            now["state_merges"] = st["merges"]
            now["state_errors"] = st["errors"] + st["auth_errors"] + st["internal_errors"]
            now["state_rejected_blobs"] = st["rejected_blobs"]
        delta = self.report.since_last(now)
        if shared is not None:
            # A level, not a count: in every report, so that a report vLLM drops or sends to
            # another front-end cannot leave the gauge on a stale value.
            delta["state_degraded"] = int(shared.degraded)
        return delta or None

    def shutdown(self) -> None:
        if self.warmup is not None:
            self.warmup.close()
            self.warmup = None
        if self.shared is not None:
            self.shared.close()   # last flush, bounded by the client's short timeouts
            self.shared = None
