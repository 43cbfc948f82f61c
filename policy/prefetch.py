"""Prefetch planning: bring the anchors and contexts the next calls will most likely need closer to
the GPU.

Runs between requests, never on the serving path. Candidates are for the calls expected within
`prefetch_lead_s` (core.py `plan_prefetch`): agents' anchors whose probability of being called next
by at least one session expected to call that soon clears `prefetch_min_probability`, and those
sessions' contexts under a next agent likely enough (a session with no agent recognised is not a
candidate). A context
takes only room the eviction order gives up before its own blocks (`PrefetchCandidate.room`). All
are predicted by models whose confidence clears `prefetch_min_confidence`. For each, the planner
looks at where the blocks are: blocks in the CPU tier are planned CPU -> GPU, blocks only in Redis
are planned Redis -> CPU (one tier closer; a later step moves them on). Only the leading run of
blocks present somewhere is considered, since a prefix hit stops at the first block that is nowhere.
A candidate whose CPU -> GPU load (the one the request would wait for) is slower than recomputing it
is skipped, and the plan stays within the in-flight byte budget (a context larger than what is left
of it brings its leading blocks) and the per-step action limit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence

from .config import PolicyConfig
from .costs import RebuildCost

Locate = Callable[[Hashable], "str | None"]  # block key -> "gpu", "cpu", "redis" or None


@dataclasses.dataclass(frozen=True, slots=True)
class PrefetchCandidate:
    agent: str | None           # the agent whose anchor, or under whom the session's context
    probability: float          # P(the agent is called next by some session)
    anchor_keys: Sequence[Hashable]  # the blocks to bring closer, in prompt order
    confidence: float = 1.0     # of the rows behind `probability`
    session: Hashable | None = None  # set for a session's context (else: the agent's anchor)
    room: int | None = None     # the most blocks it may bring to the GPU, its own and others' (None: any)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefetchAction:
    agent: str | None
    session: Hashable | None    # whose context (None: the agent's anchor)
    src: str                    # "cpu" or "redis"
    dst: str                    # "gpu" or "cpu"
    keys: tuple[Hashable, ...]  # blocks to move, in prompt order
    probability: float
    bytes: int
    load_s: float
    recompute_s: float


class PrefetchPlanner:
    def __init__(self, cfg: PolicyConfig, cost: RebuildCost) -> None:
        self.cfg = cfg
        self.cost = cost

    def plan(self, candidates: Sequence[PrefetchCandidate], locate: Locate,
             inflight_bytes: int = 0) -> list[PrefetchAction]:
        """The actions for `candidates`, most valuable first. A candidate with `room` brings at
        most that many blocks to the GPU less what the candidates before it took (each room
        counts the free blocks evicted before some key: the rooms nest), its leading ones."""
        cfg = self.cfg
        if cfg.prefetch_max_actions == 0:
            return []
        budget = cfg.prefetch_max_inflight_bytes - inflight_bytes
        ranked = sorted((c for c in candidates if c.probability >= cfg.prefetch_min_probability
                         and c.confidence >= cfg.prefetch_min_confidence),
                        key=lambda c: (-c.probability * len(c.anchor_keys), c.agent or ""))
        actions: list[PrefetchAction] = []
        taken = 0   # blocks planned to the GPU so far
        block_bytes = self.cost.block_bytes
        for cand in ranked:
            to_gpu: list[Hashable] = []
            to_cpu: list[Hashable] = []
            at_gpu: list[int] = []    # their prompt positions (what recomputing them costs)
            at_cpu: list[int] = []
            for i, key in enumerate(cand.anchor_keys):
                where = locate(key)
                if where is None:
                    break  # a prefix hit cannot reach past a block that is nowhere
                if where == "cpu":
                    to_gpu.append(key)
                    at_gpu.append(i)
                elif where == "redis":
                    to_cpu.append(key)
                    at_cpu.append(i)
            if cand.room is not None and len(to_gpu) > cand.room - taken:
                fits = max(cand.room - taken, 0)
                del to_gpu[fits:]
                del at_gpu[fits:]
            for src, dst, keys, at in (("cpu", "gpu", to_gpu, at_gpu), ("redis", "cpu", to_cpu, at_cpu)):
                if not keys or len(actions) >= cfg.prefetch_max_actions:
                    continue
                if cand.session is not None and len(keys) * block_bytes > budget:
                    # A conversation's context can outgrow the budget: its leading blocks still
                    # turn that much of the next call's load into a GPU hit.
                    fits = max(budget // block_bytes, 0)
                    del keys[fits:]
                    del at[fits:]
                    if not keys:
                        continue
                size = len(keys) * block_bytes
                # What must beat recomputing is the load the request will wait for: CPU -> GPU
                # (a Redis -> CPU prefetch runs in the background, ahead of the request).
                recompute = self.cost.recompute_blocks_s(at)
                if size > budget or self.cost.load_s("cpu", len(keys)) >= recompute:
                    continue
                budget -= size
                if dst == "gpu":
                    taken += len(keys)
                actions.append(PrefetchAction(cand.agent, cand.session, src, dst, tuple(keys), cand.probability, size,
                                              self.cost.load_s(src, len(keys)), recompute))
            if len(actions) >= cfg.prefetch_max_actions:
                break
        return actions
