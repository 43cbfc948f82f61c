"""Type-check the packages with mypy, as the `cachescout.*` packages they install as.

    python tools/typecheck.py              # every package, held clean

`make test` runs it with the mypy of the native-build environment (requirements/native.txt)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("policy", "connector", "cli", "bench")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="cachescout-mypy-") as tmp:
        # mypy resolves packages from folders: link the source folders under the names they install as.
        pkg = Path(tmp) / "cachescout"
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        for folder in ("policy", "connector", "cli", "bench"):
            os.symlink(ROOT / folder, pkg / folder)
        # msgpack, redis, vLLM and LMCache: not checked here (missing stubs, or not installed).
        cmd = [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--follow-imports=silent",
               "--cache-dir", str(Path(tmp) / ".mypy_cache"), *[a for p in CHECKED for a in ("-p", f"cachescout.{p}")]]
        return subprocess.run(cmd, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
