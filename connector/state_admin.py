"""Operator views of a deployment's shared state: `cachescout state show | export | reset`.

Reads exactly what replicas read (state_store.py) and merges it the same way, so what `show`
prints is what every replica predicts from (plus each one's last few seconds of own traffic).
"""

from __future__ import annotations

from typing import Any

from cachescout.policy import StateDecodeError, TransitionLearner, TransitionSnapshot

from .shared_state import SharedStateSettings, connect, departed_weight
from .state_store import StateKeys, StateStore


def open_store(settings: SharedStateSettings, model: str) -> StateStore:
    keys = StateKeys(settings.deployment, settings.model or model)
    return StateStore(connect(settings), keys, max_blob_bytes=settings.max_blob_bytes,
                      max_replicas=settings.max_replicas)


def collect(store: StateStore, departed_half_life_s: float) -> dict[str, Any]:
    """Everything stored, decoded, and the merged matrix, as plain data (what `export` writes)."""
    view = store.read()
    entries, rejected = [], []
    merged: TransitionLearner | None = None
    half_life = None
    for kind, blobs in (("replica", view.replicas), ("departed", view.departed)):
        for b in blobs:
            row: dict[str, Any] = {"kind": kind, "name": b.name, "generation": b.gen, "seq": b.seq,
                                   "flushed_ms_ago": max(0, view.now_ms - b.at_ms), "bytes": b.size}
            # The weight every replica gives these counts (departed ones fade, then drop out).
            weight = 1.0 if kind == "replica" else departed_weight(row["flushed_ms_ago"], departed_half_life_s)
            row["weight"] = round(weight, 4)
            if b.blob is None:
                rejected.append({**row, "why": f"over max_blob_bytes ({store.max_blob_bytes})"})
                continue
            rows: dict[str, dict[str, float]] = {}
            if b.blob:
                try:
                    snap = TransitionSnapshot.decode(b.blob)
                except StateDecodeError as exc:
                    rejected.append({**row, "why": str(exc)})
                    continue
                rows = snap.decayed_rows()
                if merged is None:
                    half_life = snap.half_life
                    merged = TransitionLearner(snap.half_life)
                if snap.half_life != half_life:
                    rejected.append({**row, "why": f"half_life {snap.half_life} != {half_life}"})
                    continue
                if weight > 0:
                    merged.absorb({s: {d: c * weight for d, c in r.items()} for s, r in rows.items()})
            row["transitions"] = round(sum(sum(r.values()) for r in rows.values()), 3)
            row["agents"] = len(set(rows) | {d for r in rows.values() for d in r})
            row["rows"] = rows
            entries.append(row)
    rejected += [{"kind": "entry", "name": n, "why": "bookkeeping fields are not integers"} for n in view.malformed]
    rejected += [{"kind": "key", "name": key, "why": f"holds a Redis {t}, not CacheScout's state (replicas delete it)"}
                 for key, t in view.wrong_type.items()]
    matrix = {} if merged is None else {
        src: {dst: {"p": round(merged.probability(src, dst), 4), "count": round(c, 3)}
              for dst, c in sorted(dsts.items(), key=lambda kv: -kv[1])}
        for src, dsts in sorted(merged.decayed_rows().items())}
    return {"key_prefix": store.keys.prefix, "meta": view.meta, "server_time_ms": view.now_ms,
            "entries": entries, "rejected": rejected, "wrong_type": dict(view.wrong_type), "merged": matrix}


def render(data: dict[str, Any], top: int = 4) -> str:
    """The readable table of `show`."""
    meta = data["meta"]
    out = [f"shared state {data['key_prefix']}  schema {meta.get('schema', '-')}  half_life "
           f"{meta.get('half_life', '-')}  hash_domain {meta.get('hash_domain', '-')}  epoch {meta.get('epoch', '-')}"]
    if not meta:
        out.append("(no state: no replica has written here yet, or it was reset)")
    out.append("")
    out.append(f"{'contributor':<36} {'kind':<9} {'gen':>4} {'seq':>7} {'flushed':>10} {'weight':>6} "
               f"{'transitions':>12} {'agents':>6} {'bytes':>8}")
    for e in data["entries"]:
        out.append(f"{e['name'][:36]:<36} {e['kind']:<9} {e['generation']:>4} {e['seq']:>7} "
                   f"{_age(e['flushed_ms_ago']):>10} {e['weight']:>6.3f} {e['transitions']:>12,.1f} "
                   f"{e['agents']:>6} {e['bytes']:>8,}")
    for r in data["rejected"]:
        out.append(f"{r['name'][-36:]:<36} REJECTED  {r['why'][:80]}")
    out.append("")
    out.append(f"merged transitions (the {top} likeliest per agent: probability, decayed count)")
    width = max([len(s) for s in data["merged"]] + [5])
    for src, dsts in data["merged"].items():
        cells = [f"{dst} {v['p']:.2f} ({v['count']:,.1f})" for dst, v in list(dsts.items())[:top]]
        more = len(dsts) - top
        out.append(f"  {src:<{width}} -> " + ", ".join(cells) + (f", ... {more} more" if more > 0 else ""))
    return "\n".join(out)


def _age(ms: float) -> str:
    s = ms / 1000
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h" if s < 172800 else f"{s / 86400:.0f} d"


def reset(store: StateStore) -> int:
    import secrets
    return store.reset(secrets.token_hex(8))
