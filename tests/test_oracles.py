"""LRU told one thing about the future (bench/oracles.py): which blocks are dead, which sessions are over."""

import json

from cachescout.bench.oracles import KnowsDeadLRU, KnowsEndsLRU
from cachescout.bench.policies import make_policy
from cachescout.bench.replay import Engine, EngineConfig, Request, call_keys
from cachescout.bench.trace import parse_trace
from cachescout.bench.workloads import WorkloadSpec, generate
from cachescout.policy import PolicyConfig


def _sessions(rows):
    lines = [json.dumps({"timestamp": t, "input_length": 16 * len(ids), "output_length": 1, "hash_ids": ids,
                         "block_size": 16, "session_id": sid, "think_ms": think}) for t, sid, ids, think in rows]
    sessions, report = parse_trace(lines, block_size=16)
    assert report.skipped == 0
    return sorted(sessions, key=lambda s: s.session_id)


def _run_call(policy, session, index, keys, now):
    """As the replay engine calls a policy: cached blocks reused, the call admitted, then freed."""
    cached = [k for k in keys if k in policy.free or k in getattr(policy, "first", ())]
    policy.reused(cached, now)
    policy.admitted(Request(session, index, session.calls[index], now, hashes=keys), keys, len(cached), now)
    policy.freed(keys[::-1], now)


def test_dead_blocks_and_ended_sessions_go_before_older_live_ones():
    # x calls twice (its second call leaves its first call's block 3 behind), y once, after x.
    x, y = _sessions([(0, "x", [1, 2, 3], 0), (0, "x", [1, 2, 4], 10), (1, "y", [5, 6], 0)])
    kx1, kx2, ky = (call_keys(c, 16) for c in (x.calls[0], x.calls[1], y.calls[0]))
    assert kx1[:2] == kx2[:2] and kx1[2] != kx2[2]
    dead, ends, lru = KnowsDeadLRU([x, y], 16), KnowsEndsLRU([x, y], 16), make_policy("lru", PolicyConfig(), [x, y])
    for p in (dead, ends):
        _run_call(p, x, 0, kx1, 0.0)
        _run_call(p, y, 0, ky, 1.0)
    _run_call(lru, x, 0, kx1, 0.0)
    _run_call(lru, y, 0, ky, 1.0)
    assert lru.evict(3, 2.0) == [kx1[2], kx1[1], kx1[0]]   # the oldest first
    # Dead: block 3 of x (its next call does not use it) and all of y; the blocks x uses again last.
    assert dead.evict(5, 2.0) == [kx1[2], ky[1], ky[0], kx1[1], kx1[0]]
    # Ends: y is over (its only call admitted): its blocks first; then LRU's order, x not being over.
    assert ends.evict(5, 2.0) == [ky[1], ky[0], kx1[2], kx1[1], kx1[0]]


def test_a_session_is_over_once_its_last_call_is_admitted_not_before():
    x, y = _sessions([(0, "x", [1, 2], 0), (0, "x", [1, 2, 4], 10), (1, "y", [5, 6], 0), (1, "y", [5, 6, 7], 10)])
    kx1, kx2, ky1 = (call_keys(c, 16) for c in (x.calls[0], x.calls[1], y.calls[0]))
    ends = KnowsEndsLRU([x, y], 16)
    _run_call(ends, x, 0, kx1, 0.0)
    _run_call(ends, y, 0, ky1, 1.0)
    _run_call(ends, x, 1, kx2, 2.0)   # x's last call: x is over, y is not
    assert ends.evict(2, 3.0) == [kx2[2], kx2[1]]
    assert ends.evict(2, 3.0) == [kx2[0], ky1[1]]
    # A call admitted again after a preemption counts once.
    dead = KnowsDeadLRU([x, y], 16)
    for _ in range(2):
        dead.admitted(Request(x, 0, x.calls[0], 0.0, hashes=kx1), kx1, 0, 0.0)
    assert dead.uses[kx1[0]] == 1   # x's second call still uses it


def test_each_foresight_lies_between_lru_and_belady_on_a_workload():
    sessions = generate(WorkloadSpec(family="gsm8k", sessions=80, seed=11))
    cfg = PolicyConfig()
    hit = {name: Engine(EngineConfig(gpu_blocks=1200), make_policy(name, cfg, sessions)).run(sessions)
           .summary()["token_hit_rate"] for name in ("lru", "lru-knows-dead", "lru-knows-ends", "belady")}
    # Knowing which blocks are dead helps LRU; knowing only when sessions end helps less (a
    # finished session's anchor is still used by others, and an ended session's blocks are dead).
    assert hit["lru"] < hit["lru-knows-ends"] <= hit["lru-knows-dead"] + 1e-9 < hit["belady"]


def test_the_real_traffic_matrix_runs_them_and_its_section_says_what_they_know(tmp_path):
    from pathlib import Path

    from cachescout.bench import real_traffic
    from cachescout.bench.report import real_traffic_section

    out = tmp_path / "o.json"
    data = Path(__file__).parent / "data" / "claude-code"
    assert real_traffic.main(["--trace", str(data), "--closed", "4", "--open", "", "--seeds", "1", "--targets", "0.7",
                              "--jitters", "1", "--policies", "lru,lru-knows-ends,lru-knows-dead", "--jobs", "1",
                              "--cost-profile", "llama3.1-8b-h200-attention", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (cell,) = report["cells"]
    assert set(cell["policies"]) == {"lru", "lru-knows-ends", "lru-knows-dead"}
    for r in cell["policies"].values():   # each run within its own bound
        assert r["gpu_token_hit_rate"] <= cell["bound_gpu_hit_rate"] + 1e-9
    section = real_traffic_section(report, intro=False)
    assert "What Belady's foresight is worth, part by part (GPU tier only)" in section
    assert "`lru-knows-dead` LRU told which blocks no later call uses" in section
    assert "priced with attention's cost too" in section   # the profile is said as well
