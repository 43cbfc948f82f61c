"""Replay the benchmark's sessions on vLLM's own v1 `Scheduler`, `KVCacheManager` and `BlockPool`.

No GPU and no model: the scheduler runs for real on CPU and a hand-made `ModelRunnerOutput` feeds
back each call's recorded output tokens, so prompts, decode blocks and their hashes are exactly the
workload's. Time is virtual, from the same `CostProfile` as the fast replay (replay.py), so both
engines see the same arrivals, think times and step durations. Compared policies:
- `lru`: vLLM as shipped (no connector);
- `cachescout`: the same scheduler with `CacheScoutConnector` loaded through `kv_transfer_config`.
Only the GPU tier exists here; hit rates are vLLM's own (`prefill_stats.num_local_cached_tokens`,
token-weighted over prompts).

Importing this module imports vLLM (6-12 s).
"""

from __future__ import annotations

import atexit
import dataclasses
import heapq
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# No model, no GPU: torch's and vLLM's start-up warnings about that are expected; keep the output clean.
for _name in ("torch", "vllm"):
    logging.getLogger(_name).setLevel(logging.ERROR)

import torch  # noqa: E402

logging.getLogger("torch").setLevel(logging.ERROR)   # torch's import resets its own level
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig,
)
from vllm.utils.gc_utils import freeze_gc_heap  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request as VllmRequest  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from cachescout.connector.vllm_connector import CacheScoutConnector  # noqa: E402

from cachescout.policy import InputError  # noqa: E402

from .replay import CacheTooSmall, EngineConfig, SessionFlow, _pct, attention_pairs, check_fits  # noqa: E402
from .table import render  # noqa: E402
from .tier_connector import ModelledTiersConnector  # noqa: E402
from .workloads import Session  # noqa: E402

POLICIES = ("lru", "cachescout")
TIERED_POLICIES = ("lmcache-lru", "cachescout")   # with modelled CPU/Redis tiers


def vllm_version() -> str:
    import vllm
    return vllm.__version__
_MODEL_LEN = 1 << 21   # tokens per call: long enough for recorded agent conversations (2M)
_model_dir: str | None = None


def _tiny_model_dir() -> str:
    """A model directory holding only a config.json: all vLLM's ModelConfig needs without weights."""
    global _model_dir
    if _model_dir is None or not os.path.isfile(os.path.join(_model_dir, "config.json")):
        _model_dir = tempfile.mkdtemp(prefix="cachescout-model-")
        atexit.register(shutil.rmtree, _model_dir, ignore_errors=True)
        with open(os.path.join(_model_dir, "config.json"), "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                       "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "num_hidden_layers": 2, "vocab_size": 200_000, "max_position_embeddings": _MODEL_LEN,
                       "torch_dtype": "float16"}, f)
    return _model_dir


def build_scheduler(gpu_blocks: int, *, block_size: int = 16, max_num_seqs: int = 64,
                    max_batched_tokens: int = 8192, connector: Mapping[str, Any] | None = None,
                    tiers: Mapping[str, Any] | None = None) -> Scheduler:
    """vLLM's scheduler over a prefix cache of `gpu_blocks` usable blocks. `connector`: None for
    vLLM as shipped, else the `kv_connector_extra_config` of CacheScoutConnector. `tiers`: the
    settings of the modelled LMCache tiers (bench/tier_connector.py), beside it in MultiConnector."""
    model = ModelConfig(model=_tiny_model_dir(), skip_tokenizer_init=True, dtype="float16", max_model_len=_MODEL_LEN)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched_tokens,
                            max_model_len=_MODEL_LEN, is_encoder_decoder=False, async_scheduling=False)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache.num_gpu_blocks = gpu_blocks + 1   # vLLM keeps one block aside (the null block)
    entries = []
    if connector is not None:
        entries.append({"kv_connector": "CacheScoutConnector", "kv_connector_module_path": "cachescout.connector",
                        "kv_role": "kv_both", "kv_connector_extra_config": dict(connector)})
    if tiers is not None:
        entries.append({"kv_connector": "ModelledTiersConnector",
                        "kv_connector_module_path": "cachescout.bench.tier_connector",
                        "kv_role": "kv_both", "kv_connector_extra_config": dict(tiers)})
    kvt = None
    if len(entries) == 1:
        kvt = KVTransferConfig(**entries[0])
    elif entries:
        kvt = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                               kv_connector_extra_config={"connectors": entries})
    cfg = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache, kv_transfer_config=kvt,
                     device_config=DeviceConfig("cpu"))
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float16)
    kvc = KVCacheConfig(num_blocks=gpu_blocks + 1, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn"], spec)])
    return Scheduler(vllm_config=cfg, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(cfg),
                     block_size=block_size, log_stats=True)


@dataclasses.dataclass(slots=True)
class _Call:
    session: Session
    index: int
    issued_at: float
    request: Any = None
    generated: int = 0
    hit_tokens: int | None = None
    output: list[int] | None = None   # a trace record's stand-in output tokens
    cpu_hit_tokens: int = 0
    redis_hit_tokens: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None


@dataclasses.dataclass(slots=True)
class VllmReplayResult:
    policy: str
    calls: list[_Call]
    makespan_s: float
    steps: int
    preemptions: int
    scheduler_s: float            # CPU time of this thread in vLLM's schedule() + update_from_output()
    connector_s: float            # of which CacheScout's connector (its own decision time)
    connector_stats: dict

    def summary(self) -> dict:
        done = [c for c in self.calls if c.finished_at is not None]
        prompt = sum(c.session.calls[c.index].prompt_len for c in done)
        hit = sum(c.hit_tokens or 0 for c in done)
        cpu = sum(c.cpu_hit_tokens for c in done)
        redis = sum(c.redis_hit_tokens for c in done)
        ttft = sorted(c.first_token_at - c.issued_at for c in done if c.first_token_at is not None)
        return {
            "policy": self.policy,
            "engine": "vllm",
            "calls": len(done),
            "prompt_tokens": prompt,
            "gpu_token_hit_rate": hit / prompt if prompt else 0.0,
            "cpu_token_hit_rate": cpu / prompt if prompt else 0.0,
            "redis_token_hit_rate": redis / prompt if prompt else 0.0,
            "token_hit_rate": (hit + cpu + redis) / prompt if prompt else 0.0,
            "ttft_mean_ms": 1e3 * sum(ttft) / len(ttft) if ttft else 0.0,
            "ttft_p99_ms": 1e3 * _pct(ttft, 0.99),
            "makespan_s": self.makespan_s,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "scheduler_us_per_step": 1e6 * self.scheduler_s / self.steps if self.steps else 0.0,
            "connector_us_per_step": 1e6 * self.connector_s / self.steps if self.steps else 0.0,
        }


class VllmReplay:
    """Closed-loop sessions on vLLM's scheduler, stepped on a virtual clock."""

    def __init__(self, cfg: EngineConfig, policy: str = "lru", connector_config: Mapping[str, Any] | None = None
                 ) -> None:
        tiered = bool(cfg.cpu_blocks or cfg.redis_blocks)
        allowed = TIERED_POLICIES if tiered else POLICIES
        if policy not in allowed:
            raise InputError(f"policy {policy!r} cannot run on --engine vllm{' with lower tiers' if tiered else ''}; "
                             f"choose from {', '.join(allowed)}")
        self.cfg = cfg
        self.policy = policy
        self.now = 0.0
        extra = dict(connector_config or {}) if policy == "cachescout" else None
        if extra is not None:   # the policy believes the hardware the clock models (its own settings first)
            extra["policy"] = {**cfg.cost.policy_settings(), **dict(extra.get("policy") or {})}
            if cfg.cpu_blocks and "lmcache_cpu_gib" not in extra:   # as `cachescout config` tells it
                extra["lmcache_cpu_gib"] = cfg.cpu_blocks * cfg.block_size * cfg.cost.kv_bytes_per_token / 2**30
        tiers = ({"cpu_blocks": cfg.cpu_blocks, "redis_blocks": cfg.redis_blocks, "cost": cfg.cost.name,
                  "hold_queued": policy == "cachescout"} if tiered else None)
        self.scheduler = build_scheduler(cfg.gpu_blocks, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                                         max_batched_tokens=cfg.max_batched_tokens, connector=extra, tiers=tiers)
        found = self.scheduler.connector
        parts = list(getattr(found, "_connectors", None) or ([found] if found is not None else []))
        self.connector = next((c for c in parts if isinstance(c, CacheScoutConnector)), None)
        self.tiers = next((c for c in parts if isinstance(c, ModelledTiersConnector)), None)
        if self.connector is not None:
            self.connector.set_clock(lambda: self.now)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(cfg.block_size, sha256)
        # As vLLM's EngineCore does once it is built: move what exists now out of the garbage
        # collector's way, so serving-time collections scan only what serving allocates.
        freeze_gc_heap()
        self._preempted: dict[str, int] = {}
        self.reported_stats: dict[str, float] = {}   # connector stats vLLM's loggers received, summed

    def run(self, sessions: Sequence[Session], progress: Callable[[int, int], None] | None = None
            ) -> VllmReplayResult:
        sched = self.scheduler
        cost = self.cfg.cost
        check_fits(sessions, self.cfg.gpu_blocks, self.cfg.block_size)
        for s in sessions:
            for k, call in enumerate(s.calls):
                if call.prompt_len + call.output_len > _MODEL_LEN:
                    where = getattr(call, "where", None) or f"session {s.session_id} call {k}"
                    raise InputError(f"{where}: {call.prompt_len + call.output_len:,} tokens exceed the {_MODEL_LEN:,} "
                                     "a call may have on vLLM's scheduler here")
        flow = SessionFlow(sessions)
        pending: list[tuple[float, int, _Call]] = []
        order = 0
        for t, s, k in flow.initial():
            heapq.heappush(pending, (t, order, _Call(s, k, t)))
            order += 1
        total = flow.total_calls
        live: dict[str, _Call] = {}
        done: list[_Call] = []
        steps = 0
        sched_s = 0.0
        while pending or live:
            if not live and pending[0][0] > self.now:
                self.now = pending[0][0]
            while pending and pending[0][0] <= self.now:
                _, _, c = heapq.heappop(pending)
                call = c.session.calls[c.index]
                rid = f"{c.session.session_id}/{c.index}"
                prompt = call.prompt_tokens()
                if prompt is None:   # a trace record: ids stand in for tokens
                    prompt, c.output = call.synthetic_tokens()
                c.request = VllmRequest(rid, list(prompt),
                                        SamplingParams(max_tokens=call.output_len, ignore_eos=True), None,
                                        arrival_time=self.now, block_hasher=self._hasher)
                live[rid] = c
                sched.add_request(c.request)
            t0 = time.thread_time()   # CPU time, as the connector's own is measured
            out = sched.schedule()
            t1 = time.thread_time()
            if not out.num_scheduled_tokens:
                raise CacheTooSmall("vLLM scheduled nothing: a call needs more KV blocks than the cache holds")
            prefill_tokens = decode_seqs = context = 0
            pairs = 0.0
            sampled: list[list[int]] = []
            ids = list(out.num_scheduled_tokens)
            for rid in ids:
                c = live[rid]
                req = c.request
                n = out.num_scheduled_tokens[rid]
                before = req.num_computed_tokens - n   # schedule() already advanced it
                if n == 1 and before >= req.num_prompt_tokens:
                    decode_seqs += 1
                    context += before
                else:
                    prefill_tokens += n
                    pairs += attention_pairs(before, n)
                if req.is_prefill_chunk:
                    sampled.append([])   # a prefill chunk samples nothing
                else:
                    output = c.output if c.output is not None else c.session.calls[c.index].output
                    sampled.append([output[c.generated] if c.generated < len(output) else 0])
            # Loads from the lower tiers go before the step's compute, as in the fast replay.
            self.now += cost.step_s(prefill_tokens, decode_seqs, context, pairs) + (
                self.tiers.take_step_load_s() if self.tiers is not None else 0.0)
            mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=sampled)
            t2 = time.thread_time()
            eco = sched.update_from_output(out, mro)
            sched_s += time.thread_time() - t2 + (t1 - t0)
            steps += 1
            for rid, toks in zip(ids, sampled, strict=True):
                if toks:
                    c = live[rid]
                    c.generated += 1
                    if c.first_token_at is None:
                        c.first_token_at = self.now
            for outs in eco.values():
                reported = outs.scheduler_stats.kv_connector_stats if outs.scheduler_stats else None
                for k, v in (reported or {}).items():   # what vLLM's stats loggers received
                    if isinstance(v, (int, float)):
                        self.reported_stats[k] = self.reported_stats.get(k, 0) + v
                for o in outs.outputs:
                    done_call = live.get(o.request_id)
                    if done_call is None:
                        continue
                    c = done_call
                    if o.prefill_stats is not None and c.hit_tokens is None:
                        c.hit_tokens = o.prefill_stats.num_local_cached_tokens
                        if self.tiers is not None:
                            tier = self.tiers.hits.pop(o.request_id, {})
                            c.cpu_hit_tokens, c.redis_hit_tokens = tier.get("cpu", 0), tier.get("redis", 0)
                    if o.finish_reason is not None:
                        c.finished_at = self.now
                        if c.request.num_preemptions:
                            self._preempted[o.request_id] = c.request.num_preemptions
                        del live[o.request_id]
                        done.append(c)
                        c.request = None
                        for t, s, k in flow.finished(c.session, c.index, self.now):
                            heapq.heappush(pending, (t, order, _Call(s, k, t)))
                            order += 1
                        if progress is not None:
                            progress(len(done), total)
        stats: dict = {}
        connector_s = 0.0
        if self.connector is not None:
            connector_s = self.connector.decision_s
            steering = self.connector.steering
            stats = dict(steering.stats if steering is not None else {}) | dict(self.connector.policy.stats)
        self.preemptions = sum(self._preempted.values())
        return VllmReplayResult(self.policy, done, self.now, steps, self.preemptions, sched_s, connector_s, stats)

    def pool_all_free(self) -> bool:
        """Every usable block is back in the free queue (nothing leaked, nothing pinned)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return pool.get_num_free_blocks() == self.cfg.gpu_blocks


def compare_engines(name: str, sessions: Sequence[Session], cfg: EngineConfig, policies: Sequence[str],
                    fast_results: Mapping[str, dict], progress: Callable[[str, int, int], None] | None = None,
                    twins: Mapping[str, str] | None = None) -> list[dict]:
    """Each policy on vLLM's scheduler, beside the fast engine's figures for the same run.

    `fast_results`: policy -> the fast engine's summary on the same sessions and cache size; `twins`:
    policy -> the fast policy it is compared with (default: itself). The
    connector's cost is reported per scheduler step and as a share of the step time without it:
    the modelled GPU step plus the scheduler's own CPU time, from the `lru` run when there is one
    (else from the same run less the connector)."""
    rows = []
    for policy in policies:
        replay = VllmReplay(cfg, policy)
        tick = (lambda done, total, p=policy: progress(p, done, total)) if progress else None
        result = replay.run(sessions, tick)
        if not replay.pool_all_free():
            raise RuntimeError(f"{name}/{policy}: vLLM's block pool did not end with every block free")
        s = result.summary()
        s["model_step_ms"] = 1e3 * s["makespan_s"] / s["steps"] if s["steps"] else 0.0
        tiered = bool(cfg.cpu_blocks or cfg.redis_blocks)
        twin = (twins or {}).get(policy, policy)
        fast = fast_results[twin]
        s["fast_policy"] = twin
        s["fast_gpu_token_hit_rate"] = fast["gpu_token_hit_rate"]
        s["engine_difference"] = s["gpu_token_hit_rate"] - fast["gpu_token_hit_rate"]
        if tiered:
            for k in ("cpu_token_hit_rate", "redis_token_hit_rate", "token_hit_rate"):
                s[f"fast_{k}"] = fast[k]
            s["engine_difference_all_tiers"] = s["token_hit_rate"] - fast["token_hit_rate"]
        if policy == "cachescout":
            st = result.connector_stats
            s["connector"] = {k: st.get(k, 0) for k in ("requests", "recognised", "predictions", "predictions_correct",
                                                          "steered_blocks", "steer_steps", "evictions_seen")}
        rows.append(s)
    base = next((r for r in rows if r["policy"] != "cachescout"), None)   # vLLM without CacheScout
    for r in rows:
        if not r["connector_us_per_step"]:
            continue
        ref = base or r
        own = 0 if base else r["connector_us_per_step"]
        step_us = 1e3 * ref["model_step_ms"] + ref["scheduler_us_per_step"] - own
        same_us = 1e3 * r["model_step_ms"] + r["scheduler_us_per_step"] - r["connector_us_per_step"]
        # The larger of the two shares: against the run without the connector, and against this
        # run's own (shorter, since more prefix hits) steps less the connector.
        r["connector_step_overhead"] = r["connector_us_per_step"] / min(step_us, same_us)
    return rows


def format_engine_table(report: dict) -> str:
    tiered = bool(report.get("cpu_blocks") or report.get("redis_blocks"))
    tiers = (f"; LMCache's CPU ({report.get('cpu_blocks', 0)}) and Redis ({report.get('redis_blocks', 0)} blocks) "
             "tiers modelled" if tiered else " (GPU tier only)")
    fast_of = {r["policy"]: r.get("fast_policy", r["policy"]) for r in report["results"]}
    twins = ", ".join(f"{p} with {t}" for p, t in fast_of.items() if t != p)
    if twins:
        tiers += f"; fast-replay counterparts (what the policy sees inside vLLM): {twins}"
    head = (f"{report['workload']}: {report['calls']} calls on vLLM {report['vllm_version']}'s scheduler, "
            f"GPU cache {report['gpu_blocks']} blocks x {report['block_size']} tokens{tiers}")
    cols: tuple[str, ...] = ("policy", "GPU hit vLLM", "GPU hit fast", "difference")
    if tiered:
        cols += ("all tiers vLLM", "all tiers fast", "difference")
    cols += ("TTFT mean", "scheduler/step", "connector/step", "of step time")
    rows = [cols]
    for r in report["results"]:
        row: tuple[str, ...] = (r["policy"], f"{r['gpu_token_hit_rate']:.4f}", f"{r['fast_gpu_token_hit_rate']:.4f}",
               f"{100 * r['engine_difference']:+.2f} pt")
        if tiered:
            row += (f"{r['token_hit_rate']:.4f}", f"{r['fast_token_hit_rate']:.4f}",
                    f"{100 * r['engine_difference_all_tiers']:+.2f} pt")
        row += (f"{r['ttft_mean_ms']:.0f} ms", f"{r['scheduler_us_per_step']:.0f} us",
                f"{r['connector_us_per_step']:.0f} us",
                f"{r['connector_step_overhead']:.2%}" if "connector_step_overhead" in r else "-")
        rows.append(row)
    return render(head, rows)
