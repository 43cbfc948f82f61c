"""The replay-speed benchmark's split of CacheScout's time: timing its decisions changes none."""

from cachescout.bench.microbench import _time_evictions
from cachescout.bench.policies import make_policy
from cachescout.bench.replay import Engine, EngineConfig
from cachescout.bench.run import calibrate_gpu_blocks
from cachescout.bench.workloads import WorkloadSpec, generate
from cachescout.policy import PolicyConfig


def test_timing_the_evictions_counts_their_time_and_changes_no_decision():
    sessions = generate(WorkloadSpec(family="gsm8k", sessions=20, seed=3))
    cfg = EngineConfig(gpu_blocks=calibrate_gpu_blocks(sessions, 16), block_size=16)
    plain = Engine(cfg, make_policy("cachescout", PolicyConfig(block_size=16), sessions)).run(sessions)
    policy = make_policy("cachescout", PolicyConfig(block_size=16), sessions)
    spent = _time_evictions(policy)
    timed = Engine(cfg, policy).run(sessions)
    assert [r.hit_tokens for r in timed.requests] == [r.hit_tokens for r in plain.requests]
    assert sum(r.hit_tokens for r in plain.requests) > 0
    assert spent[0] > 0


def test_the_holds_benchmark_times_holds_that_pinned_the_whole_stored_prompt():
    """`microbench --holds` on LMCache's own engine: it raises unless every hold pinned every chunk
    of the stored prompt; the figures are positive times per prompt length."""
    from cachescout.bench.microbench import bench_queued_holds

    got = bench_queued_holds(prompt_tokens=(2_560,), repeats=2)
    assert set(got) == {"hold_2560_tokens_ms", "release_2560_tokens_ms", "lmcache_lookup_2560_tokens_ms"}
    assert all(v > 0 for v in got.values())
