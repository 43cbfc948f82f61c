"""Eviction policies the replay compares, by name. Look-ups go through one registry."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import cast

from cachescout.policy import CacheScoutPolicy, Hints, InputError, PolicyConfig, measured_gain, output_ending

from .belady import BeladyPolicy
from .oracles import KnowsDeadLRU, KnowsEndsLRU
from .baselines import ContinuumPolicy, KVFlowPolicy
from .replay import LMCacheLRUPolicy, LRUPolicy, ReplayPolicy, Request
from .workloads import Session


class CacheScoutReplay(ReplayPolicy):
    """CacheScout's policy core steering the GPU prefix cache's eviction order."""

    def __init__(self, config: PolicyConfig | None = None, *, hints: bool = False, tokens: bool = True,
                 prefetch: bool = True, endings: bool = True, name: str = "cachescout") -> None:
        self.name = name
        # A queued request's CPU-tier prefix is a known future, not a prediction: held whatever the
        # model says, as its GPU blocks are (`CacheScoutPolicy._want`). Set here, not on the class:
        # the compiled engine reads the compiled base's attribute.
        self.holds_queued = True
        self.now = 0.0
        self.core = CacheScoutPolicy(config, clock=lambda: self.now)
        self.hints = hints
        self.tokens = tokens  # False: block hashes only, as a trace without token ids gives
        self.do_prefetch = prefetch
        self.endings = endings  # False: no call's ending is passed (a server whose outputs all end alike)
        self._planned_at = -1.0
        # prefetched key -> (the agent, the session) it was planned for
        self._agent_of: dict[Hashable, tuple[str | None, Hashable | None]] = {}
        self.observations: list = []   # (request, Observation), for accuracy figures

    def arrived(self, req: Request, now: float) -> None:
        self.now = now
        hints = Hints(agent=req.agent, session=str(req.session.session_id)) if self.hints else None
        tokens = req.tokens if self.tokens else None
        content = getattr(req.call, "chunks", None) if self.tokens and tokens is None else None
        # The replay's block keys are hash values (ints), typed Hashable for the compiled engine.
        obs = self.core.observe(req, cast(list[int], req.hashes), tokens=tokens, content=content or None,
                                hints=hints, now=now)
        self.observations.append((req, obs))

    def reused(self, keys: Sequence[Hashable], now: float) -> None:
        self.core.blocks_reused(keys)

    def admitted(self, req: Request, keys: Sequence[Hashable], num_cached: int, now: float) -> None:
        self.now = now
        bs = self.core.cfg.block_size
        self.core.admit_blocks(req, keys, num_cached, req.hashes[:(req.prompt_len - 1) // bs])

    def cached(self, req: Request, keys: Sequence[Hashable], now: float) -> None:
        self.core.extend_blocks(req, keys)

    def freed(self, keys: Sequence[Hashable], now: float) -> None:
        self.core.blocks_freed(keys, now)

    def evict(self, n: int, now: float) -> list[Hashable]:
        self.now = now
        return self.core.evict(n, now)

    def backed(self, added: Sequence[Hashable], dropped: Sequence[Hashable]) -> None:
        for key in added:
            self.core.block_backed(key, True)
        for key in dropped:
            self.core.block_backed(key, False)

    def prefetch(self, engine, now: float) -> list[Hashable]:
        """Plan at most once per rescoring interval: anchors the next calls will need."""
        if not self.do_prefetch or now - self._planned_at < self.core.cfg.rescore_interval_s:
            return []
        self._planned_at = now
        self.now = now
        self._agent_of = {}
        keys: list[Hashable] = []
        for action in self.core.plan_prefetch(engine.where, now=now):
            for key in action.keys:
                self._agent_of[key] = (action.agent, action.session)
            keys.extend(action.keys)
        return keys

    def prefetched(self, keys: Sequence[Hashable], now: float) -> None:
        by_target: dict[tuple[str | None, Hashable | None], list[Hashable]] = {}
        for key in keys:
            by_target.setdefault(self._agent_of.pop(key, (None, None)), []).append(key)
        for (agent, session), group in by_target.items():
            self.core.blocks_prefetched(group, agent, now, session=session)

    def finished(self, req: Request, now: float) -> None:
        # How the call ended, as a server sees it: its last output tokens; a trace has no tokens
        # but may record the stop reason ("tool_use", "end_turn"), which is what they show.
        call = req.call
        if hasattr(call, "output"):
            if self.tokens:
                ending = output_ending(call.output) if self.endings else None
                self.core.finish(req, now, output_tokens=call.output, ending=ending)
            else:
                self.core.finish(req, now)
        else:
            ending = call.end if self.endings else None
            self.core.finish(req, now, output_chunks=call.output_chunks if self.tokens else None, ending=ending)


def guard_gain(policy: ReplayPolicy) -> float | None:
    """CacheScout's own measure of its order against plain LRU over a run (the LRU guard's hits
    minus its shadow's, per sampled access compared); None for other policies or no comparison."""
    if not isinstance(policy, CacheScoutReplay):
        return None
    return measured_gain(policy.core.guard_counters())


# Each factory gets the policy settings and the workload (only belady looks at the future).
REGISTRY: dict[str, Callable[[PolicyConfig, Sequence[Session]], ReplayPolicy]] = {
    "lru": lambda cfg, sessions: LRUPolicy(),
    "cachescout": lambda cfg, sessions: CacheScoutReplay(cfg),
    "cachescout-hints": lambda cfg, sessions: CacheScoutReplay(cfg, hints=True, name="cachescout-hints"),
    "cachescout-hashonly": lambda cfg, sessions: CacheScoutReplay(cfg, tokens=False, name="cachescout-hashonly"),
    "cachescout-noprefetch": lambda cfg, sessions: CacheScoutReplay(cfg, prefetch=False, name="cachescout-noprefetch"),
    # No call's ending passed: sessions without a known agent are judged by the waits of all calls.
    "cachescout-noendings": lambda cfg, sessions: CacheScoutReplay(cfg, endings=False, name="cachescout-noendings"),
    # Never confident: LRU order with queued requests' blocks kept last, what CacheScout does
    # without its model (so the model's own part is `cachescout` against this).
    "cachescout-unsure": lambda cfg, sessions: CacheScoutReplay(dataclasses.replace(cfg, min_confidence=1.0),
                                                                name="cachescout-unsure"),
    "lmcache-lru": lambda cfg, sessions: LMCacheLRUPolicy(),
    "continuum": lambda cfg, sessions: ContinuumPolicy(),
    "kvflow": lambda cfg, sessions: KVFlowPolicy(sessions, cfg.block_size),
    "belady": lambda cfg, sessions: BeladyPolicy(sessions, cfg.block_size),
    # LRU told which blocks are never used again / which sessions are over (bench/oracles.py).
    "lru-knows-dead": lambda cfg, sessions: KnowsDeadLRU(sessions, cfg.block_size),
    "lru-knows-ends": lambda cfg, sessions: KnowsEndsLRU(sessions, cfg.block_size),
}


def make_policy(name: str, config: PolicyConfig, sessions: Sequence[Session] = ()) -> ReplayPolicy:
    try:
        factory = REGISTRY[name]
    except KeyError:
        raise InputError(f"unknown policy {name!r}; choose from {', '.join(sorted(REGISTRY))}") from None
    return factory(config, sessions)
