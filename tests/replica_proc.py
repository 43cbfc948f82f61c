"""A replica process for the multi-process shared-state tests (run with python, not collected).

    python replica_proc.py converge URL NAME PART PARTS HALF_LIFE OUT
    python replica_proc.py flush-forever URL NAME
"""

from __future__ import annotations

import json
import random
import sys
import time

import redis

from cachescout.connector.shared_state import SharedLearnedState, SharedStateSettings
from cachescout.policy import CacheScoutPolicy, PolicyConfig

AGENTS = ["supervisor", "coder", "searcher", "math", "critic", "summarizer"]


def sessions(n: int = 240, seed: int = 7) -> list[list[tuple[str, str]]]:
    """Transitions of `n` sessions routed by a fixed stochastic policy (the same in every process)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        path, cur = [], "<start>"
        for _ in range(rng.randint(3, 9)):
            nxt = "supervisor" if cur != "supervisor" else rng.choices(AGENTS[1:], weights=[5, 3, 2, 2, 1])[0]
            path.append((cur, nxt))
            cur = nxt
        path.append((cur, "<end>"))
        out.append(path)
    return out


def replica(url: str, name: str, half_life: float, **extra):
    settings = SharedStateSettings.from_mapping({"url": url, "replica": name, "deployment": "mp", **extra})
    policy = CacheScoutPolicy(PolicyConfig(transition_half_life=half_life))
    shared = SharedLearnedState(settings, half_life=half_life, model="m", hash_domain="d")
    shared.attach(policy)
    return policy, shared


def converge(url: str, name: str, part: int, parts: int, half_life: float, out: str) -> None:
    policy, shared = replica(url, name, half_life)
    for i, path in enumerate(sessions()):
        if i % parts == part:
            for src, dst in path:
                policy.learn_transition(src, dst)
            if i % 17 == 0:
                shared.sync_now()
                shared.on_step(policy)
    assert shared.sync_now()
    r = redis.Redis.from_url(url)
    r.sadd("mp:done", name)
    deadline = time.monotonic() + 30
    while r.scard("mp:done") < parts:
        assert time.monotonic() < deadline, "peers did not finish"
        time.sleep(0.02)
    for _ in range(2):
        assert shared.sync_now()
        shared.on_step(policy)
    with open(out, "w") as f:
        json.dump([[s, d, c] for s, d, c in policy.transitions()], f)


def flush_forever(url: str, name: str) -> None:
    policy, shared = replica(url, name, 1e9)
    print("ready", flush=True)
    while True:
        policy.learn_transition("x", "y")   # one transition per flush: a blob's count equals its seq
        shared.sync_now(read=False)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "converge":
        converge(args[0], args[1], int(args[2]), int(args[3]), float(args[4]), args[5])
    elif cmd == "flush-forever":
        flush_forever(args[0], args[1])
    else:
        raise SystemExit(f"unknown command {cmd!r}")
