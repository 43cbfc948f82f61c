"""One exception root for CacheScout, split the way callers need to react."""

from __future__ import annotations


class CacheScoutError(Exception):
    """Root of every error CacheScout raises on purpose."""


class ConfigError(CacheScoutError, ValueError):
    """A setting is unknown, of the wrong type or out of range (raised at start-up)."""


class StateDecodeError(CacheScoutError, ValueError):
    """Bytes claiming to be learned state (from Redis or a file) were rejected."""
