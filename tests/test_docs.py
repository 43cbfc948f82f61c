"""The README's figures are docs/results.md's: the headline table and the tier figures below it
are checked cell by cell against the benchmark output recorded there (which
`python -m cachescout.bench.report` regenerates)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = {"GSM8K": "gsm8k", "MT-Bench": "mtbench", "GAIA": "gaia", "SWE-bench": "swebench"}


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def _runs(section: str) -> dict[str, dict]:
    """The benchmark's printed runs in a results.md section: family -> its bound and, per policy,
    the printed columns by header."""
    block = section[section.index("```\n") + 4:]
    block = block[:block.index("```")]
    runs: dict[str, dict] = {}
    for chunk in block.strip().split("\n\n"):
        lines = chunk.splitlines()
        family = lines[0].split(":", 1)[0]
        bound = re.search(r"bound on GPU hits ([0-9.]+)", lines[0])
        header = re.split(r"\s{2,}", lines[1].strip())
        rows = {}
        for line in lines[3:]:
            cells = re.split(r"\s{2,}", line.strip())
            assert len(cells) == len(header), line
            rows[cells[0]] = dict(zip(header, cells, strict=True))
        runs[family] = {"bound": bound.group(1) if bound else None, "rows": rows}
    return runs


def _readme_table(readme: str) -> list[dict[str, str]]:
    lines = [line for line in readme[readme.index("| workload |"):].splitlines()]
    table = []
    for line in lines:
        if not line.startswith("|"):
            break
        table.append([c.strip() for c in line.strip("|").split("|")])
    header, rows = table[0], table[2:]
    return [dict(zip(header, row, strict=True)) for row in rows]


@pytest.fixture(scope="module")
def texts() -> tuple[str, str]:
    return (ROOT / "README.md").read_text(), (ROOT / "docs" / "results.md").read_text()


COLUMNS = {"LRU": ("lru", "hit"), "Continuum": ("continuum", "hit"),
           "KVFlow (given the true graph)": ("kvflow", "hit"), "CacheScout": ("cachescout", "hit"),
           "TTFT vs LRU": ("cachescout", "vs LRU"), "gap": ("cachescout", "gap closed"),
           "with hints": ("cachescout-hints", "hit")}


def _table_mismatches(readme: str, results: str) -> list[tuple[str, str, str, str]]:
    """(workload, column, README's cell, results.md's figure) for every cell that differs."""
    runs = _runs(_section(results, "Learned routing (the default workloads)"))
    out = []
    for row in _readme_table(readme):
        run = runs[FAMILIES[row["workload"]]]
        for column, (policy, field) in COLUMNS.items():
            if row[column] != run["rows"][policy][field]:
                out.append((row["workload"], column, row[column], run["rows"][policy][field]))
        if row["bound"] != run["bound"]:
            out.append((row["workload"], "bound", row["bound"], run["bound"]))
    return out


def test_the_readme_table_is_the_learned_routing_results(texts):
    readme, results = texts
    assert [row["workload"] for row in _readme_table(readme)] == list(FAMILIES)
    assert _table_mismatches(readme, results) == []


def test_a_changed_readme_cell_is_caught(texts):
    readme, results = texts
    start = readme.index("| GSM8K |")
    end = readme.index("\n", start)
    cells = readme[start:end].split("|")
    cells[2] = " 9.999 "          # the LRU column
    changed = readme[:start] + "|".join(cells) + readme[end:]
    lru = _runs(_section(results, "Learned routing (the default workloads)"))["gsm8k"]["rows"]["lru"]["hit"]
    assert _table_mismatches(changed, results) == [("GSM8K", "LRU", "9.999", lru)]


def test_the_readme_tier_figures_are_the_tier_results(texts):
    readme, results = texts
    runs = _runs(_section(results, "With LMCache's CPU and Redis tiers"))
    got = re.search(r"CacheScout reaches ([0-9./\s]+?) against LMCache's LRU at ([0-9./\s]+?);.*?"
                    r"\(([0-9./\s]+?) without it\)", readme, re.S)
    assert got is not None, "the README no longer states the tier figures the way this test reads them"
    ours, theirs, without = ([v.strip() for v in g.split("/")] for g in got.groups())
    families = list(FAMILIES.values())
    assert ours == [runs[f]["rows"]["cachescout"]["hit"] for f in families]
    assert theirs == [runs[f]["rows"]["lmcache-lru"]["hit"] for f in families]
    assert without == [runs[f]["rows"]["cachescout-noprefetch"]["hit"] for f in families]


def test_the_quoted_agreement_with_vllms_scheduler_bounds_every_printed_difference(texts):
    """'agree with the fast replay within N points' must hold for every policy and workload of the
    GPU-only section it sums up (a bound rounded to the nearest tenth did not: 1.25 was quoted as
    1.2)."""
    _, results = texts
    quoted = float(re.search(r"agree with the fast replay within ([0-9.]+) points", results).group(1))
    differences = [abs(float(row["difference"].split()[0]))
                   for run in _runs(_section(results, "On vLLM's own scheduler")).values()
                   for row in run["rows"].values()]
    assert len(differences) == 8 and max(differences) <= quoted, (differences, quoted)
