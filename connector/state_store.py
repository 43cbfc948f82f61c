"""Where replicas keep their learned transitions in Redis: the key schema and every operation on it.

All keys of one deployment and model share one hash tag, so they live in one Redis Cluster slot and
every multi-key step runs as one Lua script, atomically, on a single Redis, behind Sentinel or on a
Cluster alike:

    cs:{<deployment>|<model>}:v3:meta            hash: schema, half_life, hash_domain, epoch
    cs:{...}:v3:replicas                          zset: replica -> server time (ms) of its last flush
    cs:{...}:v3:rep:<replica>                     hash: gen, seq, at
    cs:{...}:v3:blob:<replica>                    string: its counts (msgpack TransitionSnapshot)
    cs:{...}:v3:gen:<replica>                     int: generation of the replica's current life
    cs:{...}:v3:departed_at                       zset: <replica>#<gen> -> when that life last flushed
    cs:{...}:v3:dep:<replica>#<gen>               string: the counts of a life folded in (gone away)

Why this shape:
- Each replica writes only its own absolute (decayed) counts, so a retried flush rewrites the same
  value, and readers sum the blobs: nothing is ever incremented twice.
- A flush carries (epoch, gen, seq); the script refuses it when the deployment was reset (epoch),
  when a newer life of the replica exists (gen: an old copy cannot overwrite a newer one), or when
  the same or a later flush already landed (seq: a duplicate is a no-op).
- A replica's previous life (restart under the same name) and a replica silent for too long are
  moved, blob unchanged, into `departed` in one script that also bumps the generation, so its
  counts are neither lost nor counted twice if it comes back. Departed blobs weigh less with age
  and are dropped once negligible.
- The server's clock (TIME) stamps every flush, so replicas' clocks never matter.
- Blobs are strings of their own, so a reader fetches a large one in parts with GETRANGE (each
  part costs Redis only its own bytes) and a fold is a RENAME (no copy).
- `v3` is the schema version: a future format gets new keys and never misreads these.

Nothing here catches Redis errors: the caller (shared_state.py) owns retries and the breaker.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from cachescout.policy import ConfigError

# v3: blobs in string keys of their own; v2 kept them in hash fields (read in parts, each part
# cost Redis the whole blob); v1 had no checksum. Older keys are never read.
SCHEMA = "v3"
_NAME = re.compile(r"^[A-Za-z0-9._:/@=+-]{1,128}$")
NAME_RULE = "1-128 characters from letters, digits and . _ : / @ = + -"

# KEYS: meta. ARGV: schema, half_life, hash_domain, epoch to create with.
# -> {'created', epoch} | {'ok', epoch} | {'mismatch', field, theirs}
_ENSURE_META = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'schema', ARGV[1], 'half_life', ARGV[2], 'hash_domain', ARGV[3], 'epoch', ARGV[4])
  return {'created', ARGV[4]}
end
local m = redis.call('HMGET', KEYS[1], 'schema', 'half_life', 'hash_domain', 'epoch')
local names = {'schema', 'half_life', 'hash_domain'}
for i = 1, 3 do
  if m[i] ~= ARGV[i] then return {'mismatch', names[i], string.sub(tostring(m[i]), 1, 200)} end
end
return {'ok', m[4]}
"""

# Moves a replica's blob (if any) to the departed blob `dep_prefix`<name>#<gen> and stamps it in
# the departed_at zset; deletes its rep hash. Shared by register and fold. The departed key's name
# depends on the generation stored, so it is built here: it carries the deployment's hash tag, so
# it lives in the same Redis Cluster slot as the declared keys.
_FOLD_BODY = """
local function fold(rep, blob, dep_at, dep_prefix, name)
  local old = redis.call('HMGET', rep, 'gen', 'at')
  if old[1] and redis.call('EXISTS', blob) == 1 then
    local field = name .. '#' .. tostring(old[1])
    redis.call('RENAME', blob, dep_prefix .. field)
    redis.call('PERSIST', dep_prefix .. field)   -- departed blobs age out by their stamp, not a TTL
    redis.call('ZADD', dep_at, tonumber(old[2]) or 0, field)
  end
  redis.call('DEL', rep, blob)
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: meta, gen, rep, replicas, blob, departed_at. ARGV: name, epoch, ttl_ms, departed prefix.
# A new life of replica `name`: its previous life's blob goes to departed. -> {'ok', gen} | {'epoch', e}
_REGISTER = _FOLD_BODY + """
local e = redis.call('HGET', KEYS[1], 'epoch')
if e ~= ARGV[2] then return {'epoch', tostring(e)} end
local g = redis.call('INCR', KEYS[2])
fold(KEYS[3], KEYS[5], KEYS[6], ARGV[4], ARGV[1])
local now = now_ms()
redis.call('HSET', KEYS[3], 'gen', g, 'seq', 0, 'at', now)
redis.call('PEXPIRE', KEYS[3], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[4], now, ARGV[1])
return {'ok', g}
"""

# KEYS: meta, gen, rep, replicas, blob. ARGV: name, epoch, gen, seq, blob, ttl_ms.
# -> {'ok', at} | {'dup', seq} | {'stale', gen} | {'epoch', e} (e is 'false' when meta is gone)
_FLUSH = _FOLD_BODY + """
local e = redis.call('HGET', KEYS[1], 'epoch')
if e ~= ARGV[2] then return {'epoch', tostring(e)} end
local g = tonumber(ARGV[3])
local cur = tonumber(redis.call('GET', KEYS[2]) or '0')
if cur > g then return {'stale', cur} end
local h = redis.call('HMGET', KEYS[3], 'gen', 'seq')
if h[1] then
  if tonumber(h[1]) > g then return {'stale', tonumber(h[1])} end
  if tonumber(h[1]) == g and tonumber(h[2]) >= tonumber(ARGV[4]) then return {'dup', tonumber(h[2])} end
end
-- Here the rep hash is this life's, or it is gone (expired, or Redis lost its data without
-- persistence) and this replica writes its absolute counts back.
redis.call('SET', KEYS[2], g)
local now = now_ms()
redis.call('HSET', KEYS[3], 'gen', g, 'seq', ARGV[4], 'at', now)
redis.call('SET', KEYS[5], ARGV[5], 'PX', ARGV[6])
redis.call('PEXPIRE', KEYS[3], ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[6])
redis.call('ZADD', KEYS[4], now, ARGV[1])
return {'ok', now}
"""

# KEYS: gen, rep, replicas, blob, departed_at. ARGV: name, gen, seq seen by the caller, departed prefix.
# Folds a silent replica only if it has not flushed since the caller looked. -> 'folded' | 'changed' | 'gone'
_FOLD = _FOLD_BODY + """
local h = redis.call('HMGET', KEYS[2], 'gen', 'seq')
if not h[1] then redis.call('ZREM', KEYS[3], ARGV[1]); return 'gone' end
if h[1] ~= ARGV[2] or h[2] ~= ARGV[3] then return 'changed' end
fold(KEYS[2], KEYS[4], KEYS[5], ARGV[4], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('INCR', KEYS[1])
return 'folded'
"""

# KEYS: meta, replicas, departed_at. ARGV: how many entries at most.
# -> {server time ms, meta as flat list, replicas with scores, departed with scores, wrong-typed keys}
# A key holding another Redis type (written by someone else) reads as empty and is named.
_HEAD = """
local t = redis.call('TIME')
local n = tonumber(ARGV[1]) - 1
local wrong = {}
local function typed(key, want)
  local got = redis.call('TYPE', key)['ok']
  if got == want or got == 'none' then return true end
  table.insert(wrong, key)
  table.insert(wrong, got)
  return false
end
local meta, reps, deps = {}, {}, {}
if typed(KEYS[1], 'hash') then
  -- only the fields CacheScout writes, each cut short (a huge value must not travel every round)
  local names = {'schema', 'half_life', 'hash_domain', 'epoch'}
  local got = redis.call('HMGET', KEYS[1], unpack(names))
  for i, v in ipairs(names) do
    if got[i] then table.insert(meta, v); table.insert(meta, string.sub(got[i], 1, 256)) end
  end
end
if typed(KEYS[2], 'zset') then reps = redis.call('ZRANGE', KEYS[2], 0, n, 'WITHSCORES') end
if typed(KEYS[3], 'zset') then deps = redis.call('ZRANGE', KEYS[3], 0, n, 'WITHSCORES') end
return {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), meta, reps, deps, wrong}
"""

# KEYS: (key, type it must have) pairs flattened as KEYS only. ARGV: the types, in the same order.
# Deletes each key that holds another Redis type: nothing CacheScout wrote is in it (every key of
# the deployment's prefix is CacheScout's), and until it is gone every round fails on it.
# -> flat list of {key, type it had} deleted
_REPAIR = """
local out = {}
for i, key in ipairs(KEYS) do
  local got = redis.call('TYPE', key)['ok']
  if got ~= 'none' and got ~= ARGV[i] then
    redis.call('DEL', key)
    table.insert(out, key)
    table.insert(out, got)
  end
end
return out
"""

# KEYS: departed_at. ARGV: cutoff (ms), latest plausible stamp (ms), departed prefix. Drops departed
# blobs stamped before the cutoff, and any stamped after the latest (the stamps are the server's
# clock: a later one, +inf included, was written by someone else and would never age out).
_PRUNE = """
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])
for _, f in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[2], '+inf')) do table.insert(old, f) end
for _, f in ipairs(old) do
  redis.call('DEL', ARGV[3] .. f)
  redis.call('ZREM', KEYS[1], f)
end
return #old
"""


# Blobs are fetched in parts of at most this size: parsing one large reply holds the interpreter
# lock for milliseconds (about 15 ms for 4 MiB), long enough to stall vLLM's scheduler.
FETCH_CHUNK_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class StoredBlob:
    """One stored snapshot as read: `blob` holds its bytes in the parts they were fetched in
    (never joined: see read), () when nothing was flushed yet or the caller has it, and is None
    when it was too large to fetch."""

    name: str      # replica name, or "<replica>#<gen>" for a departed one
    gen: int
    seq: int
    at_ms: int     # server time of the flush
    size: int
    blob: tuple[bytes, ...] | None


@dataclasses.dataclass(slots=True)
class StoreView:
    now_ms: int
    meta: dict[str, str]
    replicas: list[StoredBlob]
    departed: list[StoredBlob]
    malformed: list[str]   # entries whose bookkeeping fields or stamps are not integers (written by someone else)
    wrong_type: dict[str, str] = dataclasses.field(default_factory=dict)   # key -> the Redis type it holds
    # read(fetch=False): the blobs wanted but not fetched (their `blob` is ()), name -> (key, size)
    pending: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)


class StateKeys:
    def __init__(self, deployment: str, model: str) -> None:
        for field, v in (("deployment", deployment), ("model", model)):
            if not isinstance(v, str) or not _NAME.match(v):
                raise ConfigError(f"shared_state.{field} must be {NAME_RULE}, got {v!r}")
        self.deployment, self.model = deployment, model
        self.prefix = f"cs:{{{deployment}|{model}}}:{SCHEMA}:"
        self.meta = self.prefix + "meta"
        self.replicas = self.prefix + "replicas"
        self.departed_at = self.prefix + "departed_at"
        self.departed_prefix = self.prefix + "dep:"

    @staticmethod
    def valid_name(name: str) -> bool:
        return isinstance(name, str) and bool(_NAME.match(name))

    def rep(self, name: str) -> str:
        return f"{self.prefix}rep:{name}"

    def gen(self, name: str) -> str:
        return f"{self.prefix}gen:{name}"

    def blob(self, name: str) -> str:
        return f"{self.prefix}blob:{name}"

    def departed(self, field: str) -> str:
        """The blob of a departed life, `field` being `<replica>#<gen>`."""
        return self.departed_prefix + field


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _score(v: Any) -> int | None:
    """A sorted-set score as integer milliseconds; None when it is not finite."""
    try:
        f = float(_text(v))
    except (TypeError, ValueError):
        return None
    return int(f) if math.isfinite(f) else None


def _int(v: Any) -> int | None:
    try:
        return int(_text(v))
    except (TypeError, ValueError):
        return None


class StateStore:
    """The operations on one deployment's keys, over a redis-py client (plain, Sentinel or Cluster)."""

    def __init__(self, client: Any, keys: StateKeys, *, max_blob_bytes: int, max_replicas: int = 256) -> None:
        self.r = client
        self.keys = keys
        self.max_blob_bytes = max_blob_bytes
        self.max_replicas = max_replicas
        self._ensure_meta = client.register_script(_ENSURE_META)
        self._register = client.register_script(_REGISTER)
        self._flush = client.register_script(_FLUSH)
        self._fold = client.register_script(_FOLD)
        self._prune = client.register_script(_PRUNE)
        self._head = client.register_script(_HEAD)
        self._repair = client.register_script(_REPAIR)

    # -- one replica's own writes -------------------------------------------------------------------
    def ensure_meta(self, half_life: float, hash_domain: str, epoch: str) -> tuple[str, str, str]:
        """(status, a, b): ('created'|'ok', epoch, '') or ('mismatch', field, their value)."""
        out = self._ensure_meta(keys=[self.keys.meta], args=[SCHEMA, repr(float(half_life)), hash_domain, epoch])
        out = [_text(x) for x in out]
        return out[0], out[1], out[2] if len(out) > 2 else ""

    def register(self, name: str, epoch: str, ttl_ms: int) -> tuple[str, Any]:
        k = self.keys
        out = self._register(keys=[k.meta, k.gen(name), k.rep(name), k.replicas, k.blob(name), k.departed_at],
                             args=[name, epoch, ttl_ms, k.departed_prefix])
        return _text(out[0]), (_int(out[1]) if _text(out[0]) == "ok" else _text(out[1]))

    def flush(self, name: str, epoch: str, gen: int, seq: int, blob: bytes, ttl_ms: int) -> tuple[str, Any]:
        k = self.keys
        out = self._flush(keys=[k.meta, k.gen(name), k.rep(name), k.replicas, k.blob(name)],
                          args=[name, epoch, gen, seq, blob, ttl_ms])
        status = _text(out[0])
        return status, (_text(out[1]) if status == "epoch" else _int(out[1]))

    def current_gen(self, name: str) -> int | None:
        """Generation of the replica's stored blob, None when there is none."""
        return _int(self.r.hget(self.keys.rep(name), "gen"))

    # -- everyone's state ---------------------------------------------------------------------
    def read(self, *, skip: str | None = None, known: dict[str, tuple[int, int]] | None = None,
             tick: Callable[[], object] | None = None, fetch: bool = True) -> StoreView:
        """Everything stored: two round trips, then one per FETCH_CHUNK_BYTES of blobs. Blobs over the
        size limit are not fetched; blobs whose (gen, seq) is in `known` are not fetched again (their
        `blob` is ()). `tick` is called after each round trip of blob parts (a background caller
        yields the interpreter lock there). `fetch=False`: the blobs wanted are left in `pending`,
        for the caller to `fetch` a few at a time (so that it never holds every peer's bytes)."""
        k = self.keys
        # One script, so the server's clock and the lists come from the same node and moment.
        now_ms, flat_meta, flat_reps, flat_deps, flat_wrong = self._head(
            keys=[k.meta, k.replicas, k.departed_at], args=[self.max_replicas])
        meta = dict(zip(flat_meta[::2], flat_meta[1::2], strict=True))
        wrong = {_text(a): _text(b) for a, b in zip(flat_wrong[::2], flat_wrong[1::2], strict=True)}
        reps = list(zip(flat_reps[::2], flat_reps[1::2], strict=True))
        deps = list(zip(flat_deps[::2], map(_score, flat_deps[1::2]), strict=True))
        names = [_text(n) for n, _ in reps if _text(n) != skip]
        fields = [_text(f) for f, _ in deps]
        p = self.r.pipeline(transaction=False)
        for n in names:
            p.hmget(k.rep(n), "gen", "seq", "at")
            p.strlen(k.blob(n))
        for f in fields:
            p.strlen(k.departed(f))
        # A key of the wrong type (written by someone else) answers with an error, not an exception.
        got = p.execute(raise_on_error=False)
        malformed: list[str] = []
        replicas: list[StoredBlob] = []
        want: list[tuple[str, str, int]] = []   # (name, key, size) to fetch
        for i, n in enumerate(names):
            fields, size = got[2 * i], got[2 * i + 1]
            if isinstance(fields, Exception) or isinstance(size, Exception):
                malformed.append(n)
                continue
            (g, s, a), size = fields, int(size)
            if g is None:
                continue   # left between the two reads, or never registered (a name someone else added)
            gen, seq, at = _int(g), _int(s), _int(a)
            if gen is None or seq is None or at is None:
                malformed.append(n)
                continue
            replicas.append(StoredBlob(n, gen, seq, at, size, None))
            if 0 < size <= self.max_blob_bytes and (known or {}).get(n) != (gen, seq):
                want.append((n, k.blob(n), size))
        departed: list[StoredBlob] = []
        for (f, at), size in zip(deps, got[2 * len(names):], strict=True):
            f = _text(f)
            name, _, g = f.rpartition("#")
            gen = _int(g)
            if not name or gen is None or at is None or isinstance(size, Exception):
                malformed.append(f)
                continue
            departed.append(StoredBlob(f, gen, 0, int(at), int(size), None))
            if 0 < int(size) <= self.max_blob_bytes and (known or {}).get(f) != (gen, 0):
                want.append((f, k.departed(f), int(size)))
        blobs = self.fetch(want, tick) if fetch else {}
        def filled(x: StoredBlob) -> StoredBlob:
            return dataclasses.replace(x, blob=blobs.get(x.name, () if x.size <= self.max_blob_bytes else None))

        return StoreView(int(now_ms), {_text(a): _text(b) for a, b in meta.items()},
                         [filled(x) for x in replicas], [filled(x) for x in departed], malformed, wrong,
                         {} if fetch else {name: (key, size) for name, key, size in want})

    def fetch(self, want: Sequence[tuple[str, str, int]],
              tick: Callable[[], object] | None = None) -> dict[str, tuple[bytes, ...]]:
        """The blobs `want` names, (name, key, size), each as the parts it was fetched in; one whose
        key no longer holds a string is left out. Round trips carry at most FETCH_CHUNK_BYTES of
        replies (a blob over that in parts, with GETRANGE; small ones several to a trip), `tick`
        between them, and the parts are never joined: parsing replies and copying megabytes into
        fresh memory hold the interpreter lock, so neither happens in one step for more than a part.
        A blob rewritten meanwhile comes out torn, and its checksum refuses it."""
        parts = [(name, blob_key, first, min(FETCH_CHUNK_BYTES, size - first))
                 for name, blob_key, size in want for first in range(0, size, FETCH_CHUNK_BYTES)]
        got_parts: dict[str, list[Any]] = {}
        while parts:
            trip, batch = 0, 0
            while batch < len(parts) and (batch == 0 or trip + parts[batch][3] <= FETCH_CHUNK_BYTES):
                trip += parts[batch][3]
                batch += 1
            p = self.r.pipeline(transaction=False)
            for _, part_key, first, length in parts[:batch]:
                p.getrange(part_key, first, first + length - 1)
            for (name, *_), reply in zip(parts[:batch], p.execute(raise_on_error=False), strict=True):
                got_parts.setdefault(name, []).append(reply)
            del parts[:batch]
            if tick is not None:
                tick()
        return {name: tuple(got) for name, got in got_parts.items() if all(isinstance(x, bytes) for x in got)}

    def fold(self, name: str, gen: int, seq: int) -> str:
        k = self.keys
        return _text(self._fold(keys=[k.gen(name), k.rep(name), k.replicas, k.blob(name), k.departed_at],
                                args=[name, gen, seq, k.departed_prefix]))

    def prune_departed(self, cutoff_ms: int, latest_ms: int = 2**53) -> int:
        return int(self._prune(keys=[self.keys.departed_at], args=[cutoff_ms, latest_ms, self.keys.departed_prefix]))

    def repair(self, replica: str | None = None, gens: Sequence[str] = ()) -> dict[str, str]:
        """Delete the deployment's keys (and `replica`'s own, and the generation keys `gens`) that
        hold the wrong Redis type. Returns key -> the type it held."""
        k = self.keys
        want = [(k.meta, "hash"), (k.replicas, "zset"), (k.departed_at, "zset")]
        if replica is not None:
            want += [(k.rep(replica), "hash"), (k.gen(replica), "string"), (k.blob(replica), "string")]
        want += [(key, "string") for key in gens]
        out = self._repair(keys=[key for key, _ in want], args=[t for _, t in want])
        return {_text(a): _text(b) for a, b in zip(out[::2], out[1::2], strict=True)}

    # -- operator actions ---------------------------------------------------------------------
    def reset(self, new_epoch: str) -> int:
        """Forget the deployment's learned state. Replicas see the new epoch at their next flush and
        start their counts over (a stale flush is refused by the epoch check). Returns keys deleted."""
        k = self.keys
        every = [_text(key) for key in self.r.scan_iter(match=_glob_escape(k.prefix) + "*", count=500)]
        # Generations stay (they fence old copies of replicas), unless someone wrote another type there.
        gens = {key for key in every if key.startswith(k.prefix + "gen:")}
        n = len(self.repair(gens=sorted(gens)))
        doomed = [key for key in every if key != k.meta and key not in gens]
        for i in range(0, len(doomed), 500):
            n += int(self.r.delete(*doomed[i:i + 500]))
        if self.r.exists(k.meta):
            self.r.hset(k.meta, "epoch", new_epoch)
        return n


def _glob_escape(s: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", s)
