"""The mypyc-compiled build (tools/native.py): used only when current, and identical to the sources."""

import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig

import pytest

import cachescout.bench.replay
import cachescout.connector.gpu_steering
import cachescout.policy
import cachescout.policy.eviction
from cachescout.policy import sessions

POLICY_DIR = os.path.dirname(cachescout.policy.__file__)
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
compiled = pytest.mark.skipif(not cachescout.policy.NATIVE, reason=f"not compiled: {cachescout.policy.NATIVE_STATUS}")


def test_compiled_build_runs_where_it_was_built():
    # `make test` builds it (and says so through this variable): a silent fall-back to pure Python
    # there would leave the compiled code untested and every speed figure wrong.
    if os.environ.get("CACHESCOUT_EXPECT_NATIVE") != "1":
        pytest.skip("CACHESCOUT_EXPECT_NATIVE not set (make test sets it)")
    assert cachescout.policy.NATIVE, cachescout.policy.NATIVE_STATUS
    assert cachescout.policy.eviction.__file__.endswith(SUFFIX)
    assert cachescout.bench.replay.__file__.endswith(SUFFIX)
    assert cachescout.connector.gpu_steering.__file__.endswith(SUFFIX)


def _status_of(top: str, **env: str) -> list:
    code = ("import cachescout.policy as p, cachescout.policy.eviction as e, cachescout.bench.replay as r; "
            "import cachescout.connector.gpu_steering as g; "
            "import json; print(json.dumps([p.NATIVE, p.NATIVE_STATUS, e.__file__, r.__file__, g.__file__]))")
    # A copy of the packages (and their builds) under `top`, imported as cachescout.*.
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": top, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


@compiled
def test_a_changed_source_sends_every_package_back_to_pure_python(tmp_path):
    top = tmp_path / "site"
    pkg = top / "cachescout"
    root = os.path.dirname(POLICY_DIR)
    shutil.copytree(POLICY_DIR, pkg / "policy")
    shutil.copytree(os.path.join(root, "connector"), pkg / "connector")
    shutil.copytree(os.path.join(root, "bench"), pkg / "bench", ignore=shutil.ignore_patterns("data"))
    native, status, *files = _status_of(str(top))
    assert native and all(f.endswith(SUFFIX) and f.startswith(str(pkg)) for f in files), status

    with open(pkg / "bench" / "replay.py", "a") as f:
        f.write("\n# edited after compiling\n")
    native, status, *files = _status_of(str(top))
    assert not native and "bench/replay.py changed" in status
    assert [os.path.basename(f) for f in files] == ["eviction.py", "replay.py", "gpu_steering.py"]

    native, status, *_ = _status_of(str(top), CACHESCOUT_NATIVE="0")
    assert not native and "CACHESCOUT_NATIVE=0" in status


@compiled
def test_compiled_and_pure_replays_give_the_same_figures():
    # Every policy, tiers and preemptions included: the compiled build changes speed only.
    code = """
import json, sys
from cachescout.bench.policies import make_policy
from cachescout.bench.replay import Engine, EngineConfig
from cachescout.bench.workloads import WorkloadSpec, generate
from cachescout.policy import NATIVE, PolicyConfig
sessions = generate(WorkloadSpec(family="swebench", sessions=12, seed=5))
out = {"native": NATIVE}
for name in ("lru", "belady", "kvflow", "continuum", "cachescout", "cachescout-hints", "cachescout-hashonly"):
    for cfg in (EngineConfig(gpu_blocks=900), EngineConfig(gpu_blocks=600, cpu_blocks=600, redis_blocks=2000)):
        s = Engine(cfg, make_policy(name, PolicyConfig(), sessions)).run(sessions).summary()
        out[f"{name} {cfg.gpu_blocks}"] = s
print(json.dumps(out, sort_keys=True))
"""
    runs = {}
    for flag in ("1", "0"):
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CACHESCOUT_NATIVE": flag},
                              capture_output=True, text=True, timeout=600, check=True)
        runs[flag] = json.loads(done.stdout)
    assert runs["1"].pop("native") is True and runs["0"].pop("native") is False
    assert runs["1"] == runs["0"]
    assert runs["1"]["cachescout 600"]["token_hit_rate"] > 0


def test_content_cuts_use_only_the_low_bits_of_the_mixing_constants():
    # The cut test reads bits 17-18 of a product, so the short constants give the very cuts the
    # full 64-bit ones define, for any integers (big and negative ones too).
    full, full_prev = 0x9E3779B97F4A7C15, 0x85EBCA6B
    rng = random.Random(7)
    values = ([rng.randrange(1 << 17) for _ in range(5000)] + [rng.randrange(-(1 << 80), 1 << 80) for _ in range(2000)]
              + list(range(-64, 64)))
    for tok, prev in zip(values, values[1:] + values[:1], strict=True):
        assert ((((tok * full) ^ (prev * full_prev)) >> 17) & 3 == 0) == \
            ((((tok * sessions._MIX_LO) ^ (prev * sessions._MIX_PREV_LO)) >> 17) & 3 == 0)
    assert sessions._MIX == full and sessions._MIX_PREV == full_prev
