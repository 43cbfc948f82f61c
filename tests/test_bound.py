"""The bound on GPU-tier hits: Belady over a run's own events (bench/bound.py)."""

from pathlib import Path

import pytest

from cachescout.bench.bound import belady_hits
from cachescout.bench.policies import make_policy
from cachescout.bench.replay import EV_ADMIT, EV_RELEASE, Engine, EngineConfig, PromptKeys
from cachescout.bench.run import BenchOptions, run_sessions
from cachescout.bench.trace import TraceOptions, load_trace
from cachescout.bench.workloads import WorkloadSpec, generate
from cachescout.policy import PolicyConfig

DATA = Path(__file__).parent / "data" / "claude-code"


def _cycle(keys, rounds):
    """One-block calls over `keys` in a cycle, each released at once."""
    log = []
    for n, key in enumerate(keys * rounds):
        log += [(EV_ADMIT, n, [key], 1, True, 0), (EV_RELEASE, n)]
    return log


def test_a_cycle_larger_than_the_cache_gets_beladys_hits():
    # A B C A B C with room for two: LRU hits nothing, Belady keeps A, then C: two hits.
    assert belady_hits(_cycle(["a", "b", "c"], 2), 2, 16) == 2 * 16
    # Room for all: every repeat hits.
    assert belady_hits(_cycle(["a", "b", "c"], 3), 3, 16) == 6 * 16


def test_uncounted_admissions_pin_but_score_nothing():
    log = [(EV_ADMIT, 0, ["a"], 1, True, 0), (EV_RELEASE, 0),
           (EV_ADMIT, 1, ["a"], 1, False, 0), (EV_RELEASE, 1)]   # a re-admission after preemption
    assert belady_hits(log, 4, 16) == 0


def _runs(sessions, blocks, bs, names):
    keys = PromptKeys(bs)
    cfg = PolicyConfig(block_size=bs)
    for name in names:
        engine = Engine(EngineConfig(gpu_blocks=blocks, block_size=bs), make_policy(name, cfg, sessions), keys).record()
        s = engine.run(sessions).summary()
        yield name, s, belady_hits(engine.log, blocks, bs) / s["prompt_tokens"]


POLICIES = ("lru", "cachescout", "cachescout-hints", "belady", "kvflow", "continuum")


@pytest.mark.parametrize("kind", ["workload", "conversations"])
def test_every_run_is_within_its_own_bound_and_the_bound_within_an_unbounded_cache(kind):
    if kind == "workload":
        sessions, bs, blocks = generate(WorkloadSpec(family="swebench", sessions=60, seed=4)), 16, 2500
    else:
        sessions, _ = load_trace(DATA, TraceOptions(conversations=9, window_s=120))
        bs, blocks = 64, 6000
    unbounded = Engine(EngineConfig(gpu_blocks=1 << 30, block_size=bs),
                       make_policy("lru", PolicyConfig(block_size=bs))).run(sessions).summary()["token_hit_rate"]
    seen = {}
    for name, s, bound in _runs(sessions, blocks, bs, POLICIES):
        assert s["gpu_token_hit_rate"] <= bound + 1e-12, name
        assert bound <= unbounded + 1e-12, name
        seen[name] = (s["gpu_token_hit_rate"], bound)
    assert seen["lru"][1] > seen["lru"][0]   # the bound leaves room above LRU here


def test_the_reported_bound_holds_for_every_policy_and_gap_closed_is_measured_against_it():
    sessions, _ = load_trace(DATA, TraceOptions(conversations=9, window_s=120))
    opts = BenchOptions(policies=("lru", "cachescout", "belady"), gpu_blocks=6000, sweeps=False)
    report = run_sessions("mix", sessions, 64, opts)
    bound = report["bound_gpu_hit_rate"]
    lru = next(r for r in report["results"] if r["policy"] == "lru")
    for r in report["results"]:
        assert r["within_bound"] and r["gpu_token_hit_rate"] <= bound
        assert r["gap_closed"] == pytest.approx((r["gpu_token_hit_rate"] - lru["gpu_token_hit_rate"])
                                                / (bound - lru["gpu_token_hit_rate"]))


def test_with_a_cpu_tier_every_tiers_hits_stay_within_belady_over_both_capacities():
    # LMCache's CPU tier (LRU, twice the GPU cache here) adds hits the GPU bound does not cover;
    # one cache as large as both tiers together, under Belady, does bound them.
    sessions, _ = load_trace(DATA, TraceOptions(conversations=9, window_s=120))
    bs, blocks, cpu = 64, 4200, 8000
    keys = PromptKeys(bs)
    for name in ("lmcache-lru", "cachescout"):
        engine = Engine(EngineConfig(gpu_blocks=blocks, block_size=bs, cpu_blocks=cpu),
                        make_policy(name, PolicyConfig(block_size=bs), sessions), keys).record()
        s = engine.run(sessions).summary()
        gpu_bound = belady_hits(engine.log, blocks, bs) / s["prompt_tokens"]
        both = belady_hits(engine.log, blocks + cpu, bs) / s["prompt_tokens"]
        assert s["gpu_token_hit_rate"] <= gpu_bound + 1e-12, name
        assert s["token_hit_rate"] > gpu_bound, name    # why the GPU bound is not shown beside them
        assert s["token_hit_rate"] <= both + 1e-12, name


def test_a_tiered_comparison_without_plain_lru_is_against_lmcaches_lru():
    # Several timings, only LMCache's LRU as a baseline: the figures that are against LRU are against
    # it (they used to be missing, and the table printed "+0%" for each); with no baseline, none.
    from cachescout.bench.run import format_table

    sessions, _ = load_trace(DATA, TraceOptions(conversations=9, window_s=120))
    opts = BenchOptions(policies=("lmcache-lru", "cachescout"), gpu_blocks=6000, cpu_blocks=3000, timings=2,
                        sweeps=False)
    report = run_sessions("mix", sessions, 64, opts)
    assert report["baseline"] == "lmcache-lru"
    base, ours = report["results"]
    assert base["ttft_mean_vs_lru"] == 0.0 and base["hit_vs_lru"] == 0.0
    assert ours["hit_vs_lru"] == pytest.approx(ours["token_hit_rate"] - base["token_hit_rate"])
    assert "'vs LRU': against lmcache-lru" in format_table(report)
    alone = run_sessions("mix", sessions, 64, BenchOptions(policies=("cachescout",), gpu_blocks=6000, timings=2,
                                                           sweeps=False))
    assert alone["baseline"] is None and "ttft_mean_vs_lru" not in alone["results"][0]


def test_the_cache_is_sized_on_the_runs_own_timing():
    # Calls that take longer overlap more, and LRU needs a larger cache for the same hit rate.
    import dataclasses

    from cachescout.bench.replay import CostProfile
    from cachescout.bench.run import calibrate_gpu_blocks

    sessions, _ = load_trace(DATA, TraceOptions(conversations=9, window_s=120))
    slow = dataclasses.replace(CostProfile(), attention_s_per_token_context=2e-8)
    plain = calibrate_gpu_blocks(sessions, 64, target=0.8)
    assert calibrate_gpu_blocks(sessions, 64, target=0.8, cost=slow) > 1.3 * plain
