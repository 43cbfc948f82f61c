"""Rebuild cost of KV blocks: recompute them by prefill, or load them from a lower tier."""

from __future__ import annotations

from .config import PolicyConfig
from .errors import InputError

TIERS = ("cpu", "redis")


class RebuildCost:
    """Seconds to bring KV back, per block, from the config's model and tier figures."""

    def __init__(self, cfg: PolicyConfig) -> None:
        self.block_tokens = cfg.block_size
        self.block_bytes = cfg.block_size * cfg.kv_bytes_per_token
        self.recompute_s = cfg.block_size * cfg.recompute_s_per_token
        self._tier = {
            "cpu": (cfg.cpu_load_gbps * 1e9, cfg.cpu_load_latency_s),
            "redis": (cfg.redis_load_gbps * 1e9, cfg.redis_load_latency_s),
        }

    def load_s(self, tier: str, blocks: int = 1) -> float:
        """Seconds to load `blocks` blocks from `tier` in one transfer."""
        try:
            bandwidth, latency = self._tier[tier]
        except KeyError:
            raise InputError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}") from None
        return latency + blocks * self.block_bytes / bandwidth

    def worth_loading(self, tier: str, blocks: int) -> bool:
        """A tier is read only when loading beats recomputing."""
        return blocks > 0 and self.load_s(tier, blocks) < blocks * self.recompute_s

    def backed_value(self, tier: str = "cpu") -> float:
        """What keeping a block in GPU is worth when `tier` holds a copy, relative to when nothing
        does: losing it then costs a load instead of a recompute (whichever is cheaper)."""
        ratio = self.load_s(tier, 64) / (64 * self.recompute_s)  # per block, in a typical batch
        return min(1.0, ratio)
