"""What the two halves of the connector exchange and report: the metadata the scheduler sends the
workers each step, and the counters each half reports to vLLM's metrics as differences."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


class CacheScoutMetadata(KVConnectorMetadata):
    """What the workers get each step: the per-agent reuse probabilities, when they changed (for
    the CPU-tier policy in LMCache, lmcache_tier.py), anchors to prefetch, and the queued requests
    whose CPU-tier prefix to hold until their admission. The GPU steering happens on the scheduler."""

    def __init__(self, agent_scores: dict[str, float] | None = None,
                 prefetch: list[tuple[list[int], dict]] | None = None, *,
                 holds: list[tuple[str, list[int], dict]] | None = None, releases: list[str] | None = None,
                 release_all: bool = False) -> None:
        self.agent_scores = agent_scores
        self.prefetch = prefetch   # (anchor tokens, LMCache request configs) of agents predicted next
        self.holds = holds         # (request id, prompt tokens, LMCache request configs) left waiting
        self.releases = releases   # requests admitted or ended since: their holds go
        self.release_all = release_all   # CacheScout turned itself off: every hold goes


class CounterReport:
    """Cumulative counters turned into the differences vLLM sums (its connector stats)."""

    def __init__(self) -> None:
        self.last: dict[str, Any] = {}   # the counters as last reported
        self.at = float("-inf")          # when (on the reporting half's clock)

    def since_last(self, now: dict[str, Any]) -> dict[str, Any]:
        """The counters that moved since the last report, as differences; `now` becomes the last."""
        last = self.last
        delta = {k: v - last.get(k, 0) for k, v in now.items() if v != last.get(k, 0)}
        self.last = now
        return delta

    def restart(self) -> None:
        """Report everything again, at once (tests read a full report)."""
        self.last = {}
        self.at = float("-inf")
