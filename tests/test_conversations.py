"""kv-cache-tester conversation files: reading, mixing, sub-agents, closed and open loop, bad input."""

import gzip
import json
from pathlib import Path

import pytest

from cachescout.bench.conversations import MAIN_AGENT, read_conversations
from cachescout.bench.policies import make_policy
from cachescout.bench.replay import Engine, EngineConfig, SessionFlow
from cachescout.bench.trace import TraceError, TraceOptions, load_trace
from cachescout.policy import PolicyConfig

DATA = Path(__file__).parent / "data" / "claude-code"


def _raw(name: str) -> dict:
    with gzip.open(DATA / f"{name}.json.gz", "rt") as fh:
        return json.load(fh)


def _replay(sessions, blocks=1 << 20):
    return Engine(EngineConfig(gpu_blocks=blocks, block_size=64), make_policy("lru", PolicyConfig(block_size=64))
                  ).run(sessions)


def test_a_folder_is_read_natively_with_ids_made_global_and_sub_agents_as_their_own_sessions():
    sessions, report = load_trace(DATA, TraceOptions(conversations=9))
    assert report.files == 9 and report.skipped == 0
    raw = {p.name.split(".")[0]: json.loads(gzip.open(p, "rt").read()) for p in DATA.iterdir()}
    calls = sum(1 for d in raw.values() for r in d["requests"] if r.get("type") != "subagent")
    subs = [r for d in raw.values() for r in d["requests"] if r.get("type") == "subagent"]
    assert report.records == calls + sum(len(s["requests"]) for s in subs)
    main = [s for s in sessions if s.parent is None]
    assert len(main) == 9 and len(sessions) == 9 + len(subs)
    assert {c.agent for s in main for c in s.calls} == {MAIN_AGENT}
    assert {c.agent for s in sessions if s.parent for c in s.calls} == {"subagent:Explore"}
    # Local ids (every conversation starts at 1) never collide across conversations.
    firsts = [s.calls[0].hash_ids[0] for s in main]
    assert len(set(firsts)) == 9
    # A sub-agent shares its parent's namespace: equal local ids stay equal.
    parent = next(s for s in sessions if s.session_id == "trace_0254")
    kids = [s for s in sessions if s.parent == "trace_0254"]
    assert len(kids) == 5 and len({k.calls[0].hash_ids[0] for k in kids}) == 1
    assert parent.calls[0].hash_ids[0] >> 32 == kids[0].calls[0].hash_ids[0] >> 32


def test_closed_loop_sub_agents_start_after_their_call_and_the_parent_waits_for_all_of_them():
    sessions, _ = load_trace(DATA / "trace_0254.json.gz")
    flow = SessionFlow(sessions)
    assert flow.total_calls == sum(len(s.calls) for s in sessions)
    result = _replay(sessions)
    by = {(r.session.session_id, r.index): r for r in result.requests}
    parent = next(s for s in sessions if s.parent is None)
    kids = [s for s in sessions if s.parent is not None]
    for after in {k.after_call for k in kids}:
        group = [k for k in kids if k.after_call == after]
        assert len(group) >= 2   # started together: they run in parallel
        spawn_end = by[(parent.session_id, after)].finished_at
        starts = [by[(k.session_id, 0)].issued_at for k in group]
        ends = [by[(k.session_id, len(k.calls) - 1)].finished_at for k in group]
        assert min(starts) >= spawn_end
        resumed = by[(parent.session_id, after + 1)].issued_at
        assert resumed >= max(ends)
        # ... after the recorded residual wait past the last sub-agent's recorded end
        raw = _raw("trace_0254")["requests"]
        main_t = [r["t"] for r in raw if r.get("type") != "subagent"]
        residual = main_t[after + 1] - max(r["t"] for r in raw if r.get("type") == "subagent"
                                           and main_t[after] < r["t"] - r["duration_ms"] / 1e3 < main_t[after + 1])
        assert resumed - max(ends) == pytest.approx(residual, abs=1e-6)


def test_open_loop_issues_every_call_at_its_recorded_offset():
    sessions, _ = load_trace(DATA / "trace_0016.json.gz", TraceOptions(loop="open"))
    (s,) = sessions
    result = _replay(sessions)
    raw = [r["t"] for r in _raw("trace_0016")["requests"] if r.get("type") != "subagent"]
    issued = sorted(r.issued_at for r in result.requests)
    assert issued == pytest.approx([t - raw[0] for t in raw])


def test_closed_loop_waits_the_recorded_think_time_after_each_call():
    sessions, _ = load_trace(DATA / "trace_0016.json.gz")
    result = _replay(sessions)
    reqs = sorted(result.requests, key=lambda r: r.index)
    raw = [r for r in _raw("trace_0016")["requests"] if r.get("type") != "subagent"]
    for a, b, rec in zip(reqs, reqs[1:], raw[1:], strict=False):
        assert b.issued_at - a.finished_at == pytest.approx(rec["think_time"])


def test_mixes_are_chosen_and_spread_by_the_seed():
    a, _ = read_conversations(DATA, TraceOptions(conversations=4, seed=1, window_s=600))
    b, _ = read_conversations(DATA, TraceOptions(conversations=4, seed=1, window_s=600))
    c, _ = read_conversations(DATA, TraceOptions(conversations=4, seed=2, window_s=600))
    assert [(s.session_id, s.arrival_s) for s in a] == [(s.session_id, s.arrival_s) for s in b]
    assert [(s.session_id, s.arrival_s) for s in a] != [(s.session_id, s.arrival_s) for s in c]
    assert all(0 <= s.arrival_s <= 600 + 60 for s in a if s.parent is None)
    with pytest.raises(TraceError, match="10 conversations asked for, 9 readable"):
        read_conversations(DATA, TraceOptions(conversations=10))


def _write(path: Path, doc) -> Path:
    with gzip.open(path, "wt") as fh:
        fh.write(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def test_malformed_calls_and_files_are_counted_with_their_reason_and_the_rest_kept(tmp_path):
    doc = _raw("trace_0016")
    doc["requests"][3]["hash_ids"][5] = "x"
    doc["requests"][4]["in"] = 10 ** 400
    _write(tmp_path / "a.json.gz", doc)
    _write(tmp_path / "b.json.gz", "{not json")
    (tmp_path / "c.json.gz").write_bytes(gzip.compress(json.dumps(_raw("trace_0048")).encode())[:400])
    sessions, report = load_trace(tmp_path)
    assert report.files == 1 and len(sessions) == 1 and len(sessions[0].calls) == len(doc["requests"]) - 2
    assert report.skipped == 4
    assert report.reasons["hash_ids ids not 64-bit integers"] == 1
    assert report.reasons["in out of range or not an integer"] == 1
    assert report.reasons["not JSON"] == 1 and report.reasons["file cut short or corrupt"] == 1
    assert "a.json.gz: request 3: field 'hash_ids'" in " ".join(report.errors)
    assert "an integer of 401 digits" in " ".join(report.errors)
    assert "4 record(s) skipped" in report.summary()
    with pytest.raises(TraceError, match="request 3: field 'hash_ids'"):
        load_trace(tmp_path, TraceOptions(strict=True))


def test_a_folder_without_conversations_says_so(tmp_path):
    with pytest.raises(TraceError, match="no conversation files"):
        load_trace(tmp_path)


def test_a_closed_loop_trace_is_reported_over_several_timings_each_policy_against_lru_on_the_same_ones():
    # One timing of a closed loop is chaos: waits a few seconds apart reorder later calls. The table
    # gives the means over CLOSED_LOOP_TIMINGS timings (the recorded waits, then variations of them)
    # and each policy's paired difference to LRU.
    import statistics

    from cachescout.bench.run import CLOSED_LOOP_TIMINGS, BenchOptions, format_table, run_trace

    opts = BenchOptions(trace=str(DATA), trace_options=TraceOptions(conversations=9), policies=("lru", "cachescout"),
                        gpu_blocks=3000, sweeps=False)
    report = run_trace(opts)
    assert report["timings"] == CLOSED_LOOP_TIMINGS > 1
    assert report["lru_spread"] > 0    # the timings do differ here
    by = {r["policy"]: r for r in report["results"]}
    for r in by.values():
        runs = r["token_hit_rate_by_timing"]
        assert len(runs) == CLOSED_LOOP_TIMINGS
        assert r["token_hit_rate"] == pytest.approx(statistics.fmean(runs))
        assert r["gpu_token_hit_rate"] <= report["bound_gpu_hit_rate"] + 1e-12
    d = [a - b for a, b in zip(by["cachescout"]["token_hit_rate_by_timing"], by["lru"]["token_hit_rate_by_timing"],
                               strict=True)]
    assert by["cachescout"]["hit_vs_lru"] == pytest.approx(statistics.fmean(d))
    assert report["lru_spread"] == pytest.approx(statistics.stdev(by["lru"]["token_hit_rate_by_timing"]))
    assert "hit vs LRU" in format_table(report) and f"means over {CLOSED_LOOP_TIMINGS} timings" in format_table(report)
    # The first timing is the replay as it is: one timing alone gives its figures.
    single = run_trace(BenchOptions(trace=str(DATA), trace_options=TraceOptions(conversations=9),
                                    policies=("lru",), gpu_blocks=3000, sweeps=False, timings=1))
    assert single["timings"] == 1 and "hit vs LRU" not in format_table(single)
    assert single["results"][0]["token_hit_rate"] == by["lru"]["token_hit_rate_by_timing"][0]


def test_an_open_loop_trace_is_one_timing():
    from cachescout.bench.run import BenchOptions, run_trace

    report = run_trace(BenchOptions(trace=str(DATA), trace_options=TraceOptions(conversations=2, loop="open"),
                                    policies=("lru",), gpu_blocks=3000, sweeps=False))
    assert report["timings"] == 1 and report["lru_spread"] is None
