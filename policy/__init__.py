"""CacheScout's policy core: recognise agents, learn their transitions, decide what KV to keep.

Standard library and msgpack only; nothing here imports vLLM, LMCache, torch or redis.
"""

from .config import PolicyConfig
from .core import CacheScoutPolicy, Hints, Observation
from .errors import CacheScoutError, ConfigError, StateDecodeError
from .eviction import EvictionIndex
from .fingerprint import AgentFingerprinter, Fingerprint, block_key, block_keys
from .prefetch import PrefetchAction, PrefetchCandidate, PrefetchPlanner
from .sessions import SessionTracker, content_chunks, content_sketch, sketch_window
from .state import TransitionSnapshot
from .transitions import END, START, TransitionLearner

__all__ = [
    "END", "START", "AgentFingerprinter", "CacheScoutError", "CacheScoutPolicy", "ConfigError", "EvictionIndex",
    "Fingerprint", "Hints", "Observation", "PolicyConfig", "PrefetchAction", "PrefetchCandidate", "PrefetchPlanner",
    "SessionTracker", "StateDecodeError", "TransitionLearner", "TransitionSnapshot", "block_key", "block_keys",
    "content_chunks", "content_sketch", "sketch_window",
]
