"""The benchmark: every policy on the same workload, cache size and run; figures and a table."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import cast
from pathlib import Path

from cachescout.policy import NATIVE_STATUS, ExternalError, InputError, PolicyConfig, check_fields, setting

from .metrics import inference_accuracy
from .policies import guard_gain, make_policy
from .bound import belady_hits
from .replay import DEFAULT_COST_PROFILE, CacheTooSmall, CostProfile, Engine, EngineConfig, PromptKeys, blocks_needed
from .table import render
from .sweep import CACHE_FACTORS, LOAD_FACTORS, SWEEP_POLICIES, cache_sweep, load_sweep, plot
from .trace import TraceOptions, export_trace, load_trace
from .workloads import ARRIVALS, ROUTINGS, Session, WorkloadSpec, anchor_share, generate, waits_varied

DEFAULT_POLICIES = ("lru", "cachescout", "cachescout-hints", "belady")
NEED_AGENTS = ("cachescout-hints", "kvflow")   # given the true agents (and sessions) of every call
TARGET_LRU_HIT = 0.68  # default pressure: LRU inside the 60-75% band
CEILING_SHARE = 0.8    # ... or at this share of the unbounded cache's hit rate, if lower
# A closed loop is chaotic: waits a few seconds apart reorder later calls and change which
# context is evicted just before its conversation returns; on a few long conversations LRU's own
# hit rate moves by a point and mean TTFT by several percent from that alone. A trace replayed
# closed loop is reported as the mean over this many timings (the recorded waits, then variations
# of them: `workloads.waits_varied`), each policy against LRU on the same ones.
CLOSED_LOOP_TIMINGS = 3
WAIT_SPREAD = 0.02     # each timing after the first scales every wait by its own factor within +-2%


_COUNT = 10**9            # sessions, blocks: far above any machine's
_SECONDS = 10**9


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """What one benchmark run does. The fields declared with `setting` are also `cachescout bench`'s
    flags of the same name (bench/command.py generates them: type, range, help and default)."""

    families: Sequence[str] = ("gsm8k", "mtbench", "gaia", "swebench")
    policies: Sequence[str] = DEFAULT_POLICIES
    sessions: int = 300
    rate: float = setting(2.0, "session arrivals per second", lo=0, lo_open=True, hi=1e6)
    routing: str = setting("learned", "learned: the supervisor routes by task; uniform: it picks "
                           "specialists uniformly; random: any agent after any, random end", choices=ROUTINGS)
    arrivals: str = setting("poisson", "session arrivals", choices=ARRIVALS)
    seed: int = setting(1, "seed of the workloads and of a trace's mix", lo=0, hi=2**32 - 1)
    gpu_blocks: int | None = setting(
        None, "GPU cache size in blocks (default: sized per workload so LRU hits about 68%)", lo=1, hi=_COUNT)
    block_size: int = setting(16, "tokens per KV block", lo=1, hi=65536)
    cpu_blocks: int = setting(0, "LMCache CPU tier size in blocks for every policy but lru; 0: none", lo=0, hi=_COUNT)
    redis_blocks: int = setting(0, "Redis tier size in blocks; 0: none", lo=0, hi=_COUNT)
    cpu_ratio: float = setting(
        0.0, "CPU tier as a multiple of each workload's GPU cache (instead of --cpu-blocks)", lo=0, hi=1e4)
    redis_ratio: float = setting(0.0, "Redis tier as a multiple of the GPU cache", lo=0, hi=1e4)
    cost_profile: str = setting(DEFAULT_COST_PROFILE, "step-time and tier profile from bench/data/cost_profiles.json; "
                                "the policy's cost settings are taken from it too")
    policy_config: PolicyConfig = PolicyConfig()
    sweeps: bool = True                 # cache-size and load sweeps (for the plots)
    ttft_budget_ms: float = setting(1000.0, "p99 TTFT budget for the load sustained, in ms", lo=0, lo_open=True,
                                    hi=_SECONDS)
    plots: str | None = None            # write the PNG here
    jobs: int = 1                       # workloads replayed in parallel processes
    fresh_process: bool = setting(False, "replay each workload in a new Python process, one at a time (for "
                                  "CPU-time figures such as the connector's cost per step; overrides --jobs)")
    trace: str | None = setting(None, "replay this trace instead: a Mooncake-style JSONL file (.jsonl, "
                                ".jsonl.gz) or kv-cache-tester conversation files (.json, .json.gz: one file, "
                                "or a folder of them, mixed); the format is detected (docs/workloads.md)")
    trace_options: TraceOptions = TraceOptions()   # how to read it (its own settings: --trace-* flags)
    timings: int = setting(0, "replay every policy under this many timings (the recorded waits, then every wait "
                           "scaled by its own random factor within +-2%) and report the means, each policy "
                           "against LRU on the same timings; 0: "
                           f"{CLOSED_LOOP_TIMINGS} for a trace replayed closed loop, whose timing is chaotic, else 1",
                           lo=0, hi=100)
    export_trace: str | None = setting(None, "write each built-in workload's calls to DIR/<workload>.jsonl")
    engine: str = "fast"                # "vllm": also replay on vLLM's own scheduler (GPU tier only)
    policies_chosen: bool = False       # False: `policies` is the default list, which leaves out
                                        # cachescout-hints on a trace that does not label agents

    def __post_init__(self) -> None:
        check_fields(self)


Progress = Callable[[str], None]


def calibrate_gpu_blocks(sessions: Sequence[Session], block_size: int, target: float = TARGET_LRU_HIT,
                         prompt_keys: PromptKeys | None = None, cost: CostProfile | None = None) -> int:
    """Smallest GPU cache (blocks, within 2%) at which LRU reaches `target` token hit rate, timed by
    `cost` (default: the default profile): where calls overlap depends on how long they take."""
    prompt_keys = prompt_keys or PromptKeys(block_size)
    cost = cost or CostProfile()

    def lru_hit(blocks: int) -> float:
        try:
            result = Engine(EngineConfig(gpu_blocks=blocks, block_size=block_size, cost=cost),
                            make_policy("lru", PolicyConfig(block_size=block_size)), prompt_keys).run(
                                sessions, max_preemptions=len(sessions))
        except CacheTooSmall:  # thrashing
            return 0.0
        return result.summary()["token_hit_rate"]

    # The largest call must fit (with room for a second one beside it).
    least = max(blocks_needed(c, block_size) for s in sessions for c in s.calls)
    lo, hi = 512, 1024
    while hi < 2 * least:
        lo, hi = hi, hi * 2
    while lru_hit(hi) < target:
        lo, hi = hi, hi * 2
        if hi > 1 << 24:
            raise InputError(f"LRU never reaches a {target:.0%} hit rate on this workload")
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
    assert opts.trace is not None
    sessions, read = load_trace(opts.trace, opts.trace_options)
    if not sessions:
        why = f": {read.summary()}" if read.skipped else " (it holds no records)"
        raise InputError(f"--trace {opts.trace}: no valid record{why}")
    block_size = sessions[0].calls[0].block_size
    report = run_sessions(Path(opts.trace).name, sessions, block_size, opts, progress)
    report["trace"] = {"path": str(opts.trace), "records": read.records, "skipped": read.skipped,
                       "skip_reasons": dict(read.reasons), "skip_summary": read.summary(), "errors": read.errors,
                       "options": dataclasses.asdict(opts.trace_options)}
    return report


def run_sessions(name: str, sessions: Sequence[Session], block_size: int, opts: BenchOptions,
                 progress: Progress | None = None, export: Path | None = None) -> dict:
    """Every policy of `opts` on the same sessions and cache size."""
    calls = sum(len(s.calls) for s in sessions)
    # Every replay below shares the prompts' block keys: each `replay_calls_per_s` is the policy's
    # replay alone (a trace file gives the keys once, too).
    prompt_keys = PromptKeys(block_size)
    unbounded = Engine(EngineConfig(gpu_blocks=1 << 30, block_size=block_size),
                       make_policy("lru", PolicyConfig(block_size=block_size)), prompt_keys).run(sessions)
    unbounded_hit = unbounded.summary()["token_hit_rate"]
    blocks = opts.gpu_blocks
    if blocks is None:
        # LRU at TARGET_LRU_HIT, or at 80% of what an unbounded cache hits where that is less (a
        # trace with little reuse).
        target = min(TARGET_LRU_HIT, CEILING_SHARE * unbounded_hit)
        if progress:
            progress(f"{name}: sizing the GPU cache for LRU at {target:.0%}")
        blocks = calibrate_gpu_blocks(sessions, block_size, target=target, prompt_keys=prompt_keys,
                                      cost=CostProfile.named(opts.cost_profile))
    cpu_blocks = opts.cpu_blocks or int(opts.cpu_ratio * blocks)
    redis_blocks = opts.redis_blocks or int(opts.redis_ratio * blocks)
    cfg = EngineConfig(gpu_blocks=blocks, block_size=block_size, cpu_blocks=cpu_blocks,
                       redis_blocks=redis_blocks, cost=CostProfile.named(opts.cost_profile))
    if export is not None:
        export.parent.mkdir(parents=True, exist_ok=True)
        export_trace(unbounded, export, block_size)
    if opts.engine == "vllm":
        return _on_vllm(name, sessions, cfg, opts, progress, prompt_keys)
    labelled = all(c.agent is not None for s in sessions for c in s.calls)
    policy_cfg = dataclasses.replace(opts.policy_config, block_size=block_size, **cfg.cost.policy_settings())
    policies = [p for p in opts.policies if labelled or opts.policies_chosen or p not in NEED_AGENTS]
    for policy_name in policies:
        if policy_name in NEED_AGENTS and not labelled:
            unlabelled = sum(c.agent is None for s in sessions for c in s.calls)
            raise InputError(f"{policy_name} needs the true agent of every call ('agent' in the trace); "
                             f"{unlabelled:,} calls here have none")
    timings = opts.timings or (CLOSED_LOOP_TIMINGS if opts.trace and closed_loop(sessions) else 1)
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for j in range(timings):
        varied = waits_varied(sessions, j, WAIT_SPREAD)
        for policy_name in policies:
            label = f"{name}: {policy_name}" + (f" (timing {j + 1}/{timings})" if timings > 1 else "")
            runs[policy_name].append(_replay(policy_name, varied, cfg, policy_cfg, prompt_keys, labelled,
                                             progress, label))
    results = [_mean_of(rs) for rs in runs.values()]
    known = {r["policy"]: r for r in results}
    sweeps = {}
    if opts.sweeps:
        swept = [p for p in SWEEP_POLICIES if p in opts.policies]
        total = len(swept) * (len(CACHE_FACTORS) + len(LOAD_FACTORS))
        done = [0]

        def sweep_tick() -> None:
            done[0] += 1
            if progress:
                progress(f"{name}: sweeps {done[0]}/{total}")
        base_rate = opts.rate if opts.trace is None else None   # a trace's load is given as a factor
        sweeps["cache_sweep"] = cache_sweep(sessions, cfg, policy_cfg, swept, known=known, tick=sweep_tick,
                                            prompt_keys=prompt_keys)
        sweeps["load_sweep"] = load_sweep(sessions, cfg, policy_cfg, base_rate, swept,
                                          ttft_budget_ms=opts.ttft_budget_ms, known=known, tick=sweep_tick,
                                          prompt_keys=prompt_keys)
        for r in results:
            got = sweeps["load_sweep"].get(r["policy"])
            if got:
                for k in ("throughput_at_saturation_calls_per_s", "max_load_within_ttft_budget_sessions_per_s",
                          "max_load_factor_within_ttft_budget"):
                    r[k] = got[k]
    # One bound for every run: the best of the runs' own bounds (each bounds its run).
    bound = max((r["run_bound_gpu_hit_rate"] for r in results), default=0.0)
    for r in results:
        r["within_bound"] = r["gpu_token_hit_rate"] <= bound + 1e-12
    # The baseline every "vs LRU" figure is against: vLLM's LRU, or where only LMCache's is run
    # (a tiered comparison), that one.
    baseline = next((p for p in ("lru", "lmcache-lru") if p in runs), None)
    lru = known[baseline] if baseline is not None else None
    lru_spread = None
    if baseline is not None and timings > 1:
        # Against LRU on the same timings: the mean difference's standard error, beside LRU's own
        # spread across them (the noise of any single replay).
        lru_hits = [r["token_hit_rate"] for r in runs[baseline]]
        lru_spread = statistics.stdev(lru_hits)
        for r in results:
            d = [a["token_hit_rate"] - b for a, b in zip(runs[r["policy"]], lru_hits, strict=True)]
            r["hit_vs_lru"] = statistics.fmean(d)
            r["hit_vs_lru_se"] = statistics.stdev(d) / math.sqrt(len(d))
    for r in results:
        if lru is None:
            continue
        r["ttft_mean_vs_lru"] = r["ttft_mean_ms"] / lru["ttft_mean_ms"] - 1 if lru["ttft_mean_ms"] else 0.0
        # Gap closed: GPU tier only (lower tiers' hits are not bounded by it), and only where the
        # bound leaves room above LRU.
        gap = bound - lru["gpu_token_hit_rate"]
        if not (cpu_blocks or redis_blocks) and gap > 1e-9:
            r["gap_closed"] = (r["gpu_token_hit_rate"] - lru["gpu_token_hit_rate"]) / gap
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
        "unbounded_cache_hit_rate": unbounded_hit,
        "bound_gpu_hit_rate": bound,
        "timings": timings,
        "baseline": baseline,
        "lru_spread": lru_spread,
        "results": results,
        **sweeps,
    }


def closed_loop(sessions: Sequence[Session]) -> bool:
    """Whether some session issues a call only after its previous one finished (its timing then
    depends on the replay's own)."""
    return any(not s.offsets_s and len(s.calls) > 1 for s in sessions)


def _replay(policy_name: str, sessions: Sequence[Session], cfg: EngineConfig, policy_cfg: PolicyConfig,
            prompt_keys: PromptKeys, labelled: bool, progress: Progress | None, label: str) -> dict:
    """One policy's replay: its summary, the bound on its own run, and how well it inferred agents
    and sessions (where the trace labels them)."""
    calls = sum(len(s.calls) for s in sessions)
    policy = make_policy(policy_name, policy_cfg, sessions)
    t0 = time.perf_counter()
    engine = Engine(cfg, policy, prompt_keys).record()
    summary = engine.run(sessions, _ticker(progress, label) if progress else None).summary()
    summary["replay_wall_s"] = time.perf_counter() - t0
    summary["replay_calls_per_s"] = calls / summary["replay_wall_s"]
    if progress:
        progress(f"{label}: the bound on its run")
    # The best any eviction order could have hit on this run's own calls (bound.py).
    summary["run_bound_gpu_hit_rate"] = (belady_hits(cast(list, engine.log), cfg.gpu_blocks, cfg.block_size)
                                         / summary["prompt_tokens"] if summary["prompt_tokens"] else 0.0)
    engine.log = None
    gain = guard_gain(policy)
    if gain is not None:
        summary["guard_gain"] = gain
    observations = getattr(policy, "observations", None)
    if observations is not None and labelled:
        summary.update(inference_accuracy(observations, warmup=min(200, calls // 10)))
    return summary


def _mean_of(runs: Sequence[dict]) -> dict:
    """One policy's figures over its timings: numbers averaged (a figure some timing lacks, over
    those that have it), the rest as the first timing gave them; each timing's hit rate kept."""
    out = dict(runs[0])
    if len(runs) == 1:
        return out
    for k, v in out.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) or v is None:
            got = [r[k] for r in runs if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
            if got and any(g != got[0] for g in got):
                out[k] = statistics.fmean(got)
            elif got:
                out[k] = got[0]
    out["token_hit_rate_by_timing"] = [r["token_hit_rate"] for r in runs]
    return out


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

    policy_cfg = dataclasses.replace(opts.policy_config, block_size=cfg.block_size, **cfg.cost.policy_settings())
    fast = {}
    tiered = bool(cfg.cpu_blocks or cfg.redis_blocks)
    names = list(dict.fromkeys([*opts.policies, *(fast_twin(p, sessions, tiered) for p in opts.policies)]))
    for policy_name in names:
        tick = _ticker(progress, f"{name}: {policy_name} (fast)") if progress else None
        fast[policy_name] = Engine(cfg, make_policy(policy_name, policy_cfg), prompt_keys).run(sessions, tick).summary()
    vllm_tick: Callable[[str, int, int], None] | None = None
    if progress:
        tickers: dict[str, Callable[[int, int], None]] = {}

        def each_policy(policy: str, done: int, total: int) -> None:
            if policy not in tickers:
                tickers[policy] = _ticker(progress, f"{name}: {policy} (vLLM)")
            tickers[policy](done, total)
        vllm_tick = each_policy
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
        "results": compare_engines(name, sessions, cfg, opts.policies, fast, vllm_tick,
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
            f"bound on GPU hits {report['bound_gpu_hit_rate']:.3f} (Belady over each run's own calls), "
            f"unbounded cache {report['unbounded_cache_hit_rate']:.3f}")
    if "trace" in report and report["trace"]["skipped"]:
        head += f"\n  ({report['trace']['skip_summary']})"
    paired = report.get("timings", 1) > 1 and report.get("lru_spread") is not None
    baseline = report.get("baseline", "lru")
    if report.get("timings", 1) > 1:
        head += (f"\n  means over {report['timings']} timings (the recorded waits, then each wait varied within ±2%)"
                 + (f"; LRU's hit rate moves by {100 * report['lru_spread']:.2f} points (sd) across them alone, "
                    "'hit vs LRU': on the same timings, ± its standard error" if paired else ""))
    if baseline not in (None, "lru"):
        head += f"\n  'vs LRU': against {baseline}"
    cols = ("policy", "hit", *(("hit vs LRU",) if paired else ()), "prefill tok", "TTFT mean", "TTFT p99",
            "vs LRU", "gap closed", "load@TTFT", "agents", "sessions", "next-agent")
    rows = [cols]
    for r in report["results"]:
        rows.append((
            r["policy"], f"{r['token_hit_rate']:.3f}",
            *(("-" if r["policy"] == baseline else f"{100 * r['hit_vs_lru']:+.2f} ±{100 * r['hit_vs_lru_se']:.2f} pt",)
              if paired else ()),
            f"{r['prefill_tokens']:,.0f}", f"{r['ttft_mean_ms']:.0f} ms",
            f"{r['ttft_p99_ms']:.0f} ms", f"{r['ttft_mean_vs_lru']:+.0%}" if "ttft_mean_vs_lru" in r else "-",
            f"{r['gap_closed']:.0%}" if "gap_closed" in r else "-",
            _load_cell(r),
            f"{r['agent_accuracy']:.3f}" if "agent_accuracy" in r else "-",
            f"{r['session_continuity']:.3f}" if "session_continuity" in r else "-",
            f"{r['prediction_accuracy']:.3f}" if "prediction_accuracy" in r else "-"))
    return render(head, rows)


def _load_cell(r: dict) -> str:
    """The highest load within the TTFT budget: sessions per second, or a multiple of a trace's
    own load; "<" when not even the lowest one swept stays within it."""
    if "max_load_factor_within_ttft_budget" not in r:
        return "-"
    if r["max_load_within_ttft_budget_sessions_per_s"] is not None:
        return f"{r['max_load_within_ttft_budget_sessions_per_s']:g}/s"
    factor = r["max_load_factor_within_ttft_budget"]
    return "<" if factor is None else f"x{factor:g}"


def _run_workload_as_built(family: str, opts: BenchOptions, build: str) -> dict:
    """`run_workload` in a new interpreter, which must run the build this process runs: one that
    imports after a source changed runs the sources, and its timings would not compare."""
    if NATIVE_STATUS != build:
        raise ExternalError(f"the {family} run in a fresh process would use another build ({NATIVE_STATUS}) than "
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
        "bound": "bound_gpu_hit_rate: the most of the runs' own bounds (run_bound_gpu_hit_rate: Belady over the "
                 "run's calls as it admitted them, the best any eviction order could hit there; bench/bound.py), "
                 "a bound on every run's GPU-tier hit rate; gap_closed = (policy - lru) / (bound - lru), GPU tier "
                 "only, where the bound is above LRU; belady is a policy that knows a reference run's future, not "
                 "a bound; unbounded_cache_hit_rate: an infinite cache",
        "baseline": "each workload's `baseline`: the policy the *_vs_lru figures and lru_spread are of, lru, "
                    "or lmcache-lru where lru was not run (a tiered comparison); none where neither was",
        "build": NATIVE_STATUS,   # replay_wall_s and replay_calls_per_s depend on it, no other figure does
        "workloads": reports,
    }
