"""The benchmark: every policy on the same workload, cache size and run; figures and a table."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cachescout.policy import NATIVE_STATUS, PolicyConfig

from .metrics import inference_accuracy
from .policies import make_policy
from .replay import CostProfile, Engine, EngineConfig, PromptKeys
from .table import render
from .sweep import CACHE_FACTORS, LOAD_FACTORS, SWEEP_POLICIES, cache_sweep, load_sweep, plot
from .trace import export_trace, read_trace
from .workloads import Session, WorkloadSpec, anchor_share, generate

DEFAULT_POLICIES = ("lru", "cachescout", "cachescout-hints", "oracle")
TARGET_LRU_HIT = 0.68  # default pressure: LRU inside the 60-75% band


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    families: Sequence[str] = ("gsm8k", "mtbench", "gaia", "swebench")
    policies: Sequence[str] = DEFAULT_POLICIES
    sessions: int = 300
    rate: float = 2.0
    routing: str = "learned"
    arrivals: str = "poisson"
    seed: int = 1
    gpu_blocks: int | None = None       # None: calibrate to TARGET_LRU_HIT per workload
    block_size: int = 16
    cpu_blocks: int = 0                 # LMCache CPU tier, in blocks (0: none)
    redis_blocks: int = 0               # Redis tier, in blocks (0: none)
    cpu_ratio: float = 0.0              # ... or as a multiple of each workload's GPU cache
    redis_ratio: float = 0.0
    cost_profile: str = "llama3.1-8b-h200"
    policy_config: PolicyConfig = PolicyConfig()
    sweeps: bool = True                 # cache-size and load sweeps (for the plots)
    ttft_budget_ms: float = 1000.0      # p99 TTFT budget for "load sustained"
    plots: str | None = None            # write the PNG here
    jobs: int = 1                       # workloads replayed in parallel processes
    fresh_process: bool = False         # each workload in a new interpreter, one at a time (clean timings)
    trace: str | None = None            # replay this trace file instead of the built-in workloads
    trace_block_size: int = 512         # block size of trace records that do not state theirs
    strict_trace: bool = False          # reject a trace with a malformed line (else skip it)
    export_trace: str | None = None     # write each built-in workload's calls here (a folder)
    engine: str = "fast"                # "vllm": also replay on vLLM's own scheduler (GPU tier only)


Progress = Callable[[str], None]


def calibrate_gpu_blocks(sessions: Sequence[Session], block_size: int, target: float = TARGET_LRU_HIT,
                         prompt_keys: PromptKeys | None = None) -> int:
    """Smallest GPU cache (blocks, within 2%) at which LRU reaches `target` token hit rate."""
    prompt_keys = prompt_keys or PromptKeys(block_size)

    def lru_hit(blocks: int) -> float:
        try:
            result = Engine(EngineConfig(gpu_blocks=blocks, block_size=block_size),
                            make_policy("lru", PolicyConfig(block_size=block_size)), prompt_keys).run(
                                sessions, max_preemptions=len(sessions))
        except RuntimeError:  # too small to hold one request, or thrashing
            return 0.0
        return result.summary()["token_hit_rate"]

    lo, hi = 512, 1024
    while lru_hit(hi) < target:
        lo, hi = hi, hi * 2
        if hi > 1 << 24:
            raise ValueError(f"LRU never reaches a {target:.0%} hit rate on this workload")
    while hi - lo > max(16, lo // 50):
        mid = (lo + hi) // 2
        if lru_hit(mid) < target:
            lo = mid
        else:
            hi = mid
    return hi


def run_workload(family: str, opts: BenchOptions, progress: Progress | None = None) -> dict:
    spec = WorkloadSpec(family=family, sessions=opts.sessions, rate=opts.rate, arrivals=opts.arrivals,
                        routing=opts.routing, seed=opts.seed)
    sessions = generate(spec)
    report = run_sessions(family, sessions, opts.block_size, opts, progress,
                          export=Path(opts.export_trace) / f"{family}.jsonl" if opts.export_trace else None)
    report["spec"] = dataclasses.asdict(spec)
    report["anchor_share"] = anchor_share(sessions)
    return report


def run_trace(opts: BenchOptions, progress: Progress | None = None) -> dict:
    sessions, read = read_trace(opts.trace, block_size=opts.trace_block_size, strict=opts.strict_trace)
    if not sessions:
        raise ValueError(f"--trace {opts.trace}: no valid record ({read.skipped} skipped)")
    block_size = sessions[0].calls[0].block_size
    report = run_sessions(Path(opts.trace).name, sessions, block_size, opts, progress)
    report["trace"] = {"path": str(opts.trace), "records": read.records, "skipped": read.skipped,
                       "errors": read.errors}
    return report


def run_sessions(name: str, sessions: Sequence[Session], block_size: int, opts: BenchOptions,
                 progress: Progress | None = None, export: Path | None = None) -> dict:
    """Every policy of `opts` on the same sessions and cache size."""
    calls = sum(len(s.calls) for s in sessions)
    # Every replay below shares the prompts' block keys: each `replay_calls_per_s` is the policy's
    # replay alone (a trace file gives the keys once, too).
    prompt_keys = PromptKeys(block_size)
    blocks = opts.gpu_blocks
    if blocks is None:
        if progress:
            progress(f"{name}: sizing the GPU cache for LRU at {TARGET_LRU_HIT:.0%}")
        blocks = calibrate_gpu_blocks(sessions, block_size, prompt_keys=prompt_keys)
    cpu_blocks = opts.cpu_blocks or int(opts.cpu_ratio * blocks)
    redis_blocks = opts.redis_blocks or int(opts.redis_ratio * blocks)
    cfg = EngineConfig(gpu_blocks=blocks, block_size=block_size, cpu_blocks=cpu_blocks,
                       redis_blocks=redis_blocks, cost=CostProfile.named(opts.cost_profile))
    unbounded = Engine(EngineConfig(gpu_blocks=1 << 30, block_size=block_size),
                       make_policy("lru", PolicyConfig(block_size=block_size)), prompt_keys).run(sessions)
    bound = unbounded.summary()
    if export is not None:
        export.parent.mkdir(parents=True, exist_ok=True)
        export_trace(unbounded, export, block_size)
    if opts.engine == "vllm":
        return _on_vllm(name, sessions, cfg, opts, progress, prompt_keys)
    labelled = all(c.agent is not None for s in sessions for c in s.calls)
    results = []
    policy_cfg = dataclasses.replace(opts.policy_config, block_size=block_size)
    for policy_name in opts.policies:
        if policy_name == "cachescout-hints" and not labelled:
            raise ValueError("cachescout-hints needs every trace record to carry 'agent' (and 'session_id')")
        policy = make_policy(policy_name, policy_cfg, sessions)
        t0 = time.perf_counter()
        tick = _ticker(progress, f"{name}: {policy_name}") if progress else None
        summary = Engine(cfg, policy, prompt_keys).run(sessions, tick).summary()
        summary["replay_wall_s"] = time.perf_counter() - t0
        summary["replay_calls_per_s"] = calls / summary["replay_wall_s"]
        observations = getattr(policy, "observations", None)
        if observations is not None and labelled:
            summary.update(inference_accuracy(observations, warmup=min(200, calls // 10)))
        results.append(summary)
    known = {r["policy"]: r for r in results}
    sweeps = {}
    if opts.sweeps:
        swept = [p for p in SWEEP_POLICIES if p in opts.policies]
        total = len(swept) * (len(CACHE_FACTORS) + len(LOAD_FACTORS))
        done = [0]

        def tick() -> None:
            done[0] += 1
            if progress:
                progress(f"{name}: sweeps {done[0]}/{total}")
        base_rate = opts.rate if opts.trace is None else None
        sweeps["cache_sweep"] = cache_sweep(sessions, cfg, policy_cfg, swept, known=known, tick=tick,
                                            prompt_keys=prompt_keys)
        if base_rate is not None:
            sweeps["load_sweep"] = load_sweep(sessions, cfg, policy_cfg, base_rate, swept,
                                              ttft_budget_ms=opts.ttft_budget_ms, known=known, tick=tick,
                                              prompt_keys=prompt_keys)
            for r in results:
                got = sweeps["load_sweep"].get(r["policy"])
                if got:
                    r["throughput_at_saturation_calls_per_s"] = got["throughput_at_saturation_calls_per_s"]
                    r["max_load_within_ttft_budget_sessions_per_s"] = got["max_load_within_ttft_budget_sessions_per_s"]
    lru = next((r for r in results if r["policy"] == "lru"), None)
    oracle = next((r for r in results if r["policy"] == "oracle"), None)
    for r in results:
        if lru is None:
            continue
        r["ttft_mean_vs_lru"] = r["ttft_mean_ms"] / lru["ttft_mean_ms"] - 1 if lru["ttft_mean_ms"] else 0.0
        if oracle is not None:
            gap = oracle["token_hit_rate"] - lru["token_hit_rate"]
            r["oracle_gap_closed"] = (r["token_hit_rate"] - lru["token_hit_rate"]) / gap if gap > 0 else 0.0
    return {
        "workload": name,
        "sessions": len(sessions),
        "calls": calls,
        "anchor_share": None,
        "gpu_blocks": blocks,
        "cpu_blocks": cpu_blocks,
        "redis_blocks": redis_blocks,
        "cost_profile": opts.cost_profile,
        "block_size": block_size,
        "unbounded_cache_hit_rate": bound["token_hit_rate"],
        "results": results,
        **sweeps,
    }


def fast_twin(policy: str, sessions: Sequence[Session], tiered: bool) -> str:
    """The fast-replay policy that sees what `policy` sees inside vLLM. A trace gives vLLM tokens made
    from its block ids, which cannot link one workflow's calls to different agents (the fast replay
    links them through the trace's content sketches): `cachescout-hashonly`. With lower tiers,
    CacheScout prefetches into LMCache's CPU tier, not into the GPU: `cachescout-noprefetch`."""
    if policy != "cachescout":
        return policy
    if sessions and sessions[0].calls[0].prompt_tokens() is None:
        return "cachescout-hashonly"
    return "cachescout-noprefetch" if tiered else policy


def _on_vllm(name: str, sessions: Sequence[Session], cfg: EngineConfig, opts: BenchOptions,
             progress: Progress | None, prompt_keys: PromptKeys | None = None) -> dict:
    """The same sessions and cache size on vLLM's scheduler and on the fast engine."""
    from .vllm_replay import compare_engines, vllm_version   # imports vLLM: only when asked for

    policy_cfg = dataclasses.replace(opts.policy_config, block_size=cfg.block_size)
    fast = {}
    tiered = bool(cfg.cpu_blocks or cfg.redis_blocks)
    names = list(dict.fromkeys([*opts.policies, *(fast_twin(p, sessions, tiered) for p in opts.policies)]))
    for policy_name in names:
        tick = _ticker(progress, f"{name}: {policy_name} (fast)") if progress else None
        fast[policy_name] = Engine(cfg, make_policy(policy_name, policy_cfg), prompt_keys).run(sessions, tick).summary()
    tick = None
    if progress:
        tickers: dict[str, Callable[[int, int], None]] = {}

        def tick(policy: str, done: int, total: int) -> None:
            if policy not in tickers:
                tickers[policy] = _ticker(progress, f"{name}: {policy} (vLLM)")
            tickers[policy](done, total)
    return {
        "workload": name,
        "engine": "vllm",
        "vllm_version": vllm_version(),
        "sessions": len(sessions),
        "calls": sum(len(s.calls) for s in sessions),
        "anchor_share": None,
        "gpu_blocks": cfg.gpu_blocks,
        "cpu_blocks": cfg.cpu_blocks,
        "redis_blocks": cfg.redis_blocks,
        "block_size": cfg.block_size,
        "cost_profile": opts.cost_profile,
        "results": compare_engines(name, sessions, cfg, opts.policies, fast, tick,
                                   twins={p: fast_twin(p, sessions, tiered) for p in opts.policies}),
    }


def _ticker(progress: Progress, label: str) -> Callable[[int, int], None]:
    state = {"last": -1}

    def tick(done: int, total: int) -> None:
        pct = 100 * done // total
        if pct != state["last"] and (pct % 5 == 0 or done == total):
            state["last"] = pct
            bar = "#" * (pct // 5) + "." * (20 - pct // 5)
            progress(f"{label:28s} [{bar}] {pct:3d}%")
    return tick


def format_table(report: dict) -> str:
    if report.get("engine") == "vllm":
        from .vllm_replay import format_engine_table
        return format_engine_table(report)
    share = report.get("anchor_share")
    anchors = f"anchors {share:.0%} of prompt tokens, " if share is not None else ""
    head = (f"{report['workload']}: {report['sessions']} sessions, {report['calls']} calls, {anchors}"
            f"GPU cache {report['gpu_blocks']} blocks x {report['block_size']} tokens, "
            + (f"CPU {report['cpu_blocks']}, Redis {report['redis_blocks']} blocks, "
               if report.get("cpu_blocks") or report.get("redis_blocks") else "") +
            f"unbounded-cache hit rate {report['unbounded_cache_hit_rate']:.3f}")
    if "trace" in report and report["trace"]["skipped"]:
        head += f"\n  ({report['trace']['skipped']} malformed trace lines skipped, e.g. {report['trace']['errors'][0]})"
    cols = ("policy", "hit", "prefill tok", "TTFT mean", "TTFT p99", "vs LRU", "gap closed", "load@TTFT",
            "agents", "sessions", "next-agent")
    rows = [cols]
    for r in report["results"]:
        rows.append((
            r["policy"], f"{r['token_hit_rate']:.3f}", f"{r['prefill_tokens']:,}", f"{r['ttft_mean_ms']:.0f} ms",
            f"{r['ttft_p99_ms']:.0f} ms", f"{r.get('ttft_mean_vs_lru', 0.0):+.0%}",
            f"{r['oracle_gap_closed']:.0%}" if "oracle_gap_closed" in r else "-",
            (f"{r['max_load_within_ttft_budget_sessions_per_s']:g}/s"
             if r.get("max_load_within_ttft_budget_sessions_per_s") is not None
             else ("<" if "max_load_within_ttft_budget_sessions_per_s" in r else "-")),
            f"{r['agent_accuracy']:.3f}" if "agent_accuracy" in r else "-",
            f"{r['session_continuity']:.3f}" if "session_continuity" in r else "-",
            f"{r['prediction_accuracy']:.3f}" if "prediction_accuracy" in r else "-"))
    return render(head, rows)


def _run_workload_as_built(family: str, opts: BenchOptions, build: str) -> dict:
    """`run_workload` in a new interpreter, which must run the build this process runs: one that
    imports after a source changed runs the sources, and its timings would not compare."""
    if NATIVE_STATUS != build:
        raise RuntimeError(f"the {family} run in a fresh process would use another build ({NATIVE_STATUS}) than "
                           f"this one ({build}): did a source change during the run?")
    return run_workload(family, opts, None)


def run(opts: BenchOptions, progress: Progress | None = None, out=None) -> dict:
    out = out or sys.stdout   # looked up now, so a redirected stdout is honoured
    reports = []
    if opts.trace:
        reports.append(run_trace(opts, progress))
        print(format_table(reports[-1]) + "\n", file=out, flush=True)
    families = [] if opts.trace else list(opts.families)
    if opts.fresh_process:
        # A CPU-time measurement (the connector's cost per step) should see what a vLLM server's
        # process holds, not the heap this process built for earlier workloads: a new interpreter
        # per workload (spawned, so nothing is inherited), one after the other.
        spawn = multiprocessing.get_context("spawn")
        for i, family in enumerate(families):
            if progress:
                progress(f"{family}: running in a fresh process ({i}/{len(families)} workloads done)")
            with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                report = pool.submit(_run_workload_as_built, family, opts, NATIVE_STATUS).result()
            reports.append(report)
            print(format_table(report) + "\n", file=out, flush=True)
    elif opts.jobs > 1 and len(families) > 1:
        # Workloads are independent and every replay is deterministic: run them side by side.
        with concurrent.futures.ProcessPoolExecutor(max_workers=min(opts.jobs, len(families))) as pool:
            futures = [pool.submit(run_workload, family, opts, None) for family in families]
            for i, future in enumerate(futures):
                if progress:
                    progress(f"{families[i]}: running ({i}/{len(families)} workloads done)")
                report = future.result()
                reports.append(report)
                print(format_table(report) + "\n", file=out, flush=True)
    else:
        for family in families:
            report = run_workload(family, opts, progress)
            reports.append(report)
            print(format_table(report) + "\n", file=out, flush=True)
    if opts.plots and opts.engine != "vllm":
        plot(reports, opts.plots)
    if opts.engine == "vllm":
        return {
            "semantics": "GPU-tier token-weighted prefix hits as vLLM's scheduler reports them "
                         "(prefill_stats.num_local_cached_tokens), beside the fast engine's on the same "
                         "sessions and cache size; connector and scheduler times are CPU time of the "
                         "scheduler's thread, step time the cost model's GPU step plus the scheduler's",
            "build": NATIVE_STATUS,
            "workloads": reports,
        }
    return {
        "semantics": "token-weighted prefix hits under vLLM block semantics (full blocks, chained hashes, "
                     "last prompt token always recomputed); TTFT on a virtual clock from the cost model",
        "bound": "oracle: prefix-aware Belady on the GPU tier (the bound for eviction-only policies); "
                 "oracle_gap_closed = (policy - lru) / (oracle - lru); unbounded_cache_hit_rate: an infinite cache",
        "build": NATIVE_STATUS,   # replay_wall_s and replay_calls_per_s depend on it, no other figure does
        "workloads": reports,
    }
