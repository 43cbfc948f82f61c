"""LMCache's CPU and Redis tiers, modelled, as a vLLM KV connector for `cachescout bench --engine vllm`.

Benchmark only: it answers vLLM's scheduler the way LMCache's connector would (how many tokens past
the GPU prefix hit a lower tier can supply) from two modelled tiers, with the fast replay's rules
(bench/replay.py): LRU tiers, LMCache's lookup (the prefix its tiers hold from the first block, the
CPU run touched), a run of blocks loaded only when loading it beats recomputing it (the cost model),
a Redis hit copied into the CPU tier, each prompt stored from where LMCache's hit ended (outputs are
not: LMCache's save_decode_cache is off by default), and with `hold_queued` (beside CacheScout) a
queued request's CPU prefix held from its arrival to its admission (`TierStore.hold_prefix`). No KV
moves; the replay adds the load time to the step and counts the hits.
It runs beside CacheScoutConnector in vLLM's MultiConnector, as LMCache's connector does in a
deployment, or alone (vLLM with LMCache's LRU tiers, `lmcache-lru`).

    {"kv_connector": "ModelledTiersConnector", "kv_connector_module_path": "cachescout.bench.tier_connector",
     "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_blocks": N, "redis_blocks": M, "cost": "h200-llama8b",
                                                         "hold_queued": true}}
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from cachescout.policy import ConfigError

from cachescout.connector.lmcache_model import TierStore, lmcache_lookup, lmcache_store

from .replay import CostProfile, plan_tier_loads


class _NoMetadata(KVConnectorMetadata):
    pass


class ModelledTiersConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - {"cpu_blocks", "redis_blocks", "cost", "hold_queued"})
        if unknown:
            raise ConfigError(f"ModelledTiersConnector: unknown key(s) {unknown}; accepted: cost, cpu_blocks, "
                             "hold_queued, redis_blocks")
        hold = extra.get("hold_queued", False)
        if not isinstance(hold, bool):
            raise ConfigError(f"ModelledTiersConnector: hold_queued must be true or false, got {hold!r}")
        self.block_size = vllm_config.cache_config.block_size
        self.cost = CostProfile.named(extra.get("cost", CostProfile().name))
        cpu, redis = int(extra.get("cpu_blocks", 0)), int(extra.get("redis_blocks", 0))
        self.cpu = TierStore("cpu", cpu) if cpu > 0 else None
        self.redis = TierStore("redis", redis) if redis > 0 else None
        # request -> (first block, LMCache's CPU and Redis runs' ends, runs to load)
        self._planned: dict[str, tuple[int, int, int, list[tuple[str, int]]]] = {}
        self._looked_up: set[str] = set()           # requests LMCache has looked up (it keeps the answer)
        self.hits: dict[str, dict[str, int]] = {}   # request -> tier -> tokens loaded (its first admission)
        self.hold_queued = hold and self.cpu is not None
        self._held: dict[str, list[Any]] = {}       # queued request -> the CPU blocks held for it
        self._queued: dict[str, Any] = {}           # queued requests (holding or not), in arrival order
        self.step_load_s = 0.0                      # load time of the step being scheduled

    # -- scheduler side -----------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        if self.hold_queued:
            self._queued[request.request_id] = request
            self._hold(request)

    def _hold(self, request: Any) -> None:
        """Hold a queued request's CPU prefix (`TierStore.hold_prefix`), again if it holds part."""
        cpu = self.cpu
        if cpu is None:
            return
        rid = request.request_id
        held = self._held.pop(rid, None)
        if held:
            cpu.release(held)
        held = cpu.hold_prefix(request.block_hashes[:request.num_prompt_tokens // self.block_size])
        if held:
            self._held[rid] = held

    def _release(self, rid: str) -> None:
        """The request was allocated (or ended): its hold goes, and the queued requests hold
        theirs again, in arrival order, while room lasts (as the fast replay does)."""
        self._queued.pop(rid, None)
        held = self._held.pop(rid, None)
        if held and self.cpu is not None:
            self.cpu.release(held)
            for request in self._queued.values():
                if self.cpu.hold_room() <= 0:
                    break
                self._hold(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.block_size
        hashes = request.block_hashes
        # vLLM always computes the prompt's last token: a fully cached prompt still misses its last block.
        limit = min(len(hashes), (request.num_tokens - 1) // bs)
        start = num_computed_tokens // bs
        rid = request.request_id
        prompt = hashes[:request.num_prompt_tokens // bs]
        cpu_end, redis_end = lmcache_lookup(prompt, self.cpu, self.redis, touch=rid not in self._looked_up)
        self._looked_up.add(rid)
        end, runs = plan_tier_loads(start, limit, cpu_end, redis_end, self.cost, bs)
        self._planned[rid] = (start, cpu_end, redis_end, runs)
        return (end - start) * bs, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        start, cpu_end, redis_end, runs = self._planned.pop(rid, (0, 0, 0, []))
        hashes = request.block_hashes[:request.num_prompt_tokens // self.block_size]
        loaded = num_external_tokens // self.block_size
        if loaded:
            bs = self.block_size
            for tier, n in runs:
                self.step_load_s += self.cost.load_s(tier, n, bs)
            if rid not in self.hits:
                tiers = self.hits[rid] = {}
                for tier, n in runs:
                    tiers[tier] = tiers.get(tier, 0) + n * bs
            read = hashes[max(start, cpu_end):start + loaded]
            if self.cpu is not None and read:   # LMCache copies what it reads from Redis into CPU
                self.cpu.put(read)
        # LMCache stores the prompt from where its own hit ended, skipping blocks a tier holds.
        lmcache_store(hashes, redis_end, self.cpu, self.redis)
        self._release(rid)   # loaded: LMCache's own pin took over from the hold

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _NoMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._looked_up.discard(request.request_id)
        self._planned.pop(request.request_id, None)
        self._release(request.request_id)
        return False, None

    def take_step_load_s(self) -> float:
        s, self.step_load_s = self.step_load_s, 0.0
        return s

    # -- worker side: nothing moves in a replay -----------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
