"""CacheScout's policy core: recognise agents, learn their transitions, decide what KV to keep.

Standard library and msgpack only; nothing here imports vLLM, LMCache, torch or redis.

The hot modules may also be compiled with mypyc (`tools/native.py`, run by `make venv`) into
`_native/`. They are used only when built from exactly these sources (`NATIVE` says which runs,
`NATIVE_STATUS` why); `CACHESCOUT_NATIVE=0` forces the pure-Python modules.
"""

import hashlib as _hashlib
import json as _json
import os as _os
import sysconfig as _sysconfig


def _compiled_build() -> tuple[bool, str]:
    """Whether the compiled modules (policy/_native, connector/_native, bench/_native) may be used,
    and why (not): only when every one of them was compiled from the source next to it now. All or
    none: they share one library, and a mix would run code no test ran."""
    if _os.environ.get("CACHESCOUT_NATIVE", "1") == "0":
        return False, "pure Python (CACHESCOUT_NATIVE=0)"
    here = _os.path.dirname(_os.path.abspath(__file__))
    top = _os.path.dirname(here)   # holds policy/, connector/, bench/ (the repository or site-packages/cachescout)
    try:
        with open(_os.path.join(here, "_native", "SOURCES.json")) as f:
            stamp = _json.load(f)
        sources = dict(stamp["sources"])
    except (OSError, ValueError, KeyError, TypeError):
        return False, "pure Python (not compiled: `make native`)"
    if stamp.get("ext_suffix") != _sysconfig.get_config_var("EXT_SUFFIX"):
        return False, f"pure Python (compiled for another interpreter: {stamp.get('ext_suffix')})"
    for name, digest in sources.items():
        try:
            with open(_os.path.join(top, name), "rb") as f:
                current = _hashlib.sha256(f.read()).hexdigest()
        except OSError:
            current = None
        if current != digest:
            return False, f"pure Python ({name} changed since it was compiled: `make native`)"
    return True, f"compiled with mypyc ({len(sources)} modules)"


def compiled_first(package_path: list[str]) -> None:
    """Make a package (by its `__path__`) find its compiled modules, in its `_native` folder, before
    its sources, when the compiled build is in use."""
    if NATIVE:
        package_path.insert(0, _os.path.join(package_path[0], "_native"))


NATIVE, NATIVE_STATUS = _compiled_build()
compiled_first(__path__)  # noqa: F821 (the package's search path)

from .config import (PolicyConfig, check_fields, check_mapping, check_value, describe, reject_unknown, setting,
                     settings_of)
from .core import SHARED_NAME_PREFIX, CacheScoutPolicy, Hints, Observation, PolicyInternals, output_ending
from .errors import CacheScoutError, ConfigError, ExternalError, InputError, StateDecodeError
from .eviction import EvictionIndex
from .fingerprint import AgentFingerprinter, Fingerprint, block_key, block_keys
from .guard import measured_gain
from .prefetch import PrefetchAction, PrefetchCandidate, PrefetchPlanner
from .sessions import SessionTracker, content_chunks, content_sketch, sketch_window
from .state import TransitionSnapshot
from .transitions import END, START, TransitionLearner

__all__ = [
    "END", "SHARED_NAME_PREFIX", "START", "AgentFingerprinter", "CacheScoutError", "CacheScoutPolicy", "ConfigError",
    "EvictionIndex", "ExternalError", "Fingerprint", "Hints", "InputError", "Observation", "PolicyConfig",
    "PolicyInternals", "PrefetchAction", "PrefetchCandidate", "PrefetchPlanner", "SessionTracker", "StateDecodeError",
    "TransitionLearner", "TransitionSnapshot", "block_key", "block_keys", "check_fields", "check_mapping",
    "check_value", "content_chunks", "content_sketch", "describe", "measured_gain", "output_ending", "reject_unknown",
    "setting", "settings_of", "sketch_window",
    "NATIVE", "NATIVE_STATUS",
]
