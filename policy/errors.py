"""One exception root for CacheScout, split the way callers need to react.

Everything CacheScout raises on purpose derives from `CacheScoutError`; the command line turns those
into one-line messages and lets anything else (a defect) show its traceback. The input kinds are
also `ValueError`s and the outside-world kind a `RuntimeError`, so callers that caught those still do."""

from __future__ import annotations


class CacheScoutError(Exception):
    """Root of every error CacheScout raises on purpose."""


class ConfigError(CacheScoutError, ValueError):
    """A setting is unknown, of the wrong type or out of range (raised at start-up)."""


class InputError(CacheScoutError, ValueError):
    """Input that cannot be used: a trace, a workload, a command-line option, an argument."""


class StateDecodeError(CacheScoutError, ValueError):
    """Bytes claiming to be learned state (from Redis or a file) were rejected."""


class ExternalError(CacheScoutError, RuntimeError):
    """Something outside CacheScout failed or disagrees: Redis, a server it started, a tool it needs,
    another replica's state, the engine's KV layout."""
