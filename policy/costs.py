"""Rebuild cost of KV blocks: recompute them by prefill, or load them from a lower tier."""

from __future__ import annotations

from collections.abc import Iterable

from .config import PolicyConfig
from .errors import InputError

TIERS = ("cpu", "redis")


class RebuildCost:
    """Seconds to bring KV back, per block, from the config's model and tier figures.

    Recomputing a block costs its tokens' share of the weights' FLOP, the same at any depth, plus,
    where `attention_s_per_token_context` is set, attention over every token before it: a block at
    100,000 tokens of context costs several times one at the start of a prompt (Llama-3.1-8B: 4x).
    `recompute_s` is the first part; `depth_factor` scales it to a block's position."""

    def __init__(self, cfg: PolicyConfig) -> None:
        self.block_tokens = cfg.block_size
        self.block_bytes = cfg.block_size * cfg.kv_bytes_per_token
        self.recompute_s = cfg.block_size * cfg.recompute_s_per_token
        # Attention's seconds per block of depth, relative to a block's weights-only recompute.
        self.per_depth = cfg.attention_s_per_token_context * cfg.block_size / cfg.recompute_s_per_token
        self._half_block = self.per_depth * (cfg.block_size - 1) / (2 * cfg.block_size)
        self.depth_priced = self.per_depth > 0.0
        self._tier = {
            "cpu": (cfg.cpu_load_gbps * 1e9, cfg.cpu_load_latency_s),
            "redis": (cfg.redis_load_gbps * 1e9, cfg.redis_load_latency_s),
        }

    def depth_factor(self, block: int) -> float:
        """Recomputing the block at position `block` of a prompt (0 first), relative to
        `recompute_s`: 1 plus attention over the tokens before each of its tokens."""
        return 1.0 + self.per_depth * block + self._half_block

    def recompute_blocks_s(self, positions: Iterable[int]) -> float:
        """Seconds to recompute the blocks at these prompt positions."""
        return sum(self.depth_factor(p) for p in positions) * self.recompute_s

    def load_s(self, tier: str, blocks: int = 1) -> float:
        """Seconds to load `blocks` blocks from `tier` in one transfer."""
        try:
            bandwidth, latency = self._tier[tier]
        except KeyError:
            raise InputError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}") from None
        return latency + blocks * self.block_bytes / bandwidth

    def worth_loading(self, tier: str, blocks: int, start_block: int = 0) -> bool:
        """A tier is read only when loading beats recomputing (`blocks` blocks from prompt
        position `start_block` on)."""
        if blocks <= 0:
            return False
        recompute = blocks * self.recompute_s
        if self.depth_priced:   # the mean depth factor over the span
            recompute *= self.depth_factor(start_block) + self.per_depth * (blocks - 1) / 2
        return self.load_s(tier, blocks) < recompute

    def backed_value(self, tier: str = "cpu") -> float:
        """A block's load from `tier` relative to its recompute at depth 0 (`recompute_s`): what
        losing a block costs when `tier` holds a copy (the cheaper of load and recompute, so never
        above `depth_factor`)."""
        return self.load_s(tier, 64) / (64 * self.recompute_s)  # per block, in a typical batch
