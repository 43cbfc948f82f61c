"""Workloads, the replay harness and the `cachescout` command line.

The replay engine's hot modules run compiled when the policy core's do (see `cachescout.policy`)."""

import os as _os

from cachescout.policy import native_path as _native_path

_native = _native_path(_os.path.dirname(_os.path.abspath(__file__)))
if _native is not None:
    __path__.insert(0, _native)  # noqa: F821 (the package's search path): compiled modules first
