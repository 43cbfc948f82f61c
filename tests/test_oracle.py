from cachescout.bench.policies import make_policy
from cachescout.bench.replay import Engine, EngineConfig
from cachescout.bench.workloads import WorkloadSpec, generate
from cachescout.policy import PolicyConfig


def test_oracle_bounds_every_policy_and_is_bounded_by_an_unbounded_cache():
    sessions = generate(WorkloadSpec(family="gsm8k", sessions=80, seed=11))
    cfg = PolicyConfig()
    hit = {}
    for name in ("lru", "cachescout", "oracle"):
        result = Engine(EngineConfig(gpu_blocks=1200), make_policy(name, cfg, sessions)).run(sessions)
        hit[name] = result.summary()["token_hit_rate"]
    unbounded = Engine(EngineConfig(gpu_blocks=1 << 30), make_policy("lru", cfg)).run(sessions)
    assert hit["oracle"] >= max(hit["lru"], hit["cachescout"])
    assert hit["oracle"] <= unbounded.summary()["token_hit_rate"] + 1e-9
    assert hit["oracle"] > hit["lru"] + 0.05
