"""Learned transitions shared by every replica of a deployment, through Redis, off the serving path.

    "kv_connector_extra_config": {"shared_state": {"url": "rediss://state-redis:6379/0",
        "username": "cachescout", "password_env": "CACHESCOUT_STATE_PASSWORD", "deployment": "prod"}}

How the counts flow (one `SharedLearnedState` per replica, on the scheduler side):

    scheduler thread                          background thread ("cachescout-state")
    chain updates --set_journal--> ops ---> shadow learner (this replica's own counts)
                                                    every flush_interval_s:
                                                      write own absolute counts  (state_store.py)
                                                      read peers' and departed counts
                                                      merged = own + peers + departed (age-weighted)
    on_step(): install merged,  <---------------- publish (merged, last op folded in)
               replay the few ops since

The scheduler thread only appends to a deque and, when a merged model is ready, swaps it in and
replays the handful of updates made since it was built. Redis is only touched by the background
thread, with short timeouts, a bounded retry and a circuit breaker: Redis down, slow or returning
garbage never reaches serving, local learning goes on, and `status()`/metrics say what is wrong.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import importlib.util
import logging
import math
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import SplitResult, urlsplit

from cachescout.policy import (SHARED_NAME_PREFIX, CacheScoutPolicy, ConfigError, ExternalError, StateDecodeError,
                               TransitionLearner, TransitionSnapshot, check_fields, check_mapping, reject_unknown,
                               setting)
from cachescout.policy.state import MAX_BLOB_BYTES

from .state_store import FETCH_CHUNK_BYTES, NAME_RULE, SCHEMA, StateKeys, StateStore, StoreView

if TYPE_CHECKING:
    from .peer_reader import PeerReader

log = logging.getLogger("cachescout.shared_state")

_EPOCH = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_REJECT_LOG_INTERVAL_S = 600.0
_READER_START_TRIES = 3  # failed starts of the helper process in a row before peers are read in this one
_DEPARTED_FLOOR = 1e-3     # a departed blob weighing less than this is dropped (about 10 half-lives)


def departed_weight(age_ms: float, half_life_s: float) -> float:
    """Weight of a departed replica's counts `age_ms` after its last flush; 0 once negligible."""
    w = 0.5 ** (max(0.0, age_ms) / (half_life_s * 1000))
    return w if w >= _DEPARTED_FLOOR else 0.0


@dataclasses.dataclass(frozen=True)
class SharedStateSettings:
    """Where and how replicas share their learned transitions (`shared_state` in the connector's
    settings). Secrets are never values here: `password_env`/`password_file` name where the password is."""

    url: str | None = setting(None, "redis://, rediss:// (TLS) or unix://; no password in it")
    sentinels: tuple[str, ...] = ()          # "host:port" of Sentinels; with sentinel_service, replaces url
    sentinel_service: str | None = setting(None, "the master's name at the Sentinels")
    sentinel_tls: bool = setting(False, "Sentinels and the master speak TLS (with url: rediss:// says so)")
    cluster: bool = setting(False, "url points at a Redis Cluster node")
    deployment: str = setting("default", "the deployment's name: replicas of one share their state")
    model: str | None = setting(None, "the served model's name (default: vLLM's)")
    replica: str | None = setting(None, "this replica's name (default: $POD_NAME, else the host name)")
    username: str | None = setting(None, "Redis ACL user")
    password_env: str | None = setting(None, "environment variable holding the password")
    password_file: str | None = setting(None, "file holding the password")
    tls_ca_file: str | None = setting(None, "CA certificate file (rediss://)")
    tls_cert_file: str | None = setting(None, "client certificate file (mutual TLS)")
    tls_key_file: str | None = setting(None, "client key file (mutual TLS)")
    flush_interval_s: float = setting(5.0, "seconds between flushes of this replica's counts", lo=0.05, hi=3600.0)
    timeout_s: float = setting(0.25, "seconds every Redis call may take", lo=0.01, hi=10.0)
    retries: int = setting(1, "retries of a failed Redis call", lo=0, hi=5)
    breaker_failures: int = setting(3, "failed rounds in a row that open the circuit breaker", lo=1, hi=100)
    breaker_max_cooldown_s: float = setting(30.0, "longest pause of an open breaker", lo=0.1, hi=3600.0)
    fold_after_s: float = setting(600.0, "a replica silent this long is folded into \"departed\"",
                                  lo=0.15, hi=30 * 86400.0)
    departed_half_life_s: float = setting(3600.0, "a departed replica's counts halve in weight this often",
                                          lo=1.0, hi=365 * 86400.0)
    replica_ttl_s: float = setting(7 * 86400.0, "a replica's entry expires after this long without a flush",
                                   lo=60.0, hi=365 * 86400.0)
    max_blob_bytes: int = setting(4 * 1024 * 1024, "largest state entry read or written", lo=1024, hi=MAX_BLOB_BYTES)
    max_replicas: int = setting(256, "replicas whose entries are read", lo=1, hi=10_000)
    isolated_reader: bool = setting(True, "fetch and check peers' entries in a helper process, off vLLM's "
                                          "interpreter lock (docs/shared_state.md)")

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], where: str = "shared_state", *,
                     check_environment: bool = True) -> SharedStateSettings:
        """`check_environment`: also check that the password variable is set and the files are
        readable (at start-up, in the pod; not when printing a configuration elsewhere)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} must be a JSON object, got {type(raw).__name__}")
        reject_unknown(raw, {f.name for f in dataclasses.fields(cls)}, f"{where}: unknown key(s)")
        values = dict(raw)
        check_mapping(cls, values, where)
        sentinels = values.get("sentinels", ())
        if not isinstance(sentinels, (list, tuple)) or not all(
                isinstance(s, str) and _host_port(s) is not None for s in sentinels):
            raise ConfigError(f"{where}.sentinels must be a list of \"host:port\" strings, got {sentinels!r}")
        values["sentinels"] = tuple(sentinels)
        s = cls(**values)
        s._check(where, check_environment)
        return s

    def _check(self, where: str, check_environment: bool) -> None:
        if self.sentinels or self.sentinel_service:
            if not (self.sentinels and self.sentinel_service):
                raise ConfigError(f"{where}: 'sentinels' and 'sentinel_service' go together (give both)")
            if self.cluster:
                raise ConfigError(f"{where}: 'cluster' and 'sentinels' exclude each other")
        elif self.sentinel_tls:
            raise ConfigError(f"{where}.sentinel_tls applies to 'sentinels'; with 'url', use rediss://")
        elif self.url is None:
            raise ConfigError(f"{where}: give 'url' (redis://, rediss:// or unix://) or 'sentinels' + "
                              "'sentinel_service'")
        if self.url is not None:
            parts = urlsplit(self.url)
            if parts.scheme not in ("redis", "rediss", "unix"):
                raise ConfigError(f"{where}.url must start with redis://, rediss:// or unix://, got "
                                  f"{parts.scheme + '://' if parts.scheme else self.url[:16]!r}")
            if parts.password:
                raise ConfigError(f"{where}.url must not hold a password (it would show in process arguments "
                                  "and logs); use 'password_env' or 'password_file'")
            _check_url(parts, where)
        if self.password_env and self.password_file:
            raise ConfigError(f"{where}: give 'password_env' or 'password_file', not both")
        if check_environment and self.password_env and self.password_env not in os.environ:
            raise ConfigError(f"{where}.password_env names ${self.password_env}, which is not set")
        for name in ("password_file", "tls_ca_file", "tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if check_environment and path is not None and not os.access(path, os.R_OK):
                raise ConfigError(f"{where}.{name}: cannot read {path!r}")
        if self.fold_after_s < 3 * self.flush_interval_s * (1 - 1e-9):
            raise ConfigError(f"{where}.fold_after_s ({self.fold_after_s}) must be at least 3 x flush_interval_s "
                              f"({self.flush_interval_s}), or live replicas would be folded")
        for name in ("deployment", "model", "replica"):
            v = getattr(self, name)
            if v is not None and not StateKeys.valid_name(v):
                raise ConfigError(f"{where}.{name} must be {NAME_RULE}, got {v!r}")

    def password(self) -> str | None:
        if self.password_env:
            return os.environ.get(self.password_env)
        if self.password_file:
            with open(self.password_file, encoding="utf-8") as f:
                return f.read().strip()
        return None

    def replica_name(self) -> str:
        name = self.replica or os.environ.get("POD_NAME") or socket.gethostname()
        return name if StateKeys.valid_name(name) else "".join(c if c.isalnum() else "-" for c in name)[:128]

    def target(self) -> str:
        """Where the state lives, safe to log (no credentials)."""
        if self.sentinels:
            return f"sentinel {self.sentinel_service} via {','.join(self.sentinels)}"
        parts = urlsplit(self.url or "")
        host = parts.hostname or parts.path
        return f"{parts.scheme}://{host}{':' + str(parts.port) if parts.port else ''}"


def _check_url(parts: SplitResult, where: str) -> None:
    """What redis-py would refuse only when it first connects, refused at start-up instead."""
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port == -1 or port == 0:
        raise ConfigError(f"{where}.url has an invalid port (an integer in 1..65535): {parts.netloc!r:.80}")
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError(f"{where}.url: unix:// needs the socket's path, e.g. unix:///run/redis.sock")
        return
    if not parts.hostname:
        raise ConfigError(f"{where}.url names no host: {parts.scheme}://{parts.netloc}")
    db = parts.path.lstrip("/")
    if db and not (db.isdigit() and int(db) < 2**31):
        raise ConfigError(f"{where}.url: the database after the host must be a number, e.g. /0, got /{db[:20]!r}")


def _host_port(s: str) -> tuple[str, int] | None:
    host, _, port = s.rpartition(":")
    return (host, int(port)) if host and port.isdigit() and 0 < int(port) < 65536 else None


def _import_round_modules() -> None:
    """Import now, while vLLM starts, what the rounds use. vLLM freezes its heap for the garbage
    collector once started (what exists then is never scanned again); imported at the first round
    instead, redis-py's modules were some 26,000 objects that every full collection walked, with the
    interpreter lock held: 7-9 ms each on a loaded 2-core VM, in whichever thread triggered it."""
    import redis  # noqa: F401
    import redis.backoff  # noqa: F401
    import redis.cluster  # noqa: F401
    import redis.exceptions  # noqa: F401
    import redis.retry  # noqa: F401
    import redis.sentinel  # noqa: F401

    from . import peer_reader  # noqa: F401


def connect(settings: SharedStateSettings) -> Any:
    """A redis-py client that fails fast: short timeouts, one bounded retry, no long backoff."""
    import redis
    from redis.backoff import ConstantBackoff, NoBackoff
    from redis.retry import Retry

    common: dict[str, Any] = {
        "socket_timeout": settings.timeout_s, "socket_connect_timeout": settings.timeout_s,
        "retry": Retry(ConstantBackoff(settings.timeout_s / 5), settings.retries),
        "username": settings.username, "password": settings.password(),
        "client_name": f"cachescout-{settings.replica_name()}"[:64],
    }
    tls = {k: v for k, v in (("ssl_ca_certs", settings.tls_ca_file), ("ssl_certfile", settings.tls_cert_file),
                             ("ssl_keyfile", settings.tls_key_file)) if v}
    if settings.sentinels:
        from redis.sentinel import Sentinel
        hosts = [_host_port(s) for s in settings.sentinels]
        ssl = {"ssl": True, **tls} if settings.sentinel_tls else {}
        # Sentinels are asked without credentials (the ACL user is the master's): protect them by
        # network policy, as the Helm chart does.
        # The Sentinels' own connections get the same timeouts and bounded retry (without a `retry`
        # redis-py retries them with its default back-off: seconds per round on a paused Sentinel).
        sentinel = Sentinel(hosts, sentinel_kwargs={"socket_timeout": settings.timeout_s,
                                                    "socket_connect_timeout": settings.timeout_s,
                                                    "retry": Retry(NoBackoff(), 0), **ssl})
        return sentinel.master_for(settings.sentinel_service, **common, **ssl)
    if tls:
        common.update(tls)
    if settings.cluster:
        from redis.cluster import RedisCluster
        common.pop("retry")
        return RedisCluster.from_url(settings.url, **common)
    return redis.Redis.from_url(settings.url, **common)


class CircuitBreaker:
    """After `failures` failures in a row, refuse attempts for a cool-down that doubles each time
    (up to `max_cooldown_s`); one success closes it."""

    def __init__(self, failures: int, max_cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = failures
        self.max_cooldown_s = max_cooldown_s
        self.clock = clock
        self.failures = 0
        self.open_until = 0.0
        self.opened = 0

    def allow(self) -> bool:
        return self.clock() >= self.open_until

    @property
    def is_open(self) -> bool:
        return self.failures >= self.threshold

    def success(self) -> None:
        self.failures = 0
        self.open_until = 0.0

    def failure(self) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            k = self.failures - self.threshold
            self.open_until = self.clock() + min(self.max_cooldown_s, 0.5 * 2 ** min(k, 16))
            self.opened += 1


class _Peer:
    __slots__ = ("key", "rows")

    def __init__(self, key: tuple[int, int], rows: dict[str, dict[str, float]]) -> None:
        self.key = key
        self.rows = rows


class SharedLearnedState:
    """One replica's side of the shared state: own counts out, everyone's counts in (see module doc)."""

    def __init__(self, settings: SharedStateSettings, *, half_life: float, confidence_count_scale: float = 8.0,
                 model: str, hash_domain: str, client_factory: Callable[[SharedStateSettings], Any] = connect,
                 clock: Callable[[], float] = time.monotonic, max_journal: int = 100_000,
                 replica_suffix: str = "") -> None:
        """`replica_suffix`: tells apart several schedulers of one pod (vLLM data-parallel ranks),
        each of which learns and writes on its own."""
        if client_factory is connect and importlib.util.find_spec("redis") is None:
            raise ConfigError("shared_state needs the redis package, which is not installed: "
                              "pip install 'cachescout[redis]'")
        if client_factory is connect:
            _import_round_modules()
        self.settings = settings
        self.replica = settings.replica_name() + replica_suffix
        self.keys = StateKeys(settings.deployment, settings.model or model)
        self.half_life = float(half_life)
        self.confidence_count_scale = float(confidence_count_scale)
        self.hash_domain = hash_domain
        self._client_factory = client_factory
        self.clock = clock
        self.breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_max_cooldown_s, clock)
        self.stats: collections.Counter[str] = collections.Counter()
        self.timings: dict[str, float] = {}   # the last round's phases (seconds), for the benchmark
        self._fetch_s = 0.0                    # this round's time fetching peers' blobs (counted as reading)
        # Scheduler thread only.
        self._seq = 0
        self._recent: collections.deque = collections.deque(maxlen=65_536)
        # Shared: appended by the scheduler thread, drained by the background thread (deque ops are atomic).
        self._ops: collections.deque = collections.deque(maxlen=max_journal)
        self._published: tuple[TransitionLearner, int] | None = None
        self._names: dict[str, str] = {}        # local agent name -> shared name (CacheScoutPolicy.shared_names)
        self._names_version = -1
        # Background thread (or a caller of sync_now), under _lock.
        self._lock = threading.Lock()
        self._shadow = TransitionLearner(self.half_life, self.confidence_count_scale)
        self._applied = 0
        self._store: StateStore | None = None
        self._epoch: str | None = None
        self._my_epoch = secrets.token_hex(8)     # used if this replica creates the deployment's state
        self._gen: int | None = None
        self._flush_seq = 0
        self._peers: dict[str, _Peer] = {}
        self._rejected: dict[str, tuple[int, int]] = {}   # entries refused, by (gen, seq): not fetched again
        self._pacer = _Pacer()
        self._bad_seen: set[tuple[str, int, int]] = set()
        self._reject_logged: dict[str, float] = {}
        self.problem: str | None = None           # misconfiguration or supersession: sharing stopped
        self.superseded = False                   # a newer process took this replica's name: for good
        self._problem_logged_at = -math.inf
        self.last_ok: float | None = None
        self.peer_count = 0
        self.departed_count = 0
        self._failing_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Peers' entries are read by a helper process (peer_reader.py) when Redis is reached the
        # usual way; a client handed in (tests, tools) is used in this process.
        self._isolated = settings.isolated_reader and client_factory is connect
        self._reader: PeerReader | None = None

    # -- scheduler thread ---------------------------------------------------------------------
    def attach(self, policy: CacheScoutPolicy) -> None:
        if policy.half_life != self.half_life:
            raise ConfigError("shared state and policy disagree on transition_half_life")
        policy.set_journal(self.record)
        self.note_names(policy)

    def note_names(self, policy: CacheScoutPolicy) -> None:
        """Refresh the names agents are shared under (scheduler thread; the dict is swapped whole).
        on_step does it whenever an anchor was learned or changed."""
        self._names_version = policy.names_version
        self._names = policy.shared_names()

    def record(self, op: tuple) -> None:
        """Journal one learner change (called by the learner; O(1))."""
        self._seq += 1
        item = (self._seq, op)
        self._ops.append(item)
        self._recent.append(item)

    def on_step(self, policy: CacheScoutPolicy) -> bool:
        """Once per scheduler step: swap in a merged model if one is ready. True when installed."""
        if policy.names_version != self._names_version:
            self.note_names(policy)
        pub = self._published
        if pub is None:
            return False
        self._published = None
        learner, upto = pub
        tail = []
        for item in reversed(self._recent):
            if item[0] <= upto:
                break
            tail.append(item)
        if tail and tail[-1][0] != upto + 1:
            self.stats["install_skipped"] += 1   # the updates since it was built are no longer all at hand
            return False
        for _, op in reversed(tail):
            learner.replay(op)
        policy.install_learner(learner)
        self.stats["installs"] += 1
        return True

    # -- background ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cachescout-state", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self.sync_now()
            if self._stop.wait(self.settings.flush_interval_s):
                return

    def close(self, final_flush: bool = True, timeout: float | None = None) -> None:
        """Stop the thread; with `final_flush`, write the last counts (bounded by the client timeouts).
        Never raises (vLLM's shutdown goes on after it)."""
        self._stop.set()
        reader = self._reader
        if reader is not None:
            reader.terminate()     # a round waiting on it ends now
        alive = False
        if self._thread is not None:
            self._thread.join(timeout if timeout is not None else 4 * self.settings.timeout_s + 1)
            alive = self._thread.is_alive()
            self._thread = None
        if final_flush and self.problem is None:
            self.sync_now(read=False)
        reader = self._reader
        if reader is not None:
            reader.terminate()
            if not alive:          # its pipes are the thread's while it runs (see terminate)
                self._reader = None
                reader.kill()
        store, self._store = self._store, None
        if store is not None:
            try:
                store.r.close()
            except Exception:  # noqa: BLE001 - closing a broken connection must not fail shutdown
                pass

    def sync_now(self, read: bool = True) -> bool:
        """One round: journal into own counts, flush them, read everyone's, publish the merge.
        Never raises; True when Redis answered."""
        try:
            return self._sync(read)
        except Exception:  # noqa: BLE001 - a defect here must not reach vLLM: logged, counted, retried
            self.stats["internal_errors"] += 1
            if self.stats["internal_errors"] == 1:
                log.exception("CacheScout shared state: a round failed unexpectedly; serving goes on, "
                              "retrying each round (please report this)")
            if self._failing_since is None:
                self._failing_since = self.clock()
            return False

    def _sync(self, read: bool) -> bool:
        with self._lock:
            self._drain()
            if self.superseded or (self.problem is not None and self.clock() - self._problem_logged_at < 60):
                return False
            if not self.breaker.allow():
                self.stats["breaker_skips"] += 1
                return False
            try:
                self._round(read)
            except Exception as exc:  # noqa: BLE001 - whatever Redis does, serving goes on
                self._failed(exc)
                return False
            self.breaker.success()
            if self.problem is not None:
                return False
            self.last_ok = self.clock()
            if self._failing_since is not None:
                log.warning("CacheScout shared state: %s answers again after %.1f s; state healed",
                            self.settings.target(), self.clock() - self._failing_since)
                self._failing_since = None
            return True

    def _drain(self) -> None:
        ops = self._ops
        shadow = self._shadow
        while True:
            try:
                seq, op = ops.popleft()
            except IndexError:
                break
            if seq != self._applied + 1:
                self.stats["journal_lost"] += seq - self._applied - 1
            shadow.replay(op)
            self._applied = seq

    def _repair(self, store: StateStore) -> None:
        """Delete the deployment's keys that hold another Redis type (someone else wrote them):
        without that, every round would fail on them for good."""
        for key, kind in store.repair(self.replica).items():
            self.stats["repaired_keys"] += 1
            log.warning("CacheScout shared state: deleted %s, which held a Redis %s instead of CacheScout's "
                        "state (written by something else)", key[:200], kind)

    def _failed(self, exc: Exception) -> None:
        import redis.exceptions as rx
        reader = self._reader
        if reader is not None and reader.failed_starts >= _READER_START_TRIES:
            # A helper process cannot be started here (no usable Python executable, a sandbox that
            # forbids it): read peers in this process, paced, as without the helper.
            self._isolated = False
            self._reader = None
            self.stats["reader_fallbacks"] += 1
            log.warning("CacheScout shared state: %s, %d times in a row; reading peers' entries in this "
                        "process from now on (paced; see docs/shared_state.md)", exc, reader.failed_starts)
        if isinstance(exc, rx.ResponseError) and "WRONGTYPE" in str(exc) and self._store is not None:
            try:
                self._repair(self._store)
            except Exception:  # noqa: BLE001 - the next round tries again
                pass
        self.breaker.failure()
        now = self.clock()
        text = str(exc)
        auth = isinstance(exc, (rx.AuthenticationError, rx.AuthorizationError, rx.NoPermissionError)) or (
            isinstance(exc, rx.ResponseError) and (text.startswith(("NOPERM", "WRONGPASS", "NOAUTH"))
                                                   or "can't run this command" in text   # ACL, inside a script
                                                   or "no permissions" in text.lower()))
        if auth:
            self.stats["auth_errors"] += 1
            # Misconfiguration, not weather: say so every time the breaker lets a try through.
            log.error("CacheScout shared state: Redis at %s refused access (%s: %s); check the ACL user "
                      "and password (docs/usage.md, shared state)", self.settings.target(),
                      type(exc).__name__, exc)
        else:
            self.stats["errors"] += 1
            if self._failing_since is None:
                log.warning("CacheScout shared state: %s unavailable (%s: %s); serving and local learning go "
                            "on, retrying with back-off", self.settings.target(), type(exc).__name__, exc)
        if self._failing_since is None:
            self._failing_since = now

    def _stop_sharing(self, why: str) -> None:
        self.problem = why
        self._problem_logged_at = self.clock()
        self.stats["problems"] += 1
        log.error("CacheScout shared state: %s; this replica keeps learning locally%s", why,
                  "" if self.superseded else " and retries in 60 s")

    # -- one round ----------------------------------------------------------------------------
    def _round(self, read: bool) -> None:
        s = self.settings
        if self._store is None:
            self._store = StateStore(self._client_factory(s), self.keys, max_blob_bytes=s.max_blob_bytes,
                                     max_replicas=s.max_replicas)
        store = self._store
        ttl_ms = int(s.replica_ttl_s * 1000)
        if self._epoch is None or self.problem is not None:
            status, a, b = store.ensure_meta(self.half_life, self.hash_domain, self._epoch or self._my_epoch)
            if status == "mismatch":
                self._stop_sharing(
                    f"deployment {self.keys.prefix!r} holds state with {a}={b!r} but this replica has "
                    f"{a}={self._meta_value(a)!r}; replicas sharing state need the same transition_half_life and "
                    "the same block hashing (PYTHONHASHSEED, prefix_caching_hash_algo)")
                return
            self.problem = None
            if status == "created":
                self.stats["meta_created"] += 1
            self._adopt_epoch(a)
        for _ in range(3):
            epoch = self._epoch
            assert epoch is not None   # adopted above
            if self._gen is None:
                status, v = store.register(self.replica, epoch, ttl_ms)
                if status == "epoch":
                    self._epoch_changed(store, v)
                    continue
                self._gen, self._flush_seq = v, 0
                self.stats["registrations"] += 1
            self._flush_seq += 1
            t0 = time.perf_counter()
            own = _renamed(self._shadow.decayed_rows(), self._names)
            blob = TransitionSnapshot.from_rows(self.half_life, own).encode()
            t1 = time.perf_counter()
            status, v = store.flush(self.replica, epoch, self._gen, self._flush_seq, blob, ttl_ms)
            self.timings.update(encode_s=t1 - t0, flush_s=time.perf_counter() - t1, blob_bytes=len(blob))
            self.stats[f"flush_{status}"] += 1
            if status in ("ok", "dup"):
                break
            if status == "epoch":
                self._epoch_changed(store, v)
            elif status == "stale":
                current = store.current_gen(self.replica)
                if current is not None and current > self._gen:
                    self.superseded = True
                    self._stop_sharing(f"another process registered as replica {self.replica!r} (generation "
                                       f"{current} > {self._gen}); this copy stops writing shared state")
                    self._gen = None
                    return
                # Folded in by peers while silent (paused, partitioned): its counts up to the last
                # flush are in "departed"; start a new life counting from zero (what was learned
                # since that flush is lost: at most one flush interval, never counted twice).
                self._shadow = TransitionLearner(self.half_life, self.confidence_count_scale)
                self._gen = None
                self.stats["refolded"] += 1
        if read:
            t0 = time.perf_counter()
            view = store.read(skip=self.replica, known={**self._rejected,
                                                        **{n: p.key for n, p in self._peers.items()}},
                              tick=self._pacer, fetch=False)
            if view.wrong_type:
                self._repair(store)
            t1 = time.perf_counter()
            self._fetch_s = 0.0
            if self._isolated:
                self._merge_isolated(view, store)
            else:
                self._merge(view, store)
            merge = time.perf_counter() - t1 - self._fetch_s
            self.timings.update(read_s=t1 - t0 + self._fetch_s, merge_s=merge)

    def _fetch_next(self, store: StateStore, waiting: list[tuple[str, str, int]]) -> dict[str, tuple[bytes, ...]]:
        """The next of `waiting`'s blobs, with those after it that fit in the same round trip
        (small peers' blobs come several to a trip); removed from `waiting`. The time counts as
        reading (`timings['read_s']`)."""
        t0 = time.perf_counter()
        n, size = 1, waiting[0][2]
        while n < len(waiting) and size + waiting[n][2] <= FETCH_CHUNK_BYTES:
            size += waiting[n][2]
            n += 1
        batch = waiting[:n]
        del waiting[:n]
        got = store.fetch(batch, tick=self._pacer)
        self._fetch_s += time.perf_counter() - t0
        return got

    def _meta_value(self, field: str) -> str:
        return {"schema": SCHEMA, "half_life": repr(self.half_life), "hash_domain": self.hash_domain}.get(field, "?")

    def _adopt_epoch(self, epoch: str) -> None:
        if not _EPOCH.match(epoch):
            # Replicas and `cachescout state reset` write 16 hex digits; a long or odd value is someone else's.
            raise ExternalError(f"the deployment's epoch {epoch[:40]!r} is not one CacheScout writes "
                               "(`cachescout state reset` repairs it)")
        self._epoch = epoch
        self._my_epoch = epoch   # if Redis loses everything, recreate the same epoch, do not reset peers

    def _epoch_changed(self, store: StateStore, epoch: str) -> None:
        if epoch in ("false", ""):
            # The deployment's keys are gone (Redis restarted without persistence): recreate them with
            # the same epoch; the flush that follows writes this replica's absolute counts back.
            self.stats["meta_lost"] += 1
            status, a, b = store.ensure_meta(self.half_life, self.hash_domain, self._epoch or self._my_epoch)
            if status == "mismatch":
                raise ExternalError(f"state meta was recreated with {a}={b!r} by another replica")
            if a == self._epoch:
                return
            epoch = a
        # An operator reset the deployment (`cachescout state reset`): start the counts over.
        log.warning("CacheScout shared state: deployment %r was reset; learned counts start over",
                    self.keys.prefix)
        self.stats["resets_seen"] += 1
        self._adopt_epoch(epoch)
        self._shadow = TransitionLearner(self.half_life, self.confidence_count_scale)
        self._peers.clear()
        self._gen = None

    def _merge(self, view: StoreView, store: StateStore) -> None:
        s = self.settings
        peers: dict[str, _Peer] = {}
        rejected: dict[str, tuple[int, int]] = {}
        for entry in view.malformed:
            self._reject(entry, 0, 0, "bookkeeping fields are not integers")
        # Blobs are fetched as they come up, a trip's worth (FETCH_CHUNK_BYTES) at a time, and each is
        # freed once decoded: a round holds about one peer's bytes, not every peer's (eight hostile
        # peers of 4 MiB made 32 MiB per round).
        entries = view.replicas + view.departed
        waiting = [(b.name, *view.pending[b.name]) for b in entries if b.name in view.pending]
        ready: dict[str, tuple[bytes, ...]] = {}
        for b in entries:
            key = (b.gen, b.seq)
            if b.blob is None:
                self._reject(b.name, b.gen, b.seq, f"{b.size} bytes, over max_blob_bytes {s.max_blob_bytes}")
                continue
            old = self._peers.get(b.name)
            if old is not None and old.key == key:
                peers[b.name] = old
                continue
            parts = b.blob
            if not parts and b.name in view.pending:
                if b.name not in ready and waiting and waiting[0][0] == b.name:
                    ready.update(self._fetch_next(store, waiting))
                parts = ready.pop(b.name, ())     # absent: its key no longer holds a string
            if not parts:
                if self._rejected.get(b.name) == key:
                    rejected[b.name] = key    # refused before and unchanged: not fetched, not decoded again
                continue     # else registered, nothing flushed yet
            try:
                with _collector_deferred():
                    snap = TransitionSnapshot.decode(parts, self._pacer)
            except StateDecodeError as exc:
                rejected[b.name] = key
                self._reject(b.name, b.gen, b.seq, str(exc))
                continue
            if snap.half_life != self.half_life:
                rejected[b.name] = key
                self._reject(b.name, b.gen, b.seq, f"half_life {snap.half_life} != {self.half_life}")
                continue
            peers[b.name] = _Peer(key, snap.decayed_rows())
            del parts, snap
            self._pacer()
        self._peers = peers
        self._rejected = rejected
        self._fold_and_prune(view, store)
        t0 = time.perf_counter()
        # Everyone's counts summed into one set of rows, then one learner built from them.
        total = self._shadow.decayed_rows()
        departed = {b.name: b.at_ms for b in view.departed}
        local = {shared: name for name, shared in self._names.items()}   # shared name -> this replica's
        for name, peer in peers.items():
            at = departed.get(name)
            w = 1.0 if at is None else departed_weight(view.now_ms - at, s.departed_half_life_s)
            if w > 0:
                _renamed(peer.rows, local, w, drop_unknown=True, into=total, tick=self._pacer)
        self._publish(total, view, t0)

    def _merge_isolated(self, view: StoreView, store: StateStore) -> None:
        """`_merge` with the peers' entries fetched, checked and summed by the helper process."""
        s = self.settings
        for entry in view.malformed:
            self._reject(entry, 0, 0, "bookkeeping fields are not integers")
        departed = {b.name: b.at_ms for b in view.departed}
        rejected: dict[str, tuple[int, int]] = {}
        asked: dict[str, tuple[int, int]] = {}
        peers = []
        for b in view.replicas + view.departed:
            key = (b.gen, b.seq)
            if b.blob is None:
                self._reject(b.name, b.gen, b.seq, f"{b.size} bytes, over max_blob_bytes {s.max_blob_bytes}")
                continue
            if b.size <= 0:
                continue     # registered, nothing flushed yet
            if self._rejected.get(b.name) == key:
                rejected[b.name] = key    # refused before and unchanged: not fetched, not decoded again
                continue
            at = departed.get(b.name)
            w = 1.0 if at is None else departed_weight(view.now_ms - at, s.departed_half_life_s)
            if w <= 0:
                continue     # weighs nothing any more (pruned below)
            asked[b.name] = key
            peers.append((b.name, b.gen, b.seq, self.keys.blob(b.name) if at is None else self.keys.departed(b.name),
                          b.size, w))
        if self._stop.is_set():
            return       # closing: no helper is started again (close() stopped it)
        reader = self._reader
        if reader is None:
            from .peer_reader import PeerReader
            hello = {"settings": {**dataclasses.asdict(self.settings), "sentinels": list(self.settings.sentinels)},
                     "deployment": self.keys.deployment, "model": self.keys.model}
            # A round's deadline: the helper's every Redis call is bounded by timeout_s, its
            # decoding by max_blob_bytes; one that takes longer than this is stuck, and killed.
            reader = self._reader = PeerReader(hello, deadline_s=30.0 + 4 * s.timeout_s * (s.retries + 1))
        t0 = time.perf_counter()
        local = {shared: name for name, shared in self._names.items()}   # shared name -> this replica's
        starts = reader.starts
        try:
            verdicts, parts = reader.exchange({"epoch": self._epoch, "half_life": self.half_life, "names": local,
                                               "peers": peers}, self._pacer)
        finally:
            self.stats["reader_starts"] += reader.starts - starts
        self._fetch_s += time.perf_counter() - t0
        for name, why in dict(verdicts.get("refused") or {}).items():
            refused = asked.get(str(name))
            if refused is not None:
                rejected[str(name)] = refused
                self._reject(str(name), refused[0], refused[1], str(why))
        self._rejected = rejected
        self._peers = {str(n): _Peer(asked[str(n)], {}) for n in verdicts.get("accepted") or () if str(n) in asked}
        self._fold_and_prune(view, store)
        t0 = time.perf_counter()
        total = self._shadow.decayed_rows()
        if parts:
            try:
                with _collector_deferred():
                    summed = TransitionSnapshot.decode(parts, self._pacer)
            except StateDecodeError as exc:
                raise ExternalError(f"the helper process's sum of peers' counts was refused: {exc}") from None
            del parts
            _renamed(summed.decayed_rows(), {}, into=total, tick=self._pacer)   # (already renamed: added)
        self._publish(total, view, t0)

    def _fold_and_prune(self, view: StoreView, store: StateStore) -> None:
        s = self.settings
        # Fold in replicas that stopped flushing; drop departed counts that no longer weigh anything.
        fold_ms = s.fold_after_s * 1000
        for b in view.replicas:
            if view.now_ms - b.at_ms > fold_ms:
                if store.fold(b.name, b.gen, b.seq) == "folded":
                    self.stats["folds"] += 1
                    log.info("CacheScout shared state: replica %r silent for %.0f s, folded into departed",
                             b.name, (view.now_ms - b.at_ms) / 1000)
        half_ms = s.departed_half_life_s * 1000
        pruned = store.prune_departed(int(view.now_ms - half_ms * math.log2(1 / _DEPARTED_FLOOR)),
                                      view.now_ms + 86_400_000)
        self.stats["departed_pruned"] += pruned

    def _publish(self, total: Rows, view: StoreView, t0: float) -> None:
        """Build one learner from everyone's summed counts and hand it to the scheduler thread."""
        merged = TransitionLearner(self.half_life, self.confidence_count_scale)
        for chunk in _chunks(total, 256):
            merged.absorb(chunk)
            self._pacer()
        self.peer_count = len(view.replicas)
        self.departed_count = len(view.departed)
        self.timings["build_s"] = time.perf_counter() - t0
        self._published = (merged, self._applied)
        self.stats["merges"] += 1

    def _reject(self, name: str, gen: int, seq: int, why: str) -> None:
        """Count a refused entry; log it the first time, then at most every 10 minutes per entry
        (an entry rewritten each round must not flood the log)."""
        tag = (name, gen, seq)
        if tag in self._bad_seen:
            return
        if len(self._bad_seen) > 10_000:
            self._bad_seen.clear()
        self._bad_seen.add(tag)
        self.stats["rejected_blobs"] += 1
        now = self.clock()
        last = self._reject_logged.get(name)
        if last is not None and now - last < _REJECT_LOG_INTERVAL_S:
            return
        if len(self._reject_logged) > 1_000:
            self._reject_logged.clear()
        self._reject_logged[name] = now
        log.warning("CacheScout shared state: ignored the entry of %r (gen %d, seq %d): %s%s", name[:200], gen, seq,
                    why[:200], "" if last is None else " (refused again since; counted in rejected_blobs)")

    # -- for metrics and `cachescout state` -------------------------------------------------------
    @property
    def degraded(self) -> bool:
        """Redis unreachable, or sharing stopped (misconfiguration, supersession)."""
        return self.problem is not None or self._failing_since is not None

    def status(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "replica": self.replica, "target": self.settings.target(), "key_prefix": self.keys.prefix,
            "degraded": int(self.degraded),
            "problem": self.problem, "breaker_open": int(self.breaker.is_open),
            "last_ok_age_s": None if self.last_ok is None else round(now - self.last_ok, 3),
            "peers": self.peer_count, "departed": self.departed_count, "generation": self._gen,
            "flush_seq": self._flush_seq, **{k: int(v) for k, v in sorted(self.stats.items())},
        }


Rows = dict[str, dict[str, float]]


def _chunks(rows: Rows, n: int) -> list[Rows]:
    items = list(rows.items())
    return [dict(items[i:i + n]) for i in range(0, len(items), n)]


@contextlib.contextmanager
def _collector_deferred() -> Iterator[None]:
    """Python's cyclic garbage collector off while a peer's blob is decoded, as it was before.

    Decoding allocates many small containers; a collection they trigger runs in this thread and
    stops every other one (vLLM's scheduler) for as long as it takes, which is the longest stall
    left once the pacer yields. Deferred, it runs at the next allocation after the decode, from
    the objects still alive then (a refused blob's are gone). The switch is process-wide: code
    that turns the collector off meanwhile would find it on again afterwards. vLLM turns it off
    only while capturing CUDA graphs, which is done before the scheduler, and so this thread, starts;
    a collector already off is left off."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Pacer:
    """Hands the interpreter lock back during the background thread's long loops.

    vLLM's scheduler runs in another thread of the same interpreter. A thread that computes holds
    the lock until it is asked for it, which Python does only after its switch interval (5 ms), and
    compiled or C code (the policy's mypyc-built learner, msgpack) never notices the request. So
    every loop here that can run long calls the pacer, which sleeps briefly once `slice_s` of work
    has passed: a waiting scheduler thread then gets the lock within about `slice_s`."""

    __slots__ = ("slice_s", "pause_s", "_since")

    def __init__(self, slice_s: float = 0.001, pause_s: float = 0.0001) -> None:
        self.slice_s = slice_s
        self.pause_s = pause_s
        self._since = time.perf_counter()

    def __call__(self) -> None:
        if time.perf_counter() - self._since >= self.slice_s:
            time.sleep(self.pause_s)
            self._since = time.perf_counter()


def _renamed(rows: Mapping[str, Mapping[str, float]], names: Mapping[str, str], weight: float = 1.0,
             drop_unknown: bool = False, into: Rows | None = None, tick: Callable[[], None] | None = None) -> Rows:
    """Rows with agents renamed through `names` (absent: unchanged; two names onto one: summed).

    `drop_unknown`: leave out agents under a shared name this replica cannot map to one of its own
    yet (it has not seen that agent's anchor): no call here will ever carry that name, so its
    counts would only pull predictions towards an agent that is never observed. `into`: add to
    these rows instead of new ones. `tick`: called once per row (see _Pacer)."""
    out: Rows = {} if into is None else into
    for src, dsts in rows.items():
        if tick is not None:
            tick()
        s = names.get(src, src)
        if drop_unknown and s.startswith(SHARED_NAME_PREFIX) and src not in names:
            continue
        row = out.setdefault(s, {})
        for dst, c in dsts.items():
            d = names.get(dst, dst)
            if drop_unknown and d.startswith(SHARED_NAME_PREFIX) and dst not in names:
                continue
            row[d] = row.get(d, 0.0) + c * weight
    return out

