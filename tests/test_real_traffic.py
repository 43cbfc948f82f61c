"""The real-traffic matrix runner: its figures are each run's own, bounded, and its flags checked."""

import itertools
import json
from pathlib import Path

import pytest

from cachescout.bench import real_traffic

DATA = Path(__file__).parent / "data" / "claude-code"


def test_with_a_cpu_tier_a_cell_is_bounded_on_every_tiers_hits():
    cell = real_traffic.Cell(str(DATA), 3, 1, "open", 0.7, ("lmcache-lru", "cachescout"), 2, 2.0, 120.0)
    c = real_traffic.run_cell(cell)
    assert c["cpu_blocks"] == 2 * c["gpu_blocks"]
    assert c["bound_hit_rate"] >= c["bound_gpu_hit_rate"]
    for name in ("lmcache-lru", "cachescout"):
        for r in c["policies"][name]["runs"]:
            assert r["token_hit_rate"] <= c["bound_hit_rate"] + 1e-9, name
    # The table shows that bound (the GPU one would not bound a `hit` that counts every tier), and
    # the spread of each TTFT ratio to LMCache's LRU over the timings.
    table = real_traffic.format_cells([c], ["lmcache-lru", "cachescout"])
    assert "bound (all tiers)" in table and f"{c['bound_hit_rate']:.4f}" in table
    se = real_traffic.ttft_ratio_se(c["policies"]["cachescout"]["runs"], c["policies"]["lmcache-lru"]["runs"])
    assert se is not None and se >= 0 and f"±{se:.1%}" in table


def test_a_small_matrix_reports_every_policy_against_lru_and_the_bound(tmp_path, capsys):
    out = tmp_path / "real.json"
    rc = real_traffic.main(["--trace", str(DATA), "--closed", "4", "--open", "3", "--seeds", "1",
                            "--targets", "0.7", "--jitters", "2", "--policies", "lru,cachescout",
                            "--jobs", "1", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    cells = report["cells"]
    assert sorted((c["loop"], c["count"]) for c in cells) == [("closed", 4), ("open", 3)]
    for c in cells:
        lru, ours = c["policies"]["lru"], c["policies"]["cachescout"]
        assert len(lru["runs"]) == len(ours["runs"]) == 2
        # The bound is Belady on each run's own calls: no policy's mean GPU hits exceed its mean.
        for r in (lru, ours):
            assert r["gpu_token_hit_rate"] <= c["bound_gpu_hit_rate"] + 1e-9
        assert 0.0 < lru["token_hit_rate"] < 1.0
        # CacheScout's own measure of its order against LRU (its guard's), per run; LRU has none.
        assert "guard_gain" not in lru and all(-1.0 < r["guard_gain"] < 1.0 for r in ours["runs"])
    summary = report["summary"]["cachescout"]
    assert summary["cells"] == 2 and summary["against"] == "lru"
    gains = [c["policies"]["cachescout"]["guard_gain"] for c in cells]
    assert summary["guard_gain_min"] == pytest.approx(min(gains))
    diffs = [c["policies"]["cachescout"]["token_hit_rate"] - c["policies"]["lru"]["token_hit_rate"] for c in cells]
    assert summary["hit_difference_min"] == pytest.approx(min(diffs))
    assert "closed" in capsys.readouterr().out
    # As a section of results.md: what the matrix is said once, before the first of its tables.
    from cachescout.bench.report import real_traffic_section
    first, second = real_traffic_section(report), real_traffic_section(report, intro=False)
    assert first.count("Recorded agentic coding traffic") == 1 and "Recorded agentic" not in second
    assert "--closed 4 --open 3" in second and "GPU tier only." in second
    assert f"{round(100 * summary['guard_gain_mean'], 2) + 0.0:+.2f} points on average" in second
    # Spliced into results.md alone: the recorded traces' tables (their own, longer runs) stay, and
    # the section says when and where it was measured (the file's footer dates the rest).
    import datetime

    from cachescout.bench import report as results

    doc = tmp_path / "results.md"
    doc.write_text((Path(__file__).parents[1] / "docs" / "results.md").read_text())
    _, traces = results._real_traffic_parts(str(doc))
    assert results.TRACE_RUN_TEXT["claude-code"] in traces and "Measured" not in traces
    assert results.main(["--out", str(doc), "--sections-only", "--real-traffic", str(out)]) == 0
    matrices, kept = results._real_traffic_parts(str(doc))
    assert "--closed 4 --open 3" in matrices and kept == traces
    section = results.kept_sections(str(doc), (results.REAL_TITLE,))[results.REAL_TITLE]
    assert section.rstrip().endswith(".") and f"Measured {datetime.date.today().isoformat()} on " in section
    assert section.count("Measured ") == 1


def _runs(hits, ttfts):
    return [{"token_hit_rate": h, "ttft_mean_ms": t} for h, t in zip(hits, ttfts, strict=True)]


def test_a_verdict_is_open_while_a_figure_is_within_two_standard_errors_of_its_threshold():
    base = _runs([0.80, 0.81, 0.79], [100.0, 100.0, 100.0])
    # Clearly better on both: decided.
    assert not real_traffic.verdict_open(_runs([0.82, 0.83, 0.81], [90.0, 91.0, 89.0]), base)
    # Clearly worse on hits: decided too (the rule settles a verdict, it does not look for a pass).
    assert not real_traffic.verdict_open(_runs([0.78, 0.79, 0.77], [90.0, 91.0, 89.0]), base)
    # TTFT 0.98x on average but moving by 10% from one timing to the next: open, though below 1.02x.
    assert real_traffic.verdict_open(_runs([0.82, 0.83, 0.81], [88.0, 108.0, 98.0]), base)
    # Hits 0.2 points below within their noise: open.
    assert real_traffic.verdict_open(_runs([0.799, 0.806, 0.789], [90.0, 91.0, 89.0]), base)
    # One timing says nothing about noise.
    assert real_traffic.verdict_open(_runs([0.9], [50.0]), base[:1])


def test_a_cell_takes_further_timings_only_while_its_verdict_is_open():
    policies = ("lru", "cachescout")
    one = real_traffic.run_cell(real_traffic.Cell(str(DATA), 4, 1, "closed", 0.7, policies, 1, 0.0, 120.0))
    assert one["timings"] == 1
    # From one timing a verdict is always open, so a cell allowed three takes at least a second;
    # the timings it shares with the first run are the same replays.
    more = real_traffic.run_cell(real_traffic.Cell(str(DATA), 4, 1, "closed", 0.7, policies, 1, 0.0, 120.0,
                                                   max_jitters=3, decide="cachescout"))
    n = more["timings"]
    assert 2 <= n <= 3 and more["timings_allowed"] == 3
    for name in policies:
        assert len(more["policies"][name]["runs"]) == n
        assert more["policies"][name]["runs"][0] == one["policies"][name]["runs"][0]
    # A third timing was taken exactly when two left the verdict open.
    ours, lru = (more["policies"][p]["runs"] for p in ("cachescout", "lru"))
    assert real_traffic.verdict_open(ours[:2], lru[:2]) == (n == 3)
    assert " timings " in real_traffic.format_cells([more], list(policies))
    assert " timings " not in real_traffic.format_cells([one], list(policies))
    assert " timings " in real_traffic.format_cells([{**more, "timings": 3}], list(policies))   # all took the most
    # In results.md: the command carries the flag, and the text says how far the verdicts were settled.
    from cachescout.bench.report import real_traffic_section

    args = {"closed": "4", "open": "", "seeds": "1", "targets": "0.7", "policies": "lru,cachescout", "jitters": 1,
            "max_jitters": 3, "decide": "cachescout", "cpu_ratio": 0.0}
    summary = {"cachescout": real_traffic.summarize([more], base="lru")}
    text = real_traffic_section({"args": args, "cells": [more], "summary": summary})
    assert "--jitters 1 --max-jitters 3" in text and "the mean of 1 to 3 timings" in text
    n = summary["cachescout"]["cells_undecided"]
    assert f"{n} cell{'' if n == 1 else 's'} with that verdict still open after 3 timings" in text


@pytest.mark.parametrize("flags, field", [
    (["--policies", "lru,nosuch"], "--policies"),
    (["--jitters", "0"], "--jitters"),
    (["--jitters", "3", "--max-jitters", "2"], "--max-jitters"),
    (["--max-jitters", "8", "--decide", "lru"], "--decide"),
    (["--closed", "40"], "40 conversations asked for"),
    (["--max-jitters", "8", "--policies", "cachescout,belady"], "--decide"),
    (["--targets", "1.5"], "--targets"),
    (["--cpu-ratio", "nan"], "--cpu-ratio"),
])
def test_bad_flags_are_refused_naming_the_flag(flags, field, capsys):
    with pytest.raises(SystemExit) as e:
        real_traffic.main(["--trace", str(DATA), *flags])
    assert e.value.code == 2
    assert field in capsys.readouterr().err


def test_a_missing_or_empty_folder_is_refused_before_any_work(tmp_path, capsys):
    for path in (tmp_path / "missing", tmp_path):
        with pytest.raises(SystemExit):
            real_traffic.main(["--trace", str(path)])
        assert "--trace" in capsys.readouterr().err


def test_a_cost_profile_is_chosen_by_name_and_said_in_the_section(tmp_path, capsys):
    from cachescout.bench.report import real_traffic_section

    with pytest.raises(SystemExit):
        real_traffic.main(["--trace", str(DATA), "--cost-profile", "h900"])
    assert "--cost-profile: unknown cost profile 'h900'; choose from" in capsys.readouterr().err
    out = tmp_path / "a.json"
    common = ["--trace", str(DATA), "--closed", "3", "--open", "", "--seeds", "1", "--targets", "0.7", "--jitters", "1",
              "--policies", "lru", "--jobs", "1"]
    assert real_traffic.main([*common, "--json", str(out), "--cost-profile", "llama3.1-8b-h200-attention"]) == 0
    assert real_traffic.main([*common, "--json", str(tmp_path / "p.json")]) == 0
    deep, plain = (json.loads(p.read_text()) for p in (out, tmp_path / "p.json"))
    (a,), (b,) = deep["cells"], plain["cells"]
    assert a["policies"]["lru"]["ttft_mean_ms"] > b["policies"]["lru"]["ttft_mean_ms"]   # long prompts cost more
    section = real_traffic_section(deep, intro=False)
    assert "--cost-profile llama3.1-8b-h200-attention" in section and "priced with attention's cost" in section
    assert "--cost-profile" not in real_traffic_section(plain, intro=False)


def _gaps(s):
    return [b - a for a, b in itertools.pairwise(s.offsets_s)]


def test_timings_vary_every_wait_within_the_spread_and_nothing_else():
    from cachescout.bench.trace import TraceOptions, load_trace
    from cachescout.bench.workloads import waits_varied

    closed, _ = load_trace(str(DATA), TraceOptions(conversations=4, seed=1, loop="closed", window_s=120.0))
    opened, _ = load_trace(str(DATA), TraceOptions(conversations=4, seed=1, loop="open", window_s=120.0))
    assert any(s.parent is not None for s in closed), "the sample should hold a sub-agent"
    assert waits_varied(closed, 0, 0.02) == closed      # the first timing is the traffic as recorded
    for sessions in (closed, opened):
        a, b = waits_varied(sessions, 1, 0.02), waits_varied(sessions, 2, 0.02)
        assert a == waits_varied(sessions, 1, 0.02) and a != b     # seeded: every policy replays the same
        for old, new in zip(sessions, a, strict=True):
            assert (new.session_id, new.parent, new.after_call, len(new.calls)) == \
                (old.session_id, old.parent, old.after_call, len(old.calls))
            for c, d in zip(old.calls, new.calls, strict=True):
                assert d.hash_ids == c.hash_ids and d.output_length == c.output_length
                assert abs(d.think_s - c.think_s) <= 0.02 * c.think_s + 1e-12
            if old.parent is None:
                assert new.arrival_s == old.arrival_s     # the mix keeps its starts
            else:
                assert abs(new.arrival_s - old.arrival_s) <= 0.02 * old.arrival_s + 1e-12
            assert all(abs(g2 - g) <= 0.02 * g + 1e-9 for g, g2 in zip(_gaps(old), _gaps(new), strict=True))
        # ... and every wait that is not zero moves.
        recorded = [c.think_s for s in sessions for c in s.calls] + [g for s in sessions for g in _gaps(s)]
        waits = [c.think_s for s in a for c in s.calls] + [g for s in a for g in _gaps(s)]
        assert sum(r > 0 for r in recorded) > 10
        assert all(w != r for w, r in zip(waits, recorded, strict=True) if r > 0)


def test_a_figure_some_timing_lacks_is_averaged_over_the_timings_that_have_it():
    # A timing whose prefetches were never judged has no precision; the cell still has one.
    runs = [{"token_hit_rate": 0.5, "prefetch_precision": 0.25}, {"token_hit_rate": 0.7}]
    assert real_traffic.mean_of_runs(runs) == pytest.approx({"token_hit_rate": 0.6, "prefetch_precision": 0.25})
    assert "prefetch_precision" not in real_traffic.mean_of_runs([{"token_hit_rate": 0.5}])
