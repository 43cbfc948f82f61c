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
