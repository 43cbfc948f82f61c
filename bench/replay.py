"""A fast replay of vLLM's GPU prefix cache and scheduler on a virtual clock.

Modelled after vLLM v1 (block semantics are exact, timing comes from a cost model):
- KV blocks of `block_size` tokens; only full blocks are cached, under chained hashes; a prefix
  hit is the longest run of cached leading blocks, and at least the prompt's last token is always
  recomputed (as vLLM does).
- Blocks have reference counts; a block whose count drops to zero stays cached and becomes
  evictable. Blocks without content are handed out first; when none is left the eviction policy
  chooses which cached free block to evict (vLLM: the head of its LRU free queue). A finished
  request frees its blocks tail first.
- Continuous batching: each step decodes one token for every running request and fills the rest of
  the token budget with prefill chunks (chunked prefill), admitting waiting requests in arrival order
  while there is room in the batch and blocks to allocate. When a decode step finds no block, the
  most recently admitted request is preempted and recomputed later (vLLM's recompute preemption).
- Step time = overhead + prefill tokens x per-token prefill cost + a decode pass (weights read once)
  + KV read for every running request's context + loads from lower tiers (CostProfile, with the
  figures' sources in data/cost_profiles.json).
- Optional tiers (CPU, Redis), LRU, as LMCache keeps them: a call's lookup finds the prefix they hold
  from its first block (CPU, then Redis) and refreshes that CPU run, GPU-held blocks included; past
  the GPU prefix hit the rest of it is loaded where that beats recomputing; the prompt is stored
  from where LMCache's hit ended (decode's blocks are not: LMCache's save_decode_cache is off by
  default). Between steps a policy may prefetch blocks (CPU -> GPU, Redis -> CPU) as far as the
  links' bandwidth allows during a step. Vanilla vLLM (`lru`) has no tiers.
Sessions are closed loops: a session's next call is issued a think time after its previous call ends.
The connector hears that a call finished before its blocks are freed, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import math
import json
import operator
from collections import OrderedDict, deque
from importlib import resources
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Final, cast

from cachescout.connector.lmcache_model import TierStore, lmcache_lookup, lmcache_store
from cachescout.policy import InputError

from .workloads import Session

try:
    from mypy_extensions import mypyc_attr
except ImportError:   # not compiled (tools/native.py): the decorator only means something to mypyc
    def mypyc_attr(*args: Any, **kwargs: Any) -> Callable[[Any], Any]:   # type: ignore[misc]
        return lambda cls: cls


DEFAULT_COST_PROFILE: Final = "llama3.1-8b-h200"


@dataclasses.dataclass(frozen=True, slots=True)
class CostProfile:
    """Step-time and tier coefficients; the figures and their sources are in
    data/cost_profiles.json (defaults: Llama-3.1-8B in bf16 on one H200)."""

    name: str = DEFAULT_COST_PROFILE
    step_overhead_s: float = 1.5e-3
    prefill_s_per_token: float = 4.07e-5
    decode_pass_s: float = 4.15e-3
    kv_read_s_per_token: float = 3.05e-8
    cpu_gbps: float = 25.0
    cpu_latency_s: float = 1e-4
    redis_gbps: float = 5.0
    redis_latency_s: float = 1e-3
    kv_bytes_per_token: int = 131072
    # Attention's own cost, which grows with the context: seconds per prompt token per token before
    # it (0: a token is priced the same at any depth, as the default profiles still do).
    attention_s_per_token_context: float = 0.0

    @classmethod
    def named(cls, name: str) -> CostProfile:
        profiles = json.loads(resources.files("cachescout.bench").joinpath("data", "cost_profiles.json").read_text())
        if name not in profiles or name.startswith("_"):
            known = sorted(k for k in profiles if not k.startswith("_"))
            raise InputError(f"unknown cost profile {name!r}; choose from {', '.join(known)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(name=name, **{k: v for k, v in profiles[name].items() if k in fields})

    def policy_settings(self) -> dict[str, Any]:
        """The policy's rebuild-cost settings (`PolicyConfig`) for this hardware: what an operator
        sets for their model and tiers, so the policy believes what the replay's clock does."""
        return {"kv_bytes_per_token": self.kv_bytes_per_token, "recompute_s_per_token": self.prefill_s_per_token,
                "attention_s_per_token_context": self.attention_s_per_token_context,
                "cpu_load_gbps": self.cpu_gbps, "cpu_load_latency_s": self.cpu_latency_s,
                "redis_load_gbps": self.redis_gbps, "redis_load_latency_s": self.redis_latency_s}

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, attention_pairs: float = 0.0) -> float:
        """One step's time; `attention_pairs`: over the step's prefill tokens, the tokens before
        each in its prompt (`attention_pairs` below), for the attention term."""
        t = self.step_overhead_s + prefill_tokens * self.prefill_s_per_token
        if attention_pairs:
            t += attention_pairs * self.attention_s_per_token_context
        if decode_seqs:
            t += self.decode_pass_s + context_tokens * self.kv_read_s_per_token
        return t

    def prefill_s(self, start: int, tokens: int) -> float:
        """Compute seconds to prefill `tokens` tokens of a prompt after its first `start`."""
        return tokens * self.prefill_s_per_token + self.attention_s_per_token_context * attention_pairs(start, tokens)

    def load_s(self, tier: str, blocks: int, block_size: int) -> float:
        """Seconds to bring `blocks` blocks from `tier` into GPU memory."""
        if tier == "cpu":
            gbps, latency = self.cpu_gbps, self.cpu_latency_s
        else:
            gbps, latency = self.redis_gbps, self.redis_latency_s
        return latency + blocks * block_size * self.kv_bytes_per_token / (gbps * 1e9)

    def worth_loading(self, tier: str, blocks: int, block_size: int, start_block: int = 0) -> bool:
        """A tier is read only when loading beats recomputing (the blocks from `start_block` on:
        with an attention term, deeper blocks cost more to recompute)."""
        return self.load_s(tier, blocks, block_size) < self.prefill_s(start_block * block_size, blocks * block_size)


def attention_pairs(start: int, tokens: int) -> float:
    """Over `tokens` prompt tokens after the first `start`, the tokens before each: what causal
    attention's compute grows with."""
    return tokens * (start + (tokens - 1) / 2)


def plan_tier_loads(start: int, limit: int, cpu_end: int, redis_end: int, cost: CostProfile,
                    block_size: int) -> tuple[int, list[tuple[str, int]]]:
    """Past the GPU hit (`start`, up to `limit`), what LMCache's lookup found (`lmcache_lookup`):
    the CPU run's blocks, then the Redis run's, each loaded only when that beats recomputing it; a
    run that does not stops the load. Returns the end of what is loaded and the runs as (tier,
    blocks). Shared by this engine and the modelled tiers on vLLM's scheduler (tier_connector.py),
    so both load by the same rule."""
    runs: list[tuple[str, int]] = []
    end = start
    for tier, stop in (("cpu", cpu_end), ("redis", redis_end)):
        stop = min(stop, limit)
        if stop <= end:
            continue
        if not cost.worth_loading(tier, stop - end, block_size, end):
            break
        runs.append((tier, stop - end))
        end = stop
    return end, runs


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int = 8192
    cost: CostProfile = CostProfile()
    recompute_last_token: bool = True    # vLLM always computes a prompt's last token; off only to
                                         # compare with simulators that do not
    cpu_blocks: int = 0                  # LMCache CPU tier, in GPU-block units (0: none)
    redis_blocks: int = 0                # Redis tier (0: none)

    def __post_init__(self) -> None:
        for name in ("gpu_blocks", "block_size", "max_num_seqs", "max_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InputError(f"{name} must be a positive integer, got {v!r}")
        for name in ("cpu_blocks", "redis_blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise InputError(f"{name} must be a non-negative integer, got {v!r}")


@mypyc_attr(allow_interpreted_subclasses=True)
class ReplayPolicy:
    """Eviction policy of the GPU prefix cache, and what it is told. Subclasses override."""

    name = "base"
    uses_tiers = True   # vanilla vLLM (`lru`) has no LMCache tiers
    # Hold a queued request's CPU-tier prefix until it is admitted (`TierStore.hold_prefix`):
    # CacheScout asks for it (as its connector does inside vLLM, connector/lmcache_tier.py);
    # LMCache alone pins it only from its lookup, at admission.
    holds_queued = False

    def prefetch(self, engine: Engine, now: float) -> list[Hashable]:
        """Between steps: keys of lower-tier blocks to bring into the GPU cache, in order."""
        return []

    def prefetched(self, keys: Sequence[Hashable], now: float) -> None:
        """Blocks that arrived by prefetch: cached and free (no request holds them yet)."""
        self.freed(keys, now)

    def backed(self, added: Sequence[Hashable], dropped: Sequence[Hashable]) -> None:
        """The CPU tier now holds `added` and no longer holds `dropped`."""

    def arrived(self, req: Request, now: float) -> None:
        """A call entered the engine (vLLM's add_request)."""

    def reused(self, keys: Sequence[Hashable], now: float) -> None:
        """Free cached blocks a call just hit: no longer evictable (called before any eviction)."""

    def admitted(self, req: Request, keys: Sequence[Hashable], num_cached: int, now: float) -> None:
        """The call holds these cached blocks (prompt order); the first `num_cached` were hits."""

    def cached(self, req: Request, keys: Sequence[Hashable], now: float) -> None:
        """Decode filled new blocks of the call; they are now cached."""

    def freed(self, keys: Sequence[Hashable], now: float) -> None:
        """Cached blocks whose reference count dropped to zero, in the order freed."""

    def evict(self, n: int, now: float) -> list[Hashable]:
        raise NotImplementedError

    def finished(self, req: Request, now: float) -> None:
        """The call ended."""


@mypyc_attr(allow_interpreted_subclasses=True)
class LRUPolicy(ReplayPolicy):
    """vLLM's own order: cached free blocks leave from the head of the free queue."""

    name = "lru"
    uses_tiers = False

    def __init__(self) -> None:
        self.free: OrderedDict[Hashable, None] = OrderedDict()

    def reused(self, keys: Sequence[Hashable], now: float) -> None:
        for k in keys:
            del self.free[k]

    def freed(self, keys: Sequence[Hashable], now: float) -> None:
        for k in keys:
            self.free[k] = None

    def evict(self, n: int, now: float) -> list[Hashable]:
        out: list[Hashable] = []
        free = self.free
        while free and len(out) < n:
            out.append(free.popitem(last=False)[0])
        return out


class LMCacheLRUPolicy(LRUPolicy):
    """vLLM's LRU on the GPU with LMCache's CPU and Redis tiers (LRU too)."""

    name = "lmcache-lru"
    uses_tiers = True


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    session: Session
    index: int
    call: Any                    # a workload Call or a trace record (same interface)
    issued_at: float
    tokens: list[int] | None = None  # prompt token ids (None when replaying a trace of hashes)
    # Block keys are kept as the objects they were made as (ints here, typed Hashable so that
    # compiled code passes them on as they are: unboxed and boxed again, an int would be a new
    # object for every dict look-up).
    hashes: list[Hashable] = dataclasses.field(default_factory=list)     # full prompt blocks
    keys: list[Hashable] = dataclasses.field(default_factory=list)       # cached blocks held (prompt, then output)
    prompt_len: int = 0
    output_len: int = 0
    computed: int = 0            # prompt tokens computed so far
    generated: int = 0
    hit_tokens: int = 0          # all hits (GPU, CPU, Redis)
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    redis_hit_tokens: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    partial_blocks: int = 0      # blocks held that are not (yet) full
    last_hash: int = 0
    preempted: int = 0
    looked_up: bool = False      # LMCache has looked it up (it keeps the answer per request)
    cpu_held: list[Hashable] = dataclasses.field(default_factory=list)   # CPU-tier blocks held while queued
    running: bool = False
    tag: Any = None              # for the policy's use
    admitted: int = 0            # admission order (the running queue's order)
    base_generated: int = 0      # while decoding: `generated` at the start of step `base_step`
    base_step: int = 0
    due: int = -1                # while decoding: the next step it touches the cache or ends in

    @property
    def agent(self) -> str | None:
        return self.call.agent   # None: a trace record that does not name its agent


class _Decoding:
    """When each decoding request next needs a visit: the step whose token opens or fills one of
    its blocks (`Engine._grow`), or its last. In between it only adds one token per step to the
    batch's context, counted here without visiting it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._due: dict[int, list[Request]] = {}
        self._stale = True     # the set of decoding requests changed: recount
        self._at = 0           # the step `_n` and `_context` hold at
        self._n = 0
        self._context = 0

    @staticmethod
    def generated(req: Request, step: int) -> int:
        """Tokens `req` has generated at the start of `step`."""
        return req.base_generated + step - req.base_step

    def schedule(self, req: Request, step: int) -> None:
        """`req` decodes from `step` on, having generated `req.generated` tokens by then."""
        req.base_generated = req.generated
        req.base_step = step
        bs = self.block_size
        edge = (req.prompt_len + req.generated) % bs
        wait = 0 if edge <= 1 or bs == 1 else bs - edge
        req.due = due = step + min(wait, req.output_len - 1 - req.generated)
        self._due.setdefault(due, []).append(req)

    def changed(self) -> None:
        self._stale = True

    def leave(self, req: Request) -> None:
        req.due = -1
        self._stale = True

    def batch(self, running: Sequence[Request], step: int) -> tuple[int, int]:
        """(decoding requests, their context tokens) at the start of `step`."""
        if self._stale:
            n = context = 0
            for r in running:
                if r.computed >= r.prompt_len:
                    n += 1
                    context += r.prompt_len + r.base_generated + step - r.base_step
            self._n, self._context, self._stale = n, context, False
        else:
            self._context += self._n * (step - self._at)
        self._at = step
        return self._n, self._context

    def due(self, step: int) -> list[Request]:
        """The requests to visit in `step`, in running-queue order."""
        got = self._due.pop(step, None)
        if not got:
            return []
        if len(got) == 1:
            return got if got[0].due == step else []
        return sorted({id(r): r for r in got if r.due == step}.values(), key=_admission_order)


_admission_order = operator.attrgetter("admitted")


def call_keys(call, block_size: int) -> list[Hashable]:
    """Block keys of a call's prompt: chained hashes of its tokens, or a trace record's ids."""
    tokens = call.prompt_tokens()
    return chain_hashes(tokens, block_size) if tokens is not None else cast(list, call.block_keys(block_size))


class PromptKeys:
    """Block keys of calls' prompts, computed once and shared by every replay of the same calls
    (every policy, cache size and load of a workload), as a trace file gives them once. Keyed by
    the call's content (its token segments or block ids), which copies at another load share."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._keys: dict[int, tuple[object, list[Hashable]]] = {}   # id(content) -> (content, keys)

    def __call__(self, call) -> list[Hashable]:
        content = call.segments if hasattr(call, "segments") else call.hash_ids   # workload call / trace record
        got = self._keys.get(id(content))
        if got is None or got[0] is not content:
            got = self._keys[id(content)] = (content, call_keys(call, self.block_size))
        return got[1]


def chain_hashes(tokens: Sequence[int], block_size: int, parent: int = 0, start: int = 0) -> list[Hashable]:
    """vLLM-style chained hashes of the full blocks of tokens[start:]."""
    out: list[Hashable] = []
    h = parent
    for i in range(start, len(tokens) - block_size + 1, block_size):
        h = hash((h, tuple(tokens[i:i + block_size])))
        out.append(h)
    return out


@dataclasses.dataclass(slots=True)
class ReplayResult:
    policy: str
    requests: list[Request]
    makespan_s: float
    steps: int
    preemptions: int
    evictions: int
    load_s: float = 0.0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0

    def summary(self) -> dict:
        reqs = [r for r in self.requests if r.finished_at is not None]
        prompt = sum(r.prompt_len for r in reqs)
        hit = sum(r.hit_tokens for r in reqs)
        ttft = sorted(cast(float, r.first_token_at) - r.issued_at for r in reqs)
        e2e = [cast(float, r.finished_at) - r.issued_at for r in reqs]
        def share(tokens: int) -> float:
            return tokens / prompt if prompt else 0.0

        return {
            "policy": self.policy,
            "calls": len(reqs),
            "prompt_tokens": prompt,
            "token_hit_rate": share(hit),
            "gpu_token_hit_rate": share(sum(r.gpu_hit_tokens for r in reqs)),
            "cpu_token_hit_rate": share(sum(r.cpu_hit_tokens for r in reqs)),
            "redis_token_hit_rate": share(sum(r.redis_hit_tokens for r in reqs)),
            "tier_load_s": self.load_s,
            "prefetched_blocks": self.prefetch_issued,
            "prefetch_precision": (self.prefetch_used / (self.prefetch_used + self.prefetch_wasted)
                                   if self.prefetch_used + self.prefetch_wasted else None),
            "prefill_tokens": prompt - hit,
            "ttft_mean_ms": 1e3 * sum(ttft) / len(ttft) if ttft else 0.0,
            "ttft_p50_ms": 1e3 * _pct(ttft, 0.5),
            "ttft_p99_ms": 1e3 * _pct(ttft, 0.99),
            "latency_mean_ms": 1e3 * sum(e2e) / len(e2e) if e2e else 0.0,
            "makespan_s": self.makespan_s,
            "throughput_calls_per_s": len(reqs) / self.makespan_s if self.makespan_s else 0.0,
            "preemptions": self.preemptions,
            "evictions": self.evictions,
            "steps": self.steps,
        }


class SessionFlow:
    """When each call of a set of sessions is issued, as their calls finish: the one rule both
    engines (this one and vLLM's scheduler, vllm_replay.py) follow.

    Closed loop by default: a session's next call comes its predecessor's `think_s` after that
    one finished. A session with `offsets_s` is open loop: every call at its own time. A session
    with a `parent` (a sub-agent) starts when its parent's call `after_call` has finished (plus its
    `arrival_s`), and the parent's next call waits until all the sub-sessions it started are done."""

    def __init__(self, sessions: Sequence[Session]) -> None:
        self.sessions = sessions
        self.total_calls = 0
        by_id: dict[str, Session] = {}
        for s in sessions:
            if s.session_id in by_id:
                raise InputError(f"session id {s.session_id!r} is used by two sessions")
            if not s.calls:
                raise InputError(f"session {s.session_id!r} has no calls")
            if s.offsets_s and len(s.offsets_s) != len(s.calls):
                raise InputError(f"session {s.session_id!r}: {len(s.offsets_s)} offsets for {len(s.calls)} calls")
            by_id[s.session_id] = s
            self.total_calls += len(s.calls)
        self._by_id = by_id
        self._children: dict[tuple[str, int], list[Session]] = {}
        for s in sessions:
            if s.parent is None:
                continue
            parent = by_id.get(s.parent)
            if parent is None or parent.offsets_s or not 0 <= s.after_call < len(parent.calls):
                raise InputError(f"sub-session {s.session_id!r}: no closed-loop session {s.parent!r} "
                                 f"with a call {s.after_call}")
            self._children.setdefault((s.parent, s.after_call), []).append(s)
        self._open: dict[tuple[str, int], int] = {}   # (parent, call) -> sub-sessions not yet done

    def initial(self) -> list[tuple[float, Session, int]]:
        """(issue time, session, call index) of the calls known at the start."""
        out: list[tuple[float, Session, int]] = []
        for s in self.sessions:
            if s.parent is not None:
                continue
            if s.offsets_s:
                out.extend((s.arrival_s + off, s, k) for k, off in enumerate(s.offsets_s))
            else:
                out.append((s.arrival_s, s, 0))
        return out

    def finished(self, s: Session, index: int, now: float) -> list[tuple[float, Session, int]]:
        """Calls that the end of call `index` of `s` at `now` releases."""
        if s.offsets_s:
            return []
        kids = self._children.get((s.session_id, index))
        if kids:
            self._open[(s.session_id, index)] = len(kids)
            return [(now + k.arrival_s, k, 0) for k in kids]
        return self._after(s, index, now)

    def _after(self, s: Session, index: int, now: float) -> list[tuple[float, Session, int]]:
        """Call `index` of `s` is complete, sub-sessions included: its successor, or, at the
        session's end, what its parent was waiting for."""
        if index + 1 < len(s.calls):
            return [(now + s.calls[index].think_s, s, index + 1)]
        if s.parent is None:
            return []
        key = (s.parent, s.after_call)
        left = self._open[key] - 1
        self._open[key] = left
        if left:
            return []
        del self._open[key]
        return self._after(self._by_id[s.parent], s.after_call, now)


# Event kinds of `Engine.log` (bound.py): a call admitted (its prompt's block keys, how many of
# them a hit may cover, whether its hits count, whether its prompt ends in a partial block), a
# decode step opening a block, a decode step filling one (its key), a call releasing its blocks
# (finished or preempted), a block prefetched into the cache.
EV_ADMIT: Final = 0
EV_OPEN: Final = 1
EV_FILL: Final = 2
EV_RELEASE: Final = 3
EV_PREFETCH: Final = 4


class CacheTooSmall(InputError):
    """A call cannot fit in the GPU cache at all, or the cache thrashes (preempts without end)."""


def blocks_needed(call: Any, block_size: int) -> int:
    """Blocks a call holds at its end: its prompt and output (the last output token's KV is never
    written)."""
    return -(-(call.prompt_len + max(call.output_len - 1, 0)) // block_size)


def check_fits(sessions: Sequence[Session], gpu_blocks: int, block_size: int) -> None:
    """CacheTooSmall naming the first call whose prompt and output cannot fit in the GPU cache at
    once (it would preempt itself for ever)."""
    for s in sessions:
        for k, call in enumerate(s.calls):
            need = blocks_needed(call, block_size)
            if need > gpu_blocks:
                where = getattr(call, "where", None) or f"session {s.session_id} call {k}"
                raise CacheTooSmall(f"{where}: {call.prompt_len:,} prompt and {call.output_len:,} output tokens need "
                                 f"{need:,} blocks of {block_size} tokens; the GPU cache holds {gpu_blocks:,}: give it "
                                 "more blocks or leave such calls out")


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(math.ceil(q * len(sorted_values))) - 1)]


class Engine:
    def __init__(self, cfg: EngineConfig, policy: ReplayPolicy, prompt_keys: PromptKeys | None = None) -> None:
        """`prompt_keys`: shared with other replays of the same calls (else computed here)."""
        if prompt_keys is not None and prompt_keys.block_size != cfg.block_size:
            raise InputError(f"prompt_keys has block_size {prompt_keys.block_size}, the engine {cfg.block_size}")
        self.cfg = cfg
        self.policy = policy
        self.prompt_keys = prompt_keys or PromptKeys(cfg.block_size)
        self.ref: dict[Hashable, int] = {}    # cached block hash -> reference count
        self.empty = cfg.gpu_blocks           # blocks holding nothing
        self.cached_free = 0                  # cached blocks with no reference
        self.now = 0.0
        self.evictions = 0
        self.preemptions = 0
        tiers = policy.uses_tiers
        self.cpu = TierStore("cpu", cfg.cpu_blocks) if tiers and cfg.cpu_blocks else None
        self.redis = TierStore("redis", cfg.redis_blocks) if tiers and cfg.redis_blocks else None
        self._load_s = 0.0                    # tier loads done for the step being built
        self.load_s_total = 0.0
        self._prefetched: set[Hashable] = set()   # prefetched blocks not yet used or evicted
        # With `record()`, every event of the GPU cache that does not depend on eviction choices
        # (bound.py replays them with the best choices there are).
        self.log: list[tuple] | None = None
        self.prefetch_issued = 0
        self.prefetch_used = 0
        self.prefetch_wasted = 0
        self._hold_room_freed = False   # an admitted request released its hold (`_hold_queued`)

    def where(self, key: Hashable) -> str | None:
        """The closest tier holding a block: "gpu", "cpu", "redis" or None."""
        if key in self.ref:
            return "gpu"
        if self.cpu is not None and key in self.cpu:
            return "cpu"
        if self.redis is not None and key in self.redis:
            return "redis"
        return None

    # -- blocks -------------------------------------------------------------------------------
    def _take(self, n: int) -> bool:
        """Reserve n blocks, evicting cached free blocks if needed."""
        if n > self.empty + self.cached_free:
            return False
        short = n - self.empty
        if short > 0:
            victims = self.policy.evict(short, self.now)
            if len(victims) != short:
                raise RuntimeError(f"policy {self.policy.name} evicted {len(victims)} blocks, asked {short}")
            ref = self.ref
            for key in victims:
                if ref.pop(key, None) != 0:
                    raise RuntimeError(f"policy {self.policy.name} evicted a block in use or unknown")
                if key in self._prefetched:
                    self._prefetched.discard(key)
                    self.prefetch_wasted += 1
            self.cached_free -= short
            self.empty += short
            self.evictions += short
        self.empty -= n
        return True

    def _hold(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """Take references on cached blocks; returns those that were free (now reused)."""
        ref = self.ref
        reused = []
        for k in keys:
            c = ref[k]
            if c == 0:
                self.cached_free -= 1
                reused.append(k)
                if k in self._prefetched:
                    self._prefetched.discard(k)
                    self.prefetch_used += 1
            ref[k] = c + 1
        return reused

    def record(self) -> Engine:
        """Keep the run's event log (`log`) for `bound.belady_hits`; returns the engine."""
        self.log = []
        return self

    def _release(self, req: Request) -> None:
        if self.log is not None:
            self.log.append((EV_RELEASE, id(req)))
        ref = self.ref
        freed = []
        for k in reversed(req.keys):   # tail first, as vLLM frees
            c = ref[k] - 1
            ref[k] = c
            if c == 0:
                freed.append(k)
        self.cached_free += len(freed)
        self.empty += req.partial_blocks
        req.keys = []
        req.partial_blocks = 0
        if freed:
            self.policy.freed(freed, self.now)

    # -- requests -----------------------------------------------------------------------------
    def _admit(self, req: Request) -> bool:
        bs = self.cfg.block_size
        hashes = req.hashes
        ref = self.ref
        hit = 0
        # vLLM always computes the prompt's last token, so a fully cached prompt still misses its
        # last block.
        limit = (req.prompt_len - 1) // bs if self.cfg.recompute_last_token else req.prompt_len // bs
        while hit < limit and hashes[hit] in ref:
            hit += 1
        loads: list[tuple[str, int]] = []
        end = hit
        cpu_end = redis_end = 0
        tiers = self.cpu is not None or self.redis is not None
        if tiers:
            # LMCache looks a request up once (it keeps the answer while vLLM cannot admit it yet),
            # touching its CPU run then only.
            cpu_end, redis_end = lmcache_lookup(hashes, self.cpu, self.redis, touch=not req.looked_up)
            req.looked_up = True
            end, loads = plan_tier_loads(hit, limit, cpu_end, redis_end, self.cfg.cost, bs)
        held = hashes[:hit]
        reusing = 0
        for k in held:
            if ref[k] == 0:
                reusing += 1
        new_keys = [h for h in hashes[hit:] if h not in ref]
        # Blocks past the hit whose content is cached elsewhere are recomputed into blocks of
        # their own that stay uncached (vLLM keeps one cached copy per hash).
        uncached = len(hashes) - hit - len(new_keys) + (1 if req.prompt_len % bs else 0)
        # As vLLM does, check room first (free hits count, since holding them takes them out of
        # the free queue), so nothing is touched when the request does not fit.
        if len(new_keys) + uncached + reusing > self.empty + self.cached_free:
            return False
        reused = self._hold(held)
        if reused:
            self.policy.reused(reused, self.now)
        ok = self._take(len(new_keys) + uncached)
        assert ok, "room was checked above"
        for k in new_keys:
            ref[k] = 1
        req.partial_blocks = uncached
        req.keys = held + new_keys
        if not req.preempted:
            req.gpu_hit_tokens = hit * bs
            req.cpu_hit_tokens = bs * sum(n for t, n in loads if t == "cpu")
            req.redis_hit_tokens = bs * sum(n for t, n in loads if t == "redis")
            req.hit_tokens = req.gpu_hit_tokens + req.cpu_hit_tokens + req.redis_hit_tokens
        req.computed = end * bs
        req.last_hash = cast(int, hashes[-1]) if hashes else 0
        req.running = True
        if self.log is not None:
            self.log.append((EV_ADMIT, id(req), hashes, limit, not req.preempted, 1 if req.prompt_len % bs else 0))
        self.policy.admitted(req, req.keys, hit, self.now)
        if cpu_end > hit:   # blocks it just filed that the CPU tier holds
            self.policy.backed(hashes[hit:cpu_end], ())
        if loads:
            for tier, n in loads:
                self._load_s += self.cfg.cost.load_s(tier, n, bs)
            read = hashes[max(hit, cpu_end):end]
            if self.cpu is not None and read:   # LMCache copies what it reads from Redis into CPU
                self.policy.backed(read, self.cpu.put(read))
        if tiers:   # LMCache stores the prompt from where its own hit ended, blocks vLLM held included
            stored, dropped = lmcache_store(hashes, redis_end, self.cpu, self.redis)
            if stored and self.cpu is not None:
                self.policy.backed(stored, dropped)
        if req.cpu_held:   # loaded: LMCache's own pin took over from the hold
            cast(TierStore, self.cpu).release(req.cpu_held)
            req.cpu_held = []
            self._hold_room_freed = True
        return True

    def _hold_queued(self, waiting: deque[Request]) -> None:
        """Room in the CPU tier's holds came free: the queued requests hold their prefixes again,
        in queue order, while room lasts (a long queue is held as it moves up; a hold cut short
        by the limit grows)."""
        self._hold_room_freed = False
        cpu = cast(TierStore, self.cpu)
        for req in waiting:
            if cpu.hold_room() <= 0:
                break
            if req.cpu_held:
                cpu.release(req.cpu_held)
            req.cpu_held = cpu.hold_prefix(req.hashes)

    def _grow(self, req: Request) -> bool:
        """A decode step writes the KV of the request's newest token: allocate and cache blocks."""
        bs = self.cfg.block_size
        total = req.prompt_len + req.generated   # tokens whose KV exists after this step
        if total % bs == 1 or bs == 1:           # this token opens a new block
            if not self._take(1):
                return False
            req.partial_blocks += 1
            if self.log is not None:
                self.log.append((EV_OPEN, id(req)))
        if total % bs == 0:                      # a block just filled: it becomes cached
            if req.tokens is not None:
                h = hash((req.last_hash, tuple(self._span(req, total - bs, total))))
            else:                                # a trace record names its output's blocks
                h = req.call.output_key(total // bs - len(req.hashes) - 1, req.last_hash)
            req.last_hash = h
            req.partial_blocks -= 1
            key: Hashable = h                    # one object for every use below
            if self.log is not None:
                self.log.append((EV_FILL, id(req), key))
            if key in self.ref:                  # the same content is cached: share it, drop ours
                reused = self._hold([key])
                if reused:
                    self.policy.reused(reused, self.now)
                self.empty += 1
            else:
                self.ref[key] = 1
            req.keys.append(key)
            self.policy.cached(req, [key], self.now)
            # Not written to LMCache's tiers: it stores prompts, not what decode fills (its
            # save_decode_cache is off by default); the next call's prompt carries these blocks.
        return True

    @staticmethod
    def _span(req: Request, start: int, end: int) -> list[int]:
        p = req.prompt_len
        out = req.call.output
        if start >= p:
            return list(out[start - p:end - p])
        return cast(list, req.tokens)[start:p] + list(out[:end - p])

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.computed = 0
        req.generated = 0
        req.running = False
        req.preempted += 1
        self.preemptions += 1

    def run(self, sessions: Sequence[Session], progress: Callable[[int, int], None] | None = None,
            max_preemptions: int | None = None) -> ReplayResult:
        """Replay to the end. `max_preemptions`: give up (RuntimeError) when the cache thrashes.

        A decoding request touches the cache only in the steps where its next token opens or fills
        a block, or where it ends: the loop visits it in those steps only (`_Decoding`), not once
        per token; every other step it just counts towards the batch and its context.

        Python's cycle collector is paused meanwhile: a replay allocates many short-lived
        containers (its passes over them took about 6% of a CacheScout replay) and makes no
        reference cycles (a test checks every policy), so reference counting frees everything."""
        paused = gc.isenabled()
        gc.disable()
        try:
            return self._run(sessions, progress, max_preemptions)
        finally:
            if paused:
                gc.enable()

    def _run(self, sessions: Sequence[Session], progress: Callable[[int, int], None] | None,
             max_preemptions: int | None) -> ReplayResult:
        cfg = self.cfg
        check_fits(sessions, cfg.gpu_blocks, cfg.block_size)
        flow = SessionFlow(sessions)
        pending: list[tuple[float, int, Request]] = []
        order = 0
        for t, s, k in flow.initial():
            heapq.heappush(pending, (t, order, Request(s, k, s.calls[k], t)))
            order += 1
        total_calls = flow.total_calls
        waiting: deque[Request] = deque()
        running: list[Request] = []        # in admission order, as vLLM's running queue
        prefilling: list[Request] = []     # the running requests whose prompt is not all computed
        decoding = _Decoding(cfg.block_size)
        done: list[Request] = []
        steps = 0
        admitted = 0
        policy = self.policy
        bs = cfg.block_size
        tiers = self.cpu is not None or self.redis is not None
        prompt_keys = self.prompt_keys
        while pending or waiting or running:
            if not waiting and not running and pending[0][0] > self.now:
                self.now = pending[0][0]
            while pending and pending[0][0] <= self.now:
                _, _, req = heapq.heappop(pending)
                req.tokens = req.call.prompt_tokens()
                req.prompt_len = req.call.prompt_len
                req.output_len = req.call.output_len
                req.hashes = prompt_keys(req.call)
                waiting.append(req)
                policy.arrived(req, self.now)
                if self.cpu is not None and policy.holds_queued:
                    req.cpu_held = self.cpu.hold_prefix(req.hashes)
            # 1) decode for running requests past prefill, then prefill chunks
            n_decode, context = decoding.batch(running, steps)
            budget = cfg.max_batched_tokens - n_decode
            prefill: list[tuple[Request, int]] = []
            # (vLLM schedules running requests first, then admits new ones in arrival order)
            for req in prefilling:
                if budget <= 0:
                    break
                chunk = min(budget, req.prompt_len - req.computed)
                prefill.append((req, chunk))
                budget -= chunk
            # 2) admit waiting requests while there is room
            while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
                req = waiting[0]
                if not self._admit(req):
                    break
                waiting.popleft()
                running.append(req)
                prefilling.append(req)
                req.admitted = admitted
                admitted += 1
                chunk = min(budget, req.prompt_len - req.computed)
                prefill.append((req, chunk))
                budget -= chunk
            if self._hold_room_freed:
                self._hold_queued(waiting)
            if not n_decode and not prefill:
                if running or waiting:
                    # Nothing fits: only possible when the cache cannot hold one request.
                    raise CacheTooSmall("a request needs more KV blocks than the GPU cache holds; raise gpu_blocks")
                continue
            prefill_tokens = sum(c for _, c in prefill)
            pairs = (sum([attention_pairs(r.computed, c) for r, c in prefill])
                     if cfg.cost.attention_s_per_token_context else 0.0)
            step_s = cfg.cost.step_s(prefill_tokens, n_decode, context, pairs) + self._load_s
            self.load_s_total += self._load_s
            self._load_s = 0.0
            self.now += step_s
            step = steps
            steps += 1
            # 3) apply the step: the decoding requests whose token opens or fills a block, or ends
            finished: list[Request] = []
            for req in decoding.due(step):
                if not req.running:
                    continue  # preempted earlier in this step
                req.generated = decoding.generated(req, step)
                # Only a token that opens or fills a block touches the cache (see `_grow`).
                edge = (req.prompt_len + req.generated) % bs
                while (edge <= 1 or bs == 1) and not self._grow(req):
                    victim = running.pop()
                    if victim.computed < victim.prompt_len:
                        prefilling.remove(victim)
                    else:
                        decoding.leave(victim)
                    self._preempt(victim)
                    if max_preemptions is not None and self.preemptions > max_preemptions:
                        raise CacheTooSmall(f"the GPU cache thrashes ({self.preemptions} preemptions)")
                    waiting.appendleft(victim)
                    if victim is req:
                        break
                if not req.running:
                    continue
                req.generated += 1
                if req.generated >= req.output_len:
                    finished.append(req)
                else:
                    decoding.schedule(req, step + 1)
            for req, chunk in prefill:
                if not req.running:
                    continue
                req.computed += chunk
                if req.computed >= req.prompt_len:
                    prefilling.remove(req)
                    if req.first_token_at is None:
                        req.first_token_at = self.now
                    req.generated = 1            # the prefill step samples the first token
                    if req.output_len <= 1:
                        finished.append(req)
                    else:
                        decoding.schedule(req, step + 1)
                    decoding.changed()
            for req in finished:
                req.finished_at = self.now
                req.running = False
                policy.finished(req, self.now)   # as in vLLM: the connector hears it before the frees
                self._release(req)
                running.remove(req)
                decoding.leave(req)
                done.append(req)
                req.tokens = None  # free memory
                for t, s, k in flow.finished(req.session, req.index, self.now):
                    heapq.heappush(pending, (t, order, Request(s, k, s.calls[k], t)))
                    order += 1
                if progress is not None:
                    progress(len(done), total_calls)
            if tiers:
                self._prefetch(step_s)
        return ReplayResult(policy.name, done, self.now, steps, self.preemptions, self.evictions,
                            self.load_s_total, self.prefetch_issued, self.prefetch_used, self.prefetch_wasted)

    def _prefetch(self, step_s: float) -> None:
        """Background transfers the policy asks for, as much as the links carry during a step:
        CPU -> GPU (the block joins the GPU cache, free) and Redis -> CPU."""
        keys = self.policy.prefetch(self, self.now)
        if not keys:
            return
        cost = self.cfg.cost
        block_bytes = self.cfg.block_size * cost.kv_bytes_per_token
        to_gpu = int(cost.cpu_gbps * 1e9 * step_s / block_bytes)
        to_cpu = int(cost.redis_gbps * 1e9 * step_s / block_bytes)
        arrived: list[Hashable] = []
        for key in keys:
            tier = self.where(key)
            if tier == "cpu" and to_gpu > 0:
                # Room comes from an empty block or from evicting one the policy knows: this batch's
                # blocks are cached and free, but the policy hears of them only after the loop.
                if self.empty == 0 and self.cached_free <= len(arrived) or not self._take(1):
                    break
                self.ref[key] = 0
                self.cached_free += 1
                self._prefetched.add(key)
                if self.log is not None:
                    self.log.append((EV_PREFETCH, key))
                arrived.append(key)
                to_gpu -= 1
            elif tier == "redis" and to_cpu > 0 and self.cpu is not None:
                self.policy.backed([key], self.cpu.put([key]))
                to_cpu -= 1
        if arrived:
            self.prefetch_issued += len(arrived)
            self.policy.prefetched(arrived, self.now)
