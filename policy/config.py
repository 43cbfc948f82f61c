"""Typed, validated settings of the policy core, and the one mechanism every settings class uses.

Every setting is declared once with `setting(default, meaning, lo=, hi=)` on a frozen dataclass:
its type is the field's annotation (int, float, bool, str or `str | None`), its range the bounds
given. `check_fields` (called by each class's `__post_init__`) and `check_mapping` (for raw input,
with the path of the key in messages) validate them all, so a bad value fails at start-up with a
message naming the field and what it accepts. The connector's and the shared state's settings
(connector/settings.py, connector/shared_state.py) are declared the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError

_DEFAULT_HI = 1e12   # the upper bound of a number without its own


def setting(default: Any, doc: str, *, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False, choices: tuple[str, ...] | None = None, flag: str | bool = True) -> Any:
    """A settings field: its default, what it means, for a number the range it must lie in, for a
    string the values it may take (`choices`, None: any non-empty string). `flag` is for classes
    whose settings are command-line flags too (cli/args.py): True, the field's name; a string, that
    flag instead; False, no flag (set another way)."""
    # Every number has an upper bound too: a finite setting can still overflow the arithmetic it feeds.
    if hi is None and isinstance(default, (int, float)) and not isinstance(default, bool):
        hi = _DEFAULT_HI
    return dataclasses.field(default=default, metadata={"doc": doc, "lo": lo, "hi": hi, "lo_open": lo_open,
                                                        "choices": choices, "flag": flag})


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """Settings of the CacheScout policy core (fingerprints, learner, scorer, prefetch)."""

    block_size: int = setting(16, "tokens per KV block (vLLM's block_size)", lo=1, hi=65536)

    # Agent fingerprints.
    fingerprint_min_support: float = setting(
        3.0, "requests that must share a prefix before it can be an agent's anchor", lo=2, hi=1e6)
    fingerprint_min_share: float = setting(
        0.0002, "share of recent requests a prefix must carry to be an anchor (0 disables)", lo=0, hi=0.5)
    fingerprint_half_life: float = setting(
        4000.0, "requests after which a prefix's support counts half", lo=0, lo_open=True)
    max_fingerprint_leaves: int = setting(
        2048, "distinct prompt tails remembered; the least recently seen age out first", lo=16, hi=10_000_000)
    max_prompt_blocks: int = setting(
        8192, "leading blocks of a prompt examined for fingerprints", lo=1, hi=10_000_000)
    max_agents: int = setting(1024, "agents remembered; the least recently seen age out first", lo=2, hi=1_000_000)

    # Sessions (one workflow instance).
    session_idle_timeout_s: float = setting(
        300.0, "seconds without a call after which a session is over, at most", lo=0, lo_open=True)
    session_idle_gap_factor: float = setting(
        20.0, "a session is also over after this many times the typical gap between its calls "
        "(at least 5 s); 0 disables", lo=0)
    max_sessions: int = setting(8192, "sessions tracked at once; the least recent are closed first",
                                 lo=1, hi=10_000_000)
    session_window_tokens: int = setting(
        192, "tokens past what earlier prompts already covered whose content identifies a session",
        lo=8, hi=65536)
    session_min_shared_chunks: int = setting(
        3, "content chunks a call must share with a session to join it", lo=1, hi=1024)

    # Transition learner.
    transition_half_life: float = setting(
        200.0, "transitions out of an agent after which an old one counts half", lo=0, lo_open=True)
    confidence_count_scale: float = setting(
        8.0, "decayed transitions out of an agent at which its count confidence is one half", lo=0, lo_open=True)
    min_confidence: float = setting(
        0.05, "confidence below which the order falls back to plain LRU", lo=0, hi=1)
    prediction_horizon: int = setting(2, "future calls per session a cached anchor is scored over", lo=1, hi=6)
    model_refresh_interval: int = setting(
        8, "learner updates between recomputations of multi-step predictions", lo=1, hi=1_000_000)
    rescore_interval_s: float = setting(
        0.1, "seconds of clock between recomputations of the groups' scores", lo=0)

    # Prefetch planner.
    prefetch_min_probability: float = setting(
        0.5, "probability an anchor is needed next before it is prefetched", lo=0, hi=1)
    prefetch_min_confidence: float = setting(0.3, "model confidence needed to prefetch at all", lo=0, hi=1)
    prefetch_max_actions: int = setting(4, "prefetch actions planned per step", lo=0, hi=1_000_000)
    prefetch_max_inflight_bytes: int = setting(
        2 * 1024**3, "bytes of prefetch allowed in flight", lo=0, hi=2**62)
    prefetch_lead_s: float = setting(
        0.5, "how long before a session's expected next call its next agent's anchor and its context are "
        "prefetched", lo=0)

    # Rebuild cost. Defaults: Llama-3.1-8B on one H200, the benchmark's default cost profile
    # (`llama3.1-8b-h200` in bench/data/cost_profiles.json, with the figures' sources); a test keeps
    # them equal, and the benchmark sets them from whichever profile it runs.
    kv_bytes_per_token: int = setting(131072, "KV-cache bytes per token of the served model", lo=1, hi=2**40)
    recompute_s_per_token: float = setting(
        4.07e-5, "seconds of prefill to recompute one token's KV", lo=0, lo_open=True)
    attention_s_per_token_context: float = setting(
        0.0, "seconds of attention to recompute one token's KV per token before it in the prompt "
        "(0: a token costs the same at any depth)", lo=0)
    cpu_load_gbps: float = setting(25.0, "GB/s from the CPU tier into GPU memory", lo=0, lo_open=True)
    cpu_load_latency_s: float = setting(1e-4, "fixed seconds per CPU-tier load", lo=0)
    redis_load_gbps: float = setting(5.0, "GB/s from the Redis tier", lo=0, lo_open=True)
    redis_load_latency_s: float = setting(1e-3, "fixed seconds per Redis-tier load", lo=0)

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> PolicyConfig:
        """Build from a plain mapping (JSON, `kv_connector_extra_config`); unknown keys are errors."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"policy settings must be a mapping of name to value, got {type(values).__name__}")
        reject_unknown(values, {f.name for f in dataclasses.fields(cls)}, "unknown setting(s)")
        return cls(**values)

    def replace(self, **changes: Any) -> PolicyConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def describe(cls) -> list[tuple[str, str, Any, str]]:
        """(name, type, default, meaning) per setting, for docs and `--help` output."""
        return describe(cls)


def accepted(kind: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> str:
    """What a setting of `kind` ('int', 'float' or 'bool') in [lo, hi] accepts, in words."""
    what = {"int": "an integer", "float": "a finite number", "bool": "true or false"}[kind]
    if lo is None and hi is None:
        return what
    left = f"> {lo:g}" if lo_open else f">= {lo:g}"
    return f"{what} {left}" + (f" and <= {hi:g}" if hi is not None else "")


def check_value(name: str, value: Any, kind: str, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False) -> None:
    """ConfigError naming `name` unless `value` is of `kind` ('int', 'float' or 'bool'), finite and
    in range. The one check every settings class uses (policy, connector, shared state): bool is
    refused where a number is wanted and 1 where a flag is, and an integer too large for a float
    is out of range rather than an OverflowError later."""
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise ConfigError(f"setting {name!r} must be {accepted(kind, lo, hi, lo_open)}, got {value!r:.80} "
                          f"({type(value).__name__})")
    if kind == "bool":
        return
    try:
        finite = math.isfinite(value)
    except OverflowError:    # an int beyond any float
        finite = False
    if (not finite or (lo is not None and (value <= lo if lo_open else value < lo))
            or (hi is not None and value > hi)):
        raise ConfigError(f"setting {name!r} must be {accepted(kind, lo, hi, lo_open)}, got {value!r:.80}")


def _type_name(f: dataclasses.Field) -> str:
    return f.type if isinstance(f.type, str) else f.type.__name__


def _check(f: dataclasses.Field, value: Any, name: str) -> None:
    kind = _type_name(f)
    if kind in ("str", "str | None"):
        if value is None and kind == "str | None":
            return
        choices = f.metadata["choices"]
        if choices is not None and value not in choices:
            raise ConfigError(f"setting {name!r} must be one of {', '.join(choices)}, got {value!r:.80}")
        if not isinstance(value, str) or not value:
            raise ConfigError(f"setting {name!r} must be a non-empty string, got {value!r:.80}")
        return
    if kind.endswith(" | None"):   # an optional number: None means "not set"
        if value is None:
            return
        kind = kind[:-len(" | None")]
    m = f.metadata
    check_value(name, value, kind, m["lo"], m["hi"], m["lo_open"])


def settings_of(cls: Any) -> dict[str, dataclasses.Field]:
    """A settings class's (or instance's) fields declared with `setting`, by name."""
    return {f.name: f for f in dataclasses.fields(cls) if "doc" in f.metadata}


def check_fields(obj: Any) -> None:
    """Validate every `setting` field of a settings dataclass instance (its `__post_init__`)."""
    for name, f in settings_of(obj).items():
        _check(f, getattr(obj, name), name)


def check_mapping(cls: Any, values: Mapping[str, Any], where: str) -> None:
    """Validate the `setting` fields of `cls` that raw input `values` gives, naming each as
    `where.name` (the path a user wrote it at); other keys are left to the caller."""
    for name, f in settings_of(cls).items():
        if name in values:
            _check(f, values[name], f"{where}.{name}")


def describe(cls: Any) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, meaning) per `setting` field of a settings class, for docs and help."""
    return [(name, _type_name(f), f.default, f.metadata["doc"]) for name, f in settings_of(cls).items()]


def reject_unknown(values: Mapping[str, Any], known: set[str], what: str) -> None:
    """ConfigError naming the keys of `values` outside `known`, and the accepted ones."""
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{what} {', '.join(map(repr, unknown))}; accepted: {', '.join(sorted(known))}")
