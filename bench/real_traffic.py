"""Real traffic: every policy on mixes of recorded conversations, at several cache sizes, loops and
timings, against the bound of each run (bound.py).

    python -m cachescout.bench.real_traffic --trace ../shared/traces/claude-code [--quick]

A mix is `count` conversations of the trace folder chosen and started at random (over the trace
window) by `seed`, replayed closed-loop (each call its recorded think time after the previous one
finished here) or open-loop (at the recorded times). Per mix, the GPU cache is sized where LRU hits
each of `targets` (calibrated as the main benchmark does). A closed loop is chaotic: waits a few
seconds apart reorder calls and change which context is evicted just before its conversation
returns, and LRU's own hit rate moves by about a point, its mean TTFT by several percent, from that
alone. So each cell is replayed `jitters` times, the recorded waits and then variations of them
(every wait scaled by its own factor within +-`wait_spread`, `workloads.waits_varied`), every
policy on the same ones, and reported as the mean; `spread` is LRU's standard deviation across
them, the noise any difference must be read against. GPU tier only unless `cpu_ratio`.

With `max_jitters` above `jitters`, a cell whose verdict for the `decide` policy is still open after
its `jitters` timings gets further ones, one at a time, up to `max_jitters`. The verdict is the one
the summary gives: hit rate not more than 0.2 points below the base's, mean TTFT not above 1.02x
its. It is open while either figure is within two standard errors of its threshold, on either side
(so a cell that looks good but is as noisy gets more timings too); the rule looks at the noise
around the threshold, never at which side a cell falls.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from cachescout.policy import NATIVE_STATUS, PolicyConfig

from .bound import belady_hits
from .policies import REGISTRY, guard_gain, make_policy
from .replay import DEFAULT_COST_PROFILE, CostProfile, Engine, EngineConfig, PromptKeys
from .run import WAIT_SPREAD, calibrate_gpu_blocks
from .table import render
from .trace import TraceOptions, load_trace
from .workloads import waits_varied

QUICK = {"closed": (32,), "open": ()}


@dataclasses.dataclass(frozen=True)
class Cell:
    trace: str
    count: int
    seed: int
    loop: str
    target: float
    policies: tuple[str, ...]
    jitters: int
    cpu_ratio: float
    window_s: float
    cost_profile: str = DEFAULT_COST_PROFILE
    wait_spread: float = WAIT_SPREAD
    max_jitters: int = 0        # above `jitters`: further timings while `decide`'s verdict is open
    decide: str | None = None


# The summary's thresholds: a policy is no worse than the base in a cell when its hit rate is not
# more than HIT_MARGIN below the base's and its mean TTFT not above TTFT_MARGIN times the base's.
HIT_MARGIN = 0.002
TTFT_MARGIN = 1.02


def run_cell(cell: Cell) -> dict[str, Any]:
    """Every policy on one mix at the cache size where LRU hits `cell.target`, under each timing."""
    sessions, _ = load_trace(cell.trace, TraceOptions(conversations=cell.count, seed=cell.seed, loop=cell.loop,
                                                      window_s=cell.window_s))
    bs = sessions[0].calls[0].block_size
    keys = PromptKeys(bs)
    base = CostProfile.named(cell.cost_profile)
    blocks = calibrate_gpu_blocks(sessions, bs, target=cell.target, prompt_keys=keys, cost=base)
    cpu = int(cell.cpu_ratio * blocks)
    cfg = PolicyConfig(block_size=bs, **base.policy_settings())
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in cell.policies}
    bounds = []
    tier_bounds = []   # with a CPU tier: on hits in any tier
    base_name = "lmcache-lru" if "lmcache-lru" in runs else "lru"
    j = 0
    while j < cell.jitters or (j < cell.max_jitters and cell.decide in runs and base_name in runs
                               and verdict_open(runs[cell.decide], runs[base_name])):
        varied = waits_varied(sessions, j, cell.wait_spread)
        j += 1
        best = best_tiers = 0.0
        for name in cell.policies:
            policy = make_policy(name, cfg, varied)
            engine = Engine(EngineConfig(gpu_blocks=blocks, block_size=bs, cpu_blocks=cpu, cost=base),
                            policy, keys).record()
            s = engine.run(varied).summary()
            s["guard_gain"] = guard_gain(policy)
            assert engine.log is not None
            best = max(best, belady_hits(engine.log, blocks, bs) / s["prompt_tokens"])
            if cpu:
                # The GPU cache and the CPU tier never hold more distinct blocks than both
                # capacities, and a hit in any tier is a prefix of what they hold: Belady over the
                # run's calls with one cache of that size bounds it.
                best_tiers = max(best_tiers, belady_hits(engine.log, blocks + cpu, bs) / s["prompt_tokens"])
            engine.log = None
            runs[name].append({k: s[k] for k in ("token_hit_rate", "gpu_token_hit_rate", "ttft_mean_ms", "ttft_p99_ms",
                                                  "prefetch_precision", "guard_gain") if s[k] is not None})
        bounds.append(best)
        tier_bounds.append(best_tiers)
    out: dict[str, Any] = {"count": cell.count, "seed": cell.seed, "loop": cell.loop, "target": cell.target,
                           "gpu_blocks": blocks, "cpu_blocks": cpu, "calls": sum(len(s.calls) for s in sessions),
                           "bound_gpu_hit_rate": statistics.fmean(bounds), "policies": {},
                           "timings": j, "timings_least": cell.jitters,
                           "timings_allowed": max(cell.jitters, cell.max_jitters)}
    if cpu:
        out["bound_hit_rate"] = statistics.fmean(tier_bounds)
    for name, rs in runs.items():
        agg = mean_of_runs(rs)
        agg["runs"] = rs
        out["policies"][name] = agg
    lru = runs.get(base_name)
    if lru and len(lru) > 1:
        out["lru_spread"] = statistics.stdev(r["token_hit_rate"] for r in lru)
        # Each policy against LRU on the same timings: the mean difference and its standard error.
        for name, rs in runs.items():
            out["policies"][name]["paired_se"] = hit_difference(rs, lru)[1]
    return out


def hit_difference(runs: Sequence[dict[str, float]], base: Sequence[dict[str, float]]) -> tuple[float, float | None]:
    """A policy's mean hit rate minus the base's over the same timings, and the standard error of
    that paired difference (None for fewer than two)."""
    d = [a["token_hit_rate"] - b["token_hit_rate"] for a, b in zip(runs, base, strict=True)]
    return statistics.fmean(d), (statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else None)


def ttft_ratio(runs: Sequence[dict[str, float]], base: Sequence[dict[str, float]]) -> float:
    """A policy's mean TTFT over its timings as a multiple of the base's (1.0 where the base's is 0)."""
    b = statistics.fmean(r["ttft_mean_ms"] for r in base)
    return statistics.fmean(r["ttft_mean_ms"] for r in runs) / b if b else 1.0


def verdict_open(runs: Sequence[dict[str, float]], base: Sequence[dict[str, float]]) -> bool:
    """Whether the timings so far leave the summary's verdict undecided: the hit difference or the
    TTFT ratio within two standard errors of its threshold (either side), or too few timings to say."""
    diff, diff_se = hit_difference(runs, base)
    ratio_se = ttft_ratio_se(runs, base)
    if diff_se is None or ratio_se is None:
        return True
    return abs(diff + HIT_MARGIN) < 2 * diff_se or abs(ttft_ratio(runs, base) - TTFT_MARGIN) < 2 * ratio_se


def mean_of_runs(runs: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Each figure's mean over a policy's runs of one cell; one that some timing lacks (no prefetch
    was judged in it) over the runs that have it."""
    names = dict.fromkeys(k for r in runs for k in r)
    return {k: statistics.fmean(r[k] for r in runs if k in r) for k in names}


def matrix(trace: str, counts: dict[str, Sequence[int]], seeds: Sequence[int], targets: Sequence[float],
           policies: Sequence[str], jitters: int, cpu_ratio: float, window_s: float,
           cost_profile: str = DEFAULT_COST_PROFILE, wait_spread: float = WAIT_SPREAD,
           max_jitters: int = 0, decide: str | None = None) -> list[Cell]:
    return [Cell(trace, n, seed, loop, t, tuple(policies), jitters, cpu_ratio, window_s, cost_profile, wait_spread,
                 max_jitters, decide)
            for loop, ns in counts.items() for n in ns for seed in seeds for t in targets]


def distinct(cells: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Cells kept once where several targets gave the same cache (the smallest that holds the mix's
    largest call is already above them), and the repeats."""
    seen: set[tuple] = set()
    kept: list[dict[str, Any]] = []
    dropped: list[dict[str, Any]] = []
    for c in sorted(cells, key=lambda c: (c["loop"], c["count"], c["seed"], c["target"])):
        key = (c["loop"], c["count"], c["seed"], c["gpu_blocks"])
        (dropped if key in seen else kept).append(c)
        seen.add(key)
    return kept, dropped


def summarize(cells: list[dict[str, Any]], ours: str = "cachescout", base: str = "lru") -> dict[str, Any]:
    """The worst and mean differences of `ours` against `base` over every cell."""
    diffs, ratios, p99, precision, gains = [], [], [], [], []
    worse = below = slower = clearly_slower = undecided = 0
    for c in cells:
        a, b = c["policies"].get(ours), c["policies"].get(base)
        if a is None or b is None:
            continue
        d = a["token_hit_rate"] - b["token_hit_rate"]
        diffs.append(d)
        below += d < -HIT_MARGIN
        # Below LRU by more than 0.2 points beyond two standard errors of the paired difference.
        worse += d + 2 * a.get("paired_se", 0.0) < -HIT_MARGIN
        ratio = a["ttft_mean_ms"] / b["ttft_mean_ms"] if b["ttft_mean_ms"] else 1.0
        ratios.append(ratio)
        slower += ratio > TTFT_MARGIN
        # Above 1.02x beyond two standard errors of the ratio over the cell's timings.
        se = ttft_ratio_se(a["runs"], b["runs"]) if "runs" in a and "runs" in b else None
        clearly_slower += ratio - 2 * (se or 0.0) > TTFT_MARGIN
        undecided += "runs" in a and "runs" in b and verdict_open(a["runs"], b["runs"])
        p99.append(a["ttft_p99_ms"] / b["ttft_p99_ms"] if b["ttft_p99_ms"] else 1.0)
        if "prefetch_precision" in a:
            precision.append(a["prefetch_precision"])
        if "guard_gain" in a:
            gains.append(a["guard_gain"])
    if not diffs:
        return {}
    out = {"policy": ours, "against": base, "cells": len(diffs),
           "cells_below_by_0.2pt": below, "cells_clearly_worse": worse, "cells_ttft_over_1.02x": slower,
           "cells_ttft_clearly_over_1.02x": clearly_slower, "cells_undecided": undecided,
           "hit_difference_min": min(diffs), "hit_difference_mean": statistics.fmean(diffs),
           "hit_difference_max": max(diffs),
           "ttft_ratio_max": max(ratios), "ttft_ratio_mean": statistics.fmean(ratios),
           "ttft_p99_ratio_max": max(p99), "ttft_p99_ratio_mean": statistics.fmean(p99)}
    if precision:
        out["prefetch_precision_mean"] = statistics.fmean(precision)
    if gains:
        out.update(guard_gain_min=min(gains), guard_gain_mean=statistics.fmean(gains), guard_gain_max=max(gains))
    return out


def ttft_ratio_se(runs: Sequence[dict[str, float]], base: Sequence[dict[str, float]]) -> float | None:
    """Standard error of a policy's mean-TTFT ratio to the base policy's over the same timings
    (None for fewer than two): how far the ratio moves with timing alone."""
    ratios = [a["ttft_mean_ms"] / b["ttft_mean_ms"] for a, b in zip(runs, base, strict=True) if b["ttft_mean_ms"]]
    return statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else None


def format_cells(cells: list[dict[str, Any]], policies: Sequence[str]) -> str:
    base = "lmcache-lru" if "lmcache-lru" in policies else "lru"
    cols = ["loop", "conv.", "seed", "GPU blocks", "LRU spread"]
    # Where cells could take further timings (--max-jitters), how many each took.
    timed = any(c.get("timings_allowed", 0) > c.get("timings_least", c.get("timings", 0)) for c in cells)
    if timed:
        cols.append("timings")
    for p in policies:
        cols += [p] if p == base else [p, "TTFT"]
    tiers = any("bound_hit_rate" in c for c in cells)
    cols += ["bound (all tiers)" if tiers else "bound"]
    rows = [tuple(cols)]
    for c in sorted(cells, key=lambda c: (c["loop"], c["count"], c["seed"], c["target"])):
        ref = c["policies"][base]
        row = [c["loop"], str(c["count"]), str(c["seed"]), f"{c['gpu_blocks']:,}",
               f"{100 * c['lru_spread']:.2f} pt" if "lru_spread" in c else "-"]
        if timed:
            row.append(str(c.get("timings", "-")))
        for p in policies:
            r = c["policies"][p]
            if p == base:
                row.append(f"{r['token_hit_rate']:.4f} ({r['ttft_mean_ms']:.0f} ms)")
            else:
                se = f" ±{100 * r['paired_se']:.2f}" if "paired_se" in r else ""
                spread = ttft_ratio_se(r["runs"], ref["runs"])
                ttft_se = "" if spread is None else f" ±{spread:.1%}"
                row += [f"{r['token_hit_rate']:.4f} ({100 * (r['token_hit_rate'] - ref['token_hit_rate']):+.2f}{se})",
                        f"{r['ttft_mean_ms'] / ref['ttft_mean_ms'] - 1:+.1%}{ttft_se}" if ref["ttft_mean_ms"] else "-"]
        row.append(f"{c['bound_hit_rate' if tiers else 'bound_gpu_hit_rate']:.4f}")
        rows.append(tuple(row))
    return render("", rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cachescout.bench.real_traffic", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="a folder of kv-cache-tester conversation files")
    p.add_argument("--closed", default="16,32,48", help="conversation counts mixed for closed-loop replays")
    p.add_argument("--open", default="16,24", help="conversation counts mixed for open-loop replays")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--targets", default="0.6,0.75,0.9", help="LRU hit rates the cache sizes are chosen for")
    p.add_argument("--policies", default="lru,cachescout,belady")
    p.add_argument("--jitters", type=int, default=3,
                   help="timings each cell is replayed under: the recorded waits, then variations of them")
    p.add_argument("--max-jitters", type=int, default=0,
                   help="up to this many timings for a cell whose verdict for --decide against LRU (hits within "
                        "0.2 points, mean TTFT within 1.02x) is within two standard errors after --jitters")
    p.add_argument("--decide", default="cachescout", help="the policy whose verdict --max-jitters settles")
    p.add_argument("--wait-spread", type=float, default=WAIT_SPREAD,
                   help="each variation scales every wait by its own random factor within 1 +- this")
    p.add_argument("--cpu-ratio", type=float, default=0.0, help="LMCache CPU tier as a multiple of the GPU cache")
    p.add_argument("--window", type=float, default=1800.0, help="conversations start within this many seconds")
    p.add_argument("--cost-profile", default=DEFAULT_COST_PROFILE,
                   help="step-time and tier profile from bench/data/cost_profiles.json")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--quick", action="store_true", help="one closed-loop count, seeds 1-2 (a few minutes)")
    p.add_argument("--json", default=None, help="write every cell's figures here")
    args = p.parse_args(argv)

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(",") if x)

    counts: dict[str, Sequence[int]] = {"closed": ints(args.closed), "open": ints(args.open)}
    seeds = ints(args.seeds)
    if args.quick:
        counts, seeds = dict(QUICK), (1, 2)
    policies = [x for x in args.policies.split(",") if x]
    targets = [float(x) for x in args.targets.split(",") if x]
    unknown = [x for x in policies if x not in REGISTRY]
    if unknown or not policies:
        p.error(f"--policies: unknown {', '.join(unknown) or '(none given)'}; "
                f"choose from {', '.join(sorted(REGISTRY))}")
    if args.jitters < 1:
        p.error(f"--jitters must be an integer >= 1, got {args.jitters}")
    if args.max_jitters and args.max_jitters < args.jitters:
        p.error(f"--max-jitters must be 0 (off) or at least --jitters ({args.jitters}), got {args.max_jitters}")
    base = "lmcache-lru" if "lmcache-lru" in policies else "lru"
    if args.max_jitters > args.jitters and (args.decide not in policies or args.decide == base or base not in policies):
        p.error(f"--decide must name a policy of --policies other than {base} (which must be there too) "
                f"for --max-jitters; got {args.decide!r}, policies {', '.join(policies)}")
    if not (0.0 <= args.wait_spread < 1.0):
        p.error(f"--wait-spread must be a share within [0, 1), got {args.wait_spread}")
    if not targets or not all(0 < t < 1 for t in targets):
        p.error(f"--targets must be LRU hit rates within (0, 1), got {args.targets!r}")
    if not (math.isfinite(args.cpu_ratio) and args.cpu_ratio >= 0):
        p.error(f"--cpu-ratio must be a finite number >= 0, got {args.cpu_ratio}")
    try:
        CostProfile.named(args.cost_profile)
    except ValueError as e:
        p.error(f"--cost-profile: {e}")
    if not os.path.isdir(args.trace):
        p.error(f"--trace {args.trace}: not a folder of conversation files")
    # A bad folder, or one with fewer conversations than a mix asks for, fails here, not in a worker.
    largest = max((n for ns in counts.values() for n in ns), default=1)
    try:
        load_trace(args.trace, TraceOptions(conversations=largest))
    except ValueError as e:
        p.error(f"--trace {args.trace}: {e}" + (" (lower --closed/--open)" if largest > 1 else ""))
    cells = matrix(args.trace, counts, seeds, targets, policies, args.jitters, args.cpu_ratio, args.window,
                   args.cost_profile, args.wait_spread, args.max_jitters, args.decide)
    t0 = time.time()
    results = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_cell, c) for c in cells]
        for i, f in enumerate(concurrent.futures.as_completed(futures)):
            results.append(f.result())
            sys.stderr.write(f"\r{i + 1}/{len(cells)} cells, {time.time() - t0:.0f} s")
            sys.stderr.flush()
    sys.stderr.write("\n")
    results, dropped = distinct(results)
    for c in dropped:
        print(f"note: {c['loop']} {c['count']} conversations, seed {c['seed']}: LRU cannot be brought to "
              f"{c['target']:.0%} (the largest call needs {c['gpu_blocks']:,} blocks, where LRU already hits "
              f"{c['policies'][policies[0]]['token_hit_rate']:.1%}); the cell is reported once", file=sys.stderr)
    print(format_cells(results, policies))
    summary = {name: summarize(results, ours=name, base=base) for name in policies if name != base}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"build": NATIVE_STATUS, "cells": results, "summary": summary, "args": vars(args)}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
