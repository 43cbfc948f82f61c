import json

from cachescout.bench.belady import BeladyPolicy
from cachescout.bench.policies import make_policy
from cachescout.bench.replay import Engine, EngineConfig, Request, call_keys
from cachescout.bench.trace import parse_trace
from cachescout.bench.workloads import WorkloadSpec, generate
from cachescout.policy import PolicyConfig


def test_oracle_bounds_every_policy_and_is_bounded_by_an_unbounded_cache():
    sessions = generate(WorkloadSpec(family="gsm8k", sessions=80, seed=11))
    cfg = PolicyConfig()
    hit = {}
    for name in ("lru", "cachescout", "belady"):
        result = Engine(EngineConfig(gpu_blocks=1200), make_policy(name, cfg, sessions)).run(sessions)
        hit[name] = result.summary()["token_hit_rate"]
    unbounded = Engine(EngineConfig(gpu_blocks=1 << 30), make_policy("lru", cfg)).run(sessions)
    assert hit["belady"] >= max(hit["lru"], hit["cachescout"])
    assert hit["belady"] <= unbounded.summary()["token_hit_rate"] + 1e-9
    assert hit["belady"] > hit["lru"] + 0.05


def _trace_sessions(rows):
    lines = [json.dumps({"timestamp": t, "input_length": 16 * len(ids), "output_length": 1, "hash_ids": ids,
                         "block_size": 16, "session_id": sid, "think_ms": think}) for t, sid, ids, think in rows]
    sessions, report = parse_trace(lines, block_size=16)
    assert report.skipped == 0
    return sessions


def test_a_waiting_call_keeps_its_blocks_needed_until_it_is_admitted():
    # Session x uses blocks 1, 2 again soon, session y uses 3, 4 again later; 5 and 7 are never
    # used again. Session x's second call has arrived but waits: its blocks are still needed next.
    sessions = _trace_sessions([(0, "x", [1, 2, 5], 0), (0, "x", [1, 2, 6], 10),
                                (1, "y", [3, 4, 7], 0), (1, "y", [3, 4, 8], 5000)])
    oracle = BeladyPolicy(sessions, 16)
    x, y = sorted(sessions, key=lambda s: s.session_id)
    keys = {name: call_keys(call, 16) for name, call in
            (("x1", x.calls[0]), ("x2", x.calls[1]), ("y1", y.calls[0]))}
    for name in ("x1", "y1"):
        oracle.admitted(Request(x if name[0] == "x" else y, 0, None, 0.0, hashes=keys[name]), keys[name], 0, 0.0)
        oracle.freed(keys[name][::-1], 0.0)
    waiting = Request(x, 1, x.calls[1], 0.5, hashes=keys["x2"])
    oracle.arrived(waiting, 0.5)
    # never used again first, then the later use (deeper block first); x's blocks stay
    assert oracle.evict(4, 0.5) == [keys["x1"][2], keys["y1"][2], keys["y1"][1], keys["y1"][0]]
    oracle.admitted(waiting, keys["x2"][:2], 0, 0.6)   # a partial hit would have reused them first
    assert sorted(oracle.evict(2, 0.6)) == sorted(keys["x1"][:2])   # used: no further use is known


def test_rebuilding_the_heap_changes_no_decision():
    sessions = generate(WorkloadSpec(family="mtbench", sessions=60, seed=5))
    runs = []
    for slack in (0, 1 << 40):   # rebuild at nearly every free, and never
        policy = make_policy("belady", PolicyConfig(), sessions)
        policy.rebuild_slack = slack
        runs.append(Engine(EngineConfig(gpu_blocks=900), policy).run(sessions).summary())
    assert runs[0] == runs[1]
    assert runs[0]["evictions"] > 1000
