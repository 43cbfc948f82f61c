"""Sweeps around a workload's operating point, and the plots made from them.

- Cache size: the same trace at fractions and multiples of the calibrated GPU cache.
- Load: the same sessions offered faster or slower (arrival times and tool latencies scaled, the
  calls themselves unchanged), for throughput at saturation and the load sustained under a TTFT
  budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from cachescout.policy import PolicyConfig

from .policies import make_policy
from .replay import CacheTooSmall, Engine, EngineConfig, PromptKeys
from .workloads import Session

SWEEP_POLICIES = ("lru", "cachescout", "belady")
CACHE_FACTORS = (0.5, 0.75, 1.0, 1.5, 2.0)
LOAD_FACTORS = (0.5, 1.0, 1.25, 1.5, 2.0)


def scaled_load(sessions: Sequence[Session], factor: float) -> list[Session]:
    """The same calls, offered `factor` times as fast: arrivals, think times and open-loop offsets
    (and sub-sessions' delays) divided by it."""
    out = []
    for s in sessions:
        calls = tuple(dataclasses.replace(c, think_s=c.think_s / factor) for c in s.calls)
        out.append(dataclasses.replace(s, arrival_s=s.arrival_s / factor, calls=calls,
                                       offsets_s=tuple(o / factor for o in s.offsets_s)))
    return out


def cache_sweep(sessions: Sequence[Session], cfg: EngineConfig, policy_cfg: PolicyConfig,
                policies: Sequence[str] = SWEEP_POLICIES, factors: Sequence[float] = CACHE_FACTORS,
                known: dict | None = None, tick: Callable[[], None] | None = None,
                prompt_keys: PromptKeys | None = None) -> dict:
    """{policy: [(gpu_blocks, token_hit_rate), ...]}; `known` holds results already measured."""
    out: dict[str, list[tuple[int, float]]] = {p: [] for p in policies}
    for f in factors:
        blocks = max(64, int(cfg.gpu_blocks * f))
        for p in policies:
            if f == 1.0 and known and p in known:
                hit = known[p]["token_hit_rate"]
            else:
                try:
                    engine = Engine(dataclasses.replace(cfg, gpu_blocks=blocks), make_policy(p, policy_cfg, sessions),
                                    prompt_keys)
                    result = engine.run(sessions, max_preemptions=len(sessions) * 20)
                    hit = result.summary()["token_hit_rate"]
                except CacheTooSmall:      # too small to hold a request, or thrashing
                    hit = None
            out[p].append((blocks, hit))
            if tick:
                tick()
    return out


def load_sweep(sessions: Sequence[Session], cfg: EngineConfig, policy_cfg: PolicyConfig, base_rate: float | None,
               policies: Sequence[str] = SWEEP_POLICIES, factors: Sequence[float] = LOAD_FACTORS,
               ttft_budget_ms: float = 1000.0, known: dict | None = None,
               tick: Callable[[], None] | None = None, prompt_keys: PromptKeys | None = None) -> dict:
    """Per policy: TTFT and throughput at each offered load (`load_factor` times the sessions'
    own; in sessions per second too where `base_rate` is known: the built-in workloads), the most
    completed calls per second (throughput at saturation), and the highest load whose p99 TTFT
    stays within the budget."""
    out: dict[str, dict] = {}
    for p in policies:
        points = []
        for f in factors:
            if f == 1.0 and known and p in known:
                s = known[p]
            else:
                scaled = scaled_load(sessions, f)
                s = Engine(cfg, make_policy(p, policy_cfg, scaled), prompt_keys).run(scaled).summary()
            points.append({"load_factor": f, "sessions_per_s": None if base_rate is None else base_rate * f,
                           "ttft_mean_ms": s["ttft_mean_ms"], "ttft_p99_ms": s["ttft_p99_ms"],
                           "calls_per_s": s["throughput_calls_per_s"], "token_hit_rate": s["token_hit_rate"]})
            if tick:
                tick()
        within = [pt for pt in points if pt["ttft_p99_ms"] <= ttft_budget_ms]
        best = max(within, key=lambda pt: pt["load_factor"]) if within else None
        out[p] = {"points": points,
                  "throughput_at_saturation_calls_per_s": max(pt["calls_per_s"] for pt in points),
                  "max_load_within_ttft_budget_sessions_per_s": best["sessions_per_s"] if best else None,
                  "max_load_factor_within_ttft_budget": best["load_factor"] if best else None,
                  "ttft_budget_ms": ttft_budget_ms}
    return out


def plot(reports: Sequence[dict], path: str) -> None:
    """One figure: per workload, hit rate vs GPU cache size and p99 TTFT vs offered load."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = [r for r in reports if "cache_sweep" in r]
    if not reports:
        return
    fig, axes = plt.subplots(2, len(reports), figsize=(4.2 * len(reports), 7.2), squeeze=False)
    for col, report in enumerate(reports):
        ax = axes[0][col]
        for policy, pts in report["cache_sweep"].items():
            xs = [b for b, h in pts if h is not None]
            ys = [h for _, h in pts if h is not None]
            ax.plot(xs, ys, marker="o", label=policy)
        ax.axvline(report["gpu_blocks"], color="grey", lw=0.8, ls=":")
        ax.set_title(report["workload"])
        ax.set_xlabel(f"GPU cache (blocks of {report['block_size']} tokens)")
        ax.set_ylabel("token hit rate")
        ax.grid(alpha=0.3)
        ax = axes[1][col]
        per_second = True
        for policy, data in report.get("load_sweep", {}).items():
            per_second = all(pt["sessions_per_s"] is not None for pt in data["points"])
            xs = [pt["sessions_per_s"] if per_second else pt["load_factor"] for pt in data["points"]]
            ax.plot(xs, [pt["ttft_p99_ms"] for pt in data["points"]], marker="o", label=policy)
        ax.set_yscale("log")
        ax.set_xlabel("offered load (sessions/s)" if per_second else "offered load (x the trace's)")
        ax.set_ylabel("p99 TTFT (ms)")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    axes[1][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
