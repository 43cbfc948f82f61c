"""Compile the hot modules with mypyc: the policy core's into `policy/_native/`, the vLLM
connector's GPU steering into `connector/_native/`, the replay engine's into `bench/_native/`
(optional).

The pure-Python sources stay the reference: the packages load these compiled modules only when
every one was built from exactly the source next to it (a hash of each is recorded and checked at
import), and run the sources otherwise. `CACHESCOUT_NATIVE=0` forces pure Python.

    python tools/native.py      (needs mypy, setuptools and a C compiler)

`make venv` runs it with a small pinned environment of its own (requirements/native.txt).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Every module a request or an eviction runs through. config (validation at start-up), errors and
# state (msgpack, off the serving path) stay interpreted; so do the packages' __init__, which pick
# the build, the connector's vLLM-facing parts, and the benchmark's policy adapters (tests and tools
# subclass them).
COMPILED = {
    "policy": ["core", "eviction", "scorer", "sessions", "fingerprint", "transitions", "traffic", "guard", "costs",
               "prefetch"],
    "connector": ["gpu_steering", "lmcache_model"],
    "bench": ["replay", "belady", "bound", "baselines"],
}
GROUP = "cachescout.policy._native"   # one shared library, in policy/_native
STAMP = "SOURCES.json"                # in policy/_native: what was compiled, from which sources


def source_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(root: Path) -> int:
    """Compile the `COMPILED` modules of the packages under `root` into their `_native` folders."""
    from mypyc.build import mypycify
    from setuptools import setup

    # The packages installed under `root` (the serving image has no benchmark).
    compiled = {package: modules for package, modules in COMPILED.items() if (root / package).is_dir()}

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    with tempfile.TemporaryDirectory(prefix="cachescout-native-") as tmp:
        # mypyc names modules after their folders: stage the sources as the packages they install as.
        stage = Path(tmp) / "src"
        (stage / "cachescout").mkdir(parents=True)
        (stage / "cachescout" / "__init__.py").write_text("")
        for package in compiled:
            shutil.copytree(root / package, stage / "cachescout" / package,
                            ignore=shutil.ignore_patterns("_native", "__pycache__", "data"))
        rel = [f"cachescout/{package}/{m}.py" for package, modules in compiled.items() for m in modules]
        lib = Path(tmp) / "lib"
        cwd = Path.cwd()
        try:
            os.chdir(stage)   # mypyc resolves the packages from the working directory
            # msgpack and redis ship no type information; modules not compiled are not checked.
            options = ["--ignore-missing-imports", "--follow-imports=silent"]
            extensions = mypycify([*options, *rel], opt_level="3", separate=[(rel, GROUP)],
                                  target_dir=str(Path(tmp) / "c"))
            setup(name="cachescout-native", ext_modules=extensions, script_name="tools/native.py",
                  script_args=["-q", "build_ext", "--build-lib", str(lib), "--build-temp", str(Path(tmp) / "obj")])
        finally:
            os.chdir(cwd)
        for package, modules in compiled.items():
            built = sorted((lib / "cachescout" / package).glob("*" + suffix))
            expected = {f"{m}{suffix}" for m in modules}
            if package == "policy":
                expected.add(f"_native__mypyc{suffix}")   # the group's shared library
            if {p.name for p in built} != expected:
                raise SystemExit(f"mypyc built {[p.name for p in built]} in {package}, expected {sorted(expected)}")
            out = root / package / "_native"
            if out.exists():
                shutil.rmtree(out)
            out.mkdir()
            for p in built:
                shutil.copy2(p, out / p.name)
        # The hashes of the very files compiled (the staged copies), not of the sources as they are now.
        stamp = {"python": sys.version.split()[0], "ext_suffix": suffix,
                 "sources": {name.removeprefix("cachescout/"): source_digest(stage / name) for name in rel}}
    (root / "policy" / "_native" / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    return len(rel)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT,
                    help="the folder holding policy/, connector/ and bench/ (the repository, or an installed "
                         "cachescout/)")
    args = ap.parse_args(argv)
    n = build(args.root)
    print(f"compiled {n} modules into {args.root}/{{{','.join(COMPILED)}}}/_native")
    return 0


if __name__ == "__main__":
    sys.exit(main())
