"""Benchmarks of the shared learned state (issue 5), on a real redis-server.

    python -m cachescout.bench.state_bench [--redis-url URL] [--json PATH]

1. cost: 8 replicas, each with 10 / 100 / 1,000 agents' transitions; per round, what each replica's
   background thread spends encoding and flushing its counts, reading the 7 others (first read and
   steady state, when only changed peers are fetched), decoding and building the merged model, and
   what the scheduler thread spends installing it (the only part on the serving path).
2. join: a replica joins a running fleet half-way through a workload; its GPU hit rate and
   next-agent accuracy on the same requests, started warm from the shared state or cold, against a
   replica that has run since the start (the fleet), on the fast replay engine.

3. hostile: N entries of 4 MiB each in Redis, in the shapes that expand most when decoded, rewritten
   between rounds so that every round must fetch and decode them again; a thread standing in for
   vLLM's scheduler (1 ms of GIL-free "forward pass", then a little Python) measures its step times
   while the replica's background thread runs its rounds. Twice where the machine has two CPUs or
   more and the benchmark starts its own redis-server: with Redis, the writer and the replica sharing
   every core ("shared"), and with the replica on one CPU and Redis and the writer on the others
   ("apart", as where Redis runs on a host of its own).

`--readers helper,in-process`: cost and hostile figures with peers read by the helper process (the
default, `isolated_reader`) and by the replica's own background thread.

Without --redis-url a private redis-server is started on a free loopback port (and stopped).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import multiprocessing
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack

from cachescout.connector.shared_state import SharedLearnedState, SharedStateSettings
from cachescout.connector.state_store import StateKeys
from cachescout.policy import CacheScoutPolicy, ExternalError, PolicyConfig
from cachescout.policy.transitions import END, START

from .policies import CacheScoutReplay
from .replay import Engine, EngineConfig
from .run import calibrate_gpu_blocks
from .workloads import WorkloadSpec, generate


@contextlib.contextmanager
def private_redis(cpus: set[int] | None = None) -> Iterator[str]:
    """A redis-server of its own on a free loopback port; on `cpus` when given."""
    if shutil.which("redis-server") is None:
        raise ExternalError("redis-server is not installed; give --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if cpus:
            os.sched_setaffinity(proc.pid, cpus)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise ExternalError("redis-server did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(5)


def _replica(url: str, deployment: str, name: str, half_life: float = 200.0,
             isolated: bool = True) -> tuple[CacheScoutPolicy, SharedLearnedState]:
    settings = SharedStateSettings.from_mapping({"url": url, "deployment": deployment, "replica": name,
                                                 "timeout_s": 2.0, "isolated_reader": isolated})
    policy = CacheScoutPolicy(PolicyConfig(transition_half_life=half_life))
    shared = SharedLearnedState(settings, half_life=half_life, model="bench", hash_domain="bench")
    shared.attach(policy)
    return policy, shared


# -- 3. hostile entries ------------------------------------------------------------------------------
def plant(r, keys: StateKeys, name: str, blob: bytes | None = None, **fields: object) -> None:
    """Write a replica's entry by hand, as another process (or an attacker with write access to
    the keys) could: the bookkeeping `fields` in its hash, `blob` under its own key. `r` is a
    redis-py client or pipeline."""
    if fields:
        r.hset(keys.rep(name), mapping=fields)
    if blob is not None:
        r.set(keys.blob(name), blob)


def hostile_blobs(size: int) -> dict[str, bytes]:
    """Blobs of about `size` bytes built to expand as much as possible when unpacked, each sealed
    with a valid checksum (whoever can write the keys can compute one)."""
    head = msgpack.packb({"kind": "cachescout.transitions", "schema": 2, "half_life": 200.0})
    head = b"\x84" + head[1:] + msgpack.packb("rows")
    per = 16_000   # items per array: under the decoder's limit, so only the shape check refuses them

    def sealed(body: bytes) -> bytes:
        return body + zlib.crc32(body).to_bytes(4, "big")

    def nest(item: bytes) -> bytes:   # rows: arrays of `per` copies of `item`, as many as fit
        chunk = b"\xdc" + per.to_bytes(2, "big") + item * per
        n = max(1, (size - len(head)) // len(chunk))
        return sealed(head + b"\xdc" + n.to_bytes(2, "big") + chunk * n)

    def unique_cells() -> bytes:       # valid-looking to the last cell: distinct names, one row each
        per_row = 16_000   # under the decoder's limit of transitions per agent
        cells = [b"\x92" + msgpack.packb(f"{i:x}") + b"\x01" for i in range(size // 8)]
        rows = b"".join(b"\x92" + msgpack.packb(f"r{j:x}") + b"\xdc" + per_row.to_bytes(2, "big")
                        + b"".join(cells[j * per_row:(j + 1) * per_row]) for j in range(len(cells) // per_row))
        return sealed(head + b"\xdc" + (len(cells) // per_row).to_bytes(2, "big") + rows)

    return {"empty arrays": nest(b"\x90"), "empty maps": nest(b"\x80"), "short strings": nest(b"\xa2ab"),
            "repeated cells": nest(b"\x92\xa1a\x01"), "one-cell rows": nest(b"\x92\xa1a\x91\x92\xa1b\x01"),
            "distinct cells": unique_cells(), "deep nesting": sealed(head + b"\x91" * 100_000)}


def hostile(url: str, entries: int = 8, size: int = 4 * 1024 * 1024, seconds: float = 4.0,
            pacer: bool = True, apart: bool = False, shapes: Sequence[str] | None = None,
            isolated: bool = True) -> list[dict]:
    """Per shape: the scheduler stand-in's step times (ms) while `entries` hostile entries are in
    Redis, rewritten (new seq) before every round by another process. Two baselines: no entries,
    and "decoys": the same writes, of the first shape, under keys this replica never reads (what
    the machine alone does to the stand-in while Redis and the writer are busy). `apart`: this
    process on one CPU and the writer on the others (the caller puts Redis there). `shapes`: only
    these (the baselines too, by name), each for `seconds`. `isolated`: peers read by the helper
    process (the default), else in the replica's own process."""
    blobs = hostile_blobs(size)
    runs = [("none", b"", 0, False), ("decoys", next(iter(blobs.values())), entries, True),
            *((shape, blob, entries, False) for shape, blob in blobs.items())]
    if shapes is not None:
        # "alone" only on request: the stand-in with no rounds at all, the machine's own noise floor
        runs = [("alone", b"", 0, False), *runs]
        runs = [run for run in runs if run[0] in shapes]
    mine = os.sched_getaffinity(0)
    own, others = _split_cpus() if apart else (mine, None)
    try:
        if apart:
            os.sched_setaffinity(0, own)
        with _Attacker(url, others) as attacker:
            return [{**_hostile_run(attacker, url, f"hostile-{i}", shape, blob, n, seconds, pacer, decoy, isolated),
                     "cores": "apart" if apart else "shared", "seconds": seconds,
                     "reader": "helper" if isolated else "in-process"}
                    for i, (shape, blob, n, decoy) in enumerate(runs)]
    finally:
        os.sched_setaffinity(0, mine)


def can_run_apart() -> bool:
    """Whether this machine can put the replica on a core of its own (Linux, two CPUs or more)."""
    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


def _split_cpus() -> tuple[set[int], set[int]]:
    """(the replica's CPU, everyone else's): the first this process may run on, and the rest."""
    allowed = sorted(os.sched_getaffinity(0))
    return {allowed[0]}, set(allowed[1:])


class _Attacker:
    """Another process with write access to the deployment's keys, as an attacker would be: its
    Python work and its writes are not the victim's (only the CPU it takes is shared)."""

    def __init__(self, url: str, cpus: set[int] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_attack, args=(url, child, cpus), daemon=True)
        self._proc.start()
        child.close()

    def __enter__(self) -> _Attacker:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()

    def arm(self, deployment: str, blob: bytes, entries: int) -> None:
        """Write `entries` copies of `blob` as replicas of `deployment` from now on."""
        self._conn.send(("arm", deployment, blob, entries))
        self._conn.recv()

    def rewrite(self, seq: int) -> None:
        """Every entry written again with sequence number `seq`; returns when Redis has them."""
        self._conn.send(("write", seq))
        self._conn.recv()


def _attack(url: str, conn, cpus: set[int] | None) -> None:
    import redis
    if cpus:
        os.sched_setaffinity(0, cpus)
    r = redis.Redis.from_url(url)
    keys, blob, entries = None, b"", 0
    while (msg := conn.recv()) is not None:
        if msg[0] == "arm":
            _, deployment, blob, entries = msg
            keys = StateKeys(deployment, "bench")
        elif keys is not None and entries:
            p = r.pipeline(transaction=False)
            now = int(time.time() * 1000)
            for i in range(entries):
                plant(p, keys, f"evil-{i}", blob, gen=1, seq=msg[1], at=now)
                p.zadd(keys.replicas, {f"evil-{i}": now})
            p.execute()
        conn.send("ok")
    r.close()


def _hostile_run(attacker: _Attacker, url: str, deployment: str, shape: str, blob: bytes, entries: int,
                 seconds: float, pacer: bool, decoy: bool = False, isolated: bool = True) -> dict:
    policy, shared = _replica(url, deployment, "victim", isolated=isolated)
    attacker.arm(deployment + "-decoy" if decoy else deployment, blob, entries)
    # As vLLM's engine does once it has started (vllm.utils.gc_utils.freeze_gc_heap): what exists
    # now is never scanned by the collector again, so a full collection costs what serving allocated
    # since, not this benchmark's whole heap (which alone made 40-70 ms collections here).
    gc.collect()
    gc.freeze()
    if not pacer:
        shared._pacer.slice_s = float("inf")
    assert shared.sync_now(), shared.status()
    steps: list[tuple[float, float, bool, float, float]] = []
    stop = threading.Event()
    # Python's garbage collector runs in whichever thread's allocation triggers it: the time the
    # stand-in spends collecting within a step is measured apart (vLLM's own allocations trigger
    # collections as well).
    # A collection in another thread (the replica's background thread) holds the interpreter lock:
    # the stand-in waits for it, so the longest of those is kept too.
    collecting = {"thread": -1, "since": 0.0, "in_step": 0.0, "other_since": 0.0, "other_max": 0.0}

    def on_collection(phase: str, info: dict) -> None:
        mine = threading.get_ident() == collecting["thread"]
        now = time.perf_counter()
        if phase == "start":
            collecting["since" if mine else "other_since"] = now
        elif mine:
            collecting["in_step"] += now - collecting["since"]
        else:
            collecting["other_max"] = max(collecting["other_max"], now - collecting["other_since"])

    def scheduler() -> None:
        collecting["thread"] = threading.get_ident()
        queued, stolen = _cpu_queue(), _host_steal()
        while not stop.is_set():
            q0, s0, c0 = queued(), stolen(), time.thread_time()
            collecting["in_step"] = 0.0
            t0 = time.perf_counter()
            time.sleep(0.001)                  # the forward pass: the GIL is free
            for _ in range(50):                # a little Python per step
                policy.predict_next(START)
            step = (time.perf_counter() - t0 - 0.001) * 1000
            unqueued = step - (queued() - q0)
            # what is left once its own CPU time is out too: asleep past the 1 ms, waiting for the lock
            steps.append((step, unqueued, stolen() != s0, unqueued - (time.thread_time() - c0) * 1000,
                          collecting["in_step"] * 1000))
        queued.close()
        stolen.close()

    gc.callbacks.append(on_collection)
    t = threading.Thread(target=scheduler, daemon=True)
    t.start()
    rounds, busy = 0, 0.0
    deadline = time.monotonic() + seconds
    while shape == "alone" and time.monotonic() < deadline:
        time.sleep(0.05)                       # no rounds: only the stand-in runs in this process
    while time.monotonic() < deadline:
        if entries:                            # rewritten: every round must fetch and decode them again
            attacker.rewrite(rounds + 1)
        t0 = time.perf_counter()
        shared.sync_now()
        busy += time.perf_counter() - t0
        rounds += 1
    stop.set()
    t.join()
    gc.callbacks.remove(on_collection)
    st = shared.status()
    shared.close(final_flush=False)
    total = sorted(s for s, _, _, _, _ in steps)
    calm = [(u, w) for _, u, x, w, _ in steps if not x] or [(0.0, 0.0)]
    return {"shape": shape, "entries": entries, "blob_bytes": len(blob), "rounds": rounds, "decoy": decoy,
            "round_ms": busy / rounds * 1000 if rounds else 0.0, "rejected": st.get("rejected_blobs", 0),
            "steps": len(steps),
            "step_p50_ms": total[len(total) // 2], "step_p99_ms": total[int(len(total) * 0.99)],
            "step_max_ms": total[-1], "steps_stolen": sum(x for _, _, x, _, _ in steps),
            "step_max_less_gc_ms": max((s - g for s, _, _, _, g in steps), default=0.0),
            "gc_max_ms": max((g for _, _, _, _, g in steps), default=0.0),
            "gc_other_max_ms": collecting["other_max"] * 1000,
            "step_max_unqueued_ms": max(u for u, _ in calm), "lock_wait_max_ms": max(w for _, w in calm),
            "pacer": pacer}


class _ProcCounter:
    """One number read again and again from a Linux /proc file (kept open: a read is a pread);
    0 where the file is not available. `field`: which of its first line's whitespace-separated
    fields, `scale`: what to multiply it by."""

    def __init__(self, path: str, field: int, scale: float = 1.0) -> None:
        self.field, self.scale = field, scale
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY)
        except OSError:
            self._fd = None

    def __call__(self) -> float:
        if self._fd is None:
            return 0.0
        fields = os.pread(self._fd, 256, 0).split(b"\n", 1)[0].split()
        return int(fields[self.field]) * self.scale if len(fields) > self.field else 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


def _host_steal() -> _ProcCounter:
    """The machine's steal counter (/proc/stat, 10 ms ticks): time the hypervisor ran something
    else on this VM's CPUs. A step during which it moved was stretched by the host, not by
    anything in this machine."""
    return _ProcCounter("/proc/stat", 8)


def _cpu_queue() -> _ProcCounter:
    """Milliseconds the calling thread has spent runnable but waiting for a CPU (its schedstat).
    Time a thread waits for the interpreter lock it spends asleep, not queued, so a step less its
    queued time is what the process did to it."""
    return _ProcCounter(f"/proc/self/task/{threading.get_native_id()}/schedstat", 1, 1e-6)


# -- 1. flush and merge cost -------------------------------------------------------------------------
def cost(url: str, agent_counts: Sequence[int] = (10, 100, 1000), replicas: int = 8, rounds: int = 5,
         out_degree: int = 8, seed: int = 0, isolated: bool = True) -> list[dict]:
    rows = []
    for n in agent_counts:
        rng = random.Random(seed + n)
        names = [f"agent-{i:04d}" for i in range(n)]
        succ = {a: rng.sample(names, min(out_degree, n)) + [END] for a in names}
        fleet = [_replica(url, f"cost-{n}-{int(isolated)}", f"r{i}", isolated=isolated) for i in range(replicas)]
        for policy, _ in fleet:   # every replica sees every agent and its successors a few times
            for a in names:
                policy.learn_transition(START, a)
                for b in succ[a]:
                    policy.learn_transition(a, b)
        samples: dict[str, list[float]] = {}
        for r in range(rounds + 1):
            for i, (policy, shared) in enumerate(fleet):
                for a in rng.sample(names, min(20, n)):   # some new traffic between rounds
                    policy.learn_transition(a, rng.choice(succ[a]))
                t0 = time.perf_counter()
                assert shared.sync_now(), shared.status()
                total = time.perf_counter() - t0
                t1 = time.perf_counter()
                policy.learn_transition(names[0], succ[names[0]][0])   # one update to replay at install
                installed = shared.on_step(policy)
                install = time.perf_counter() - t1
                if r == 0 and i < replicas - 1:
                    continue      # first round: the peers were not all written yet
                kind = "first" if r == 0 else "steady"
                t = shared.timings
                for key, v in (("round_s", total), ("encode_s", t["encode_s"]), ("flush_s", t["flush_s"]),
                               ("read_s", t["read_s"]), ("merge_s", t["merge_s"]), ("build_s", t["build_s"]),
                               ("install_s", install if installed else float("nan"))):
                    samples.setdefault(f"{kind}_{key}", []).append(v)
                samples.setdefault("blob_bytes", []).append(t["blob_bytes"])
        cells = sum(len(r) for r in fleet[0][0].inspect().learner.decayed_rows().values())
        row: dict[str, Any] = {"agents": n, "replicas": replicas, "transitions_per_replica": cells,
               "reader": "helper" if isolated else "in-process",
               "blob_bytes": int(statistics.median(samples["blob_bytes"]))}
        for key, vals in samples.items():
            if key != "blob_bytes":
                row[key.replace("_s", "_ms")] = round(1e3 * statistics.median(vals), 3)
        rows.append(row)
        for _, shared in fleet:
            shared.close(final_flush=False)
    return rows


# -- 2. a replica joining mid-run --------------------------------------------------------------------
class _SharingReplay(CacheScoutReplay):
    """CacheScout on the fast replay engine, installing the shared model when one is ready."""

    def __init__(self, shared: SharedLearnedState | None, config: PolicyConfig, sync_every: int = 20) -> None:
        super().__init__(config)
        self.shared = shared
        self.sync_every = sync_every
        self.arrivals = 0
        if shared is not None:
            shared.attach(self.core)

    def arrived(self, req, now: float) -> None:
        if self.shared is not None:
            # What the connector's background thread does every flush_interval_s (5 s: about 20
            # requests of one replica's share here), done in line to keep the replay deterministic.
            if self.arrivals % self.sync_every == 0:
                self.shared.sync_now()
            self.shared.on_step(self.core)
        self.arrivals += 1
        super().arrived(req, now)

    def final_flush(self) -> None:
        assert self.shared is not None, "final_flush on a replica without shared state"
        self.shared.note_names(self.core)
        assert self.shared.sync_now(read=False), self.shared.status()
        self.shared.close(final_flush=False)


def join(url: str, family: str = "gsm8k", sessions: int = 480, replicas: int = 4, seed: int = 0,
         window: int = 25) -> dict:
    """The fleet (`replicas` replicas, each 1/replicas of the sessions) runs the first half; then a new
    replica takes over replica 0's share of the second half, warm or cold; replica 0 itself, had it
    kept running, is the fleet's reference on exactly the same requests."""
    all_sessions = generate(WorkloadSpec(family=family, sessions=sessions, seed=seed))
    half = len(all_sessions) // 2
    share = [[s for i, s in enumerate(all_sessions) if i % replicas == r] for r in range(replicas)]
    joiner_part = [s for s in share[0] if s in set(all_sessions[half:])]
    cfg = PolicyConfig()
    engine_cfg = EngineConfig(gpu_blocks=calibrate_gpu_blocks(share[0], cfg.block_size))
    deployment = f"join-{family}-{seed}"
    # The fleet's first half, flushed to Redis.
    for r in range(replicas):
        policy = _SharingReplay(_replica(url, deployment, f"fleet-{r}")[1], cfg)
        first = [s for s in share[r] if s in set(all_sessions[:half])]
        Engine(engine_cfg, policy).run(first)
        policy.final_flush()
    runs = {}
    # The reference: replica 0 never stopped (warm cache and warm model), measured on the same calls.
    ref = _SharingReplay(None, cfg)
    result = Engine(engine_cfg, ref).run(share[0])
    runs["fleet"] = _per_request(result, ref, {s.session_id for s in joiner_part})
    for mode in ("warm", "cold"):
        shared = _replica(url, deployment, f"joiner-{mode}")[1] if mode == "warm" else None
        policy = _SharingReplay(shared, cfg)
        result = Engine(engine_cfg, policy).run(joiner_part)
        runs[mode] = _per_request(result, policy, None)
        if shared is not None:
            shared.close(final_flush=False)
    return _join_figures(runs, window) | {"family": family, "sessions": sessions, "replicas": replicas,
                                          "seed": seed, "gpu_blocks": engine_cfg.gpu_blocks,
                                          "joiner_requests": len(runs["cold"])}


def _per_request(result, policy: CacheScoutReplay, keep: set | None) -> list[tuple[int, int, int]]:
    """(prompt tokens, GPU hit tokens, prediction right) per request, in the order issued."""
    right = {id(req): int(obs.predicted_agent is not None and obs.predicted_agent == obs.agent)
             for req, obs in policy.observations}
    reqs = sorted((r for r in result.requests if keep is None or r.session.session_id in keep),
                  key=lambda r: (r.issued_at, r.session.session_id, r.index))
    return [(r.prompt_len, r.gpu_hit_tokens, right.get(id(r), 0)) for r in reqs]


def _join_figures(runs: dict[str, list[tuple[int, int, int]]], window: int) -> dict:
    """Per window of requests: GPU hit rate and next-agent accuracy of fleet, warm and cold (paired:
    the same requests). Catch-up: how many requests the joiner has served when, over its next
    4 x `window` requests, its hit rate is within 1 point of the fleet's on the same requests (and
    its next-agent accuracy within 5 points)."""
    def hit(rows):
        p = sum(r[0] for r in rows)
        return sum(r[1] for r in rows) / p if p else 0.0

    def acc(rows):
        return sum(r[2] for r in rows) / len(rows) if rows else 0.0

    n = min(len(v) for v in runs.values())
    out: dict = {"window": window, "windows": []}
    for lo in range(0, n, window):
        w = {"requests": f"{lo + 1}-{min(n, lo + window)}"}
        for mode, rows in runs.items():
            part = rows[lo:lo + window]
            w[f"{mode}_hit"] = round(hit(part), 4)
            w[f"{mode}_accuracy"] = round(acc(part), 4)
        out["windows"].append(w)
    fleet = runs["fleet"]
    for mode in ("fleet", "warm", "cold"):
        rows = runs[mode]
        for k in (100, 200):
            out[f"{mode}_hit_first_{k}"] = round(hit(rows[:k]), 4)
            out[f"{mode}_accuracy_first_{k}"] = round(acc(rows[:k]), 4)
        out[f"{mode}_hit_all"] = round(hit(rows[:n]), 4)
        out[f"{mode}_accuracy_all"] = round(acc(rows[:n]), 4)
        if mode != "fleet":
            span = 4 * window
            out[f"{mode}_catch_up_hit"] = next((k for k in range(0, n - span + 1, 5)
                                                if hit(fleet[k:k + span]) - hit(rows[k:k + span]) <= 0.01), None)
            out[f"{mode}_catch_up_accuracy"] = next((k for k in range(0, n - span + 1, 5)
                                                     if acc(fleet[k:k + span]) - acc(rows[k:k + span]) <= 0.05), None)
    return out


def markdown(figures: dict) -> str:
    """The figures as the tables in docs/shared_state.md."""
    out = _cost_table(figures) + ["", *_join_table(figures), "", *_hostile_table(figures)]
    return "\n".join(out)


def _hostile_table(figures: dict) -> list[str]:
    seconds = max((h.get("seconds", 4.0) for h in figures.get("hostile", [])), default=4.0)
    out = ["Hostile entries (8 entries of about 4 MiB, each rewritten with a new sequence number by another "
           "process before every round, so every round fetches and decodes all of them; rounds back to back for "
           f"{seconds:g} s; a stand-in for vLLM's scheduler thread sleeps 1 ms, the forward pass, then runs a "
           "little Python; "
           "step = its time beyond the 1 ms; unqueued = a step less the time the thread waited for a CPU, over the "
           "steps during which the hypervisor took no CPU from this VM (stolen: the steps it did); lock wait = "
           "an unqueued step less the thread's own CPU time: asleep past its 1 ms, waiting for the interpreter "
           "lock; less GC = a step less the time the thread itself spent in Python's garbage collector (which "
           "runs in whichever thread's allocation triggers it); "
           "cores: shared = Redis, the writer and the replica on every core, apart = the replica (and its helper) on "
           "one CPU, Redis and the writer on the others; reader: helper = peers read by the helper process, "
           "in-process = by the replica's background thread):", "",
           "| reader | cores | shape | entries | rounds | round | refused | steps | stolen | step p50 | step p99 "
           "| step max | max less GC | max unqueued | max lock wait |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for h in figures.get("hostile", []):
        shape = "decoys (written, never read)" if h.get("decoy") else h["shape"]
        out.append(f"| {h.get('reader', 'in-process')} | {h.get('cores', 'shared')} | {shape} | {h['entries']} "
                   f"| {h['rounds']} "
                   f"| {h['round_ms']:,.0f} ms | {h['rejected']} | {h['steps']:,} | {h.get('steps_stolen', 0)} "
                   f"| {h['step_p50_ms']:.2f} ms | {h['step_p99_ms']:.2f} ms "
                   f"| {h['step_max_ms']:.2f} ms | {h.get('step_max_less_gc_ms', float('nan')):.2f} ms "
                   f"| {h['step_max_unqueued_ms']:.2f} ms "
                   f"| {h.get('lock_wait_max_ms', float('nan')):.2f} ms |")
    return out


def _cost_table(figures: dict) -> list[str]:
    out = ["Flush and merge, 8 replicas, each agent with 8 successors (milliseconds, medians over the 8 "
           "replicas and 5 rounds; in every round each replica has new traffic, so every peer's blob is "
           "fetched and decoded again):", "",
           "| reader | agents | transitions per replica | blob | encode | flush | read 7 peers | decode + fold + merge "
           "| of which build | install (scheduler thread) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in figures["cost"]:
        out.append(f"| {r.get('reader', 'in-process')} | {r['agents']:,} | {r['transitions_per_replica']:,} "
                   f"| {r['blob_bytes'] / 1024:,.1f} KiB "
                   f"| {r['steady_encode_ms']:.2f} | {r['steady_flush_ms']:.2f} | {r['steady_read_ms']:.2f} "
                   f"| {r['steady_merge_ms']:.2f} | {r['steady_build_ms']:.2f} | {r['steady_install_ms']:.3f} |")
    return out


def _join_table(figures: dict) -> list[str]:
    joins = figures["join"]
    out = ["A replica joining half-way (mean over seeds; the joiner takes over one replica's share of the "
            "second half; \"fleet\" is that replica had it kept running, measured on the same requests; "
            "catch-up: requests served before its next 100 are within 1 point of the fleet's hit rate / 5 "
            "points of its next-agent accuracy, median):", "",
            "| workload | seeds | GPU hit, first 100: fleet / warm / cold | GPU hit, all | next-agent accuracy, "
            "first 100 | catch-up, hit: warm / cold | catch-up, accuracy: warm / cold |",
            "|---|---|---|---|---|---|---|"]
    for family in dict.fromkeys(j["family"] for j in joins):
        rows = [j for j in joins if j["family"] == family]

        def mean(key, rows=rows):
            return sum(r[key] for r in rows) / len(rows)

        def med(key, rows=rows):
            vals = sorted(r[key] if r[key] is not None else r["joiner_requests"] for r in rows)
            return vals[len(vals) // 2]

        def trio(suffix, fmt, mean=mean):
            return " / ".join(format(mean(m + suffix), fmt) for m in ("fleet", "warm", "cold"))

        out.append(f"| {family} | {len(rows)} | {trio('_hit_first_100', '.3f')} | {trio('_hit_all', '.3f')} "
                   f"| {trio('_accuracy_first_100', '.2f')} "
                   f"| {med('warm_catch_up_hit')} / {med('cold_catch_up_hit')} "
                   f"| {med('warm_catch_up_accuracy')} / {med('cold_catch_up_accuracy')} |")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cachescout.bench.state_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--json", default="state_bench.json")
    ap.add_argument("--families", default="gsm8k,mtbench,gaia,swebench")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per family for the join figures (default 3)")
    ap.add_argument("--sections", default="cost,join,hostile", help="which figures (default cost,join,hostile)")
    ap.add_argument("--hostile-shapes", default=None, metavar="NAMES",
                    help="hostile: only these shapes, comma-separated (default: none, decoys and every shape; "
                         "\"alone\", the stand-in with no rounds at all, only when named)")
    ap.add_argument("--hostile-seconds", type=float, default=4.0, metavar="S",
                    help="hostile: seconds per shape and layout (default 4; the long-run tail needs 60-90)")
    ap.add_argument("--readers", default="helper", metavar="NAMES",
                    help="cost and hostile: who reads the peers, comma-separated: helper (the default "
                         "setting, isolated_reader), in-process")
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    known = ["alone", "none", "decoys", *hostile_blobs(1024)]
    shapes = None if args.hostile_shapes is None else [x.strip() for x in args.hostile_shapes.split(",")]
    if shapes is not None and (not shapes or any(x not in known for x in shapes)):
        ap.error(f"--hostile-shapes {args.hostile_shapes!r}: choose from {', '.join(known)}")
    readers = [x.strip() for x in args.readers.split(",")]
    if not readers or any(x not in ("helper", "in-process") for x in readers):
        ap.error(f"--readers {args.readers!r}: choose from helper, in-process")
    if not 0 < args.hostile_seconds < 86_400:
        ap.error(f"--hostile-seconds must be within (0, 86400), got {args.hostile_seconds}")
    with (contextlib.nullcontext(args.redis_url) if args.redis_url else private_redis()) as url:
        figures: dict = {"cost": [row for reader in readers for row in cost(url, isolated=reader == "helper")]
                         if "cost" in sections else [], "join": [], "hostile": []}
        print(f"{'agents':>6} {'cells':>6} {'blob':>8} {'encode':>7} {'flush':>7} {'read 1st':>8} {'read':>7} "
              f"{'merge 1st':>9} {'merge':>7} {'build':>7} {'install':>8}  (ms, medians over 8 replicas)")
        for r in figures["cost"]:
            print(f"{r['agents']:>6} {r['transitions_per_replica']:>6} {r['blob_bytes']:>8,} "
                  f"{r['steady_encode_ms']:>7.3f} {r['steady_flush_ms']:>7.3f} {r['first_read_ms']:>8.3f} "
                  f"{r['steady_read_ms']:>7.3f} {r['first_merge_ms']:>9.3f} {r['steady_merge_ms']:>7.3f} "
                  f"{r['steady_build_ms']:>7.3f} {r['steady_install_ms']:>8.3f}")
        if "hostile" in sections:
            # (the rejections are logged; quiet here)
            logging.getLogger("cachescout.shared_state").setLevel(logging.ERROR)
            for reader in readers:
                isolated = reader == "helper"
                figures["hostile"] += hostile(url, seconds=args.hostile_seconds, shapes=shapes, isolated=isolated)
                if not args.redis_url and can_run_apart():
                    with private_redis(cpus=_split_cpus()[1]) as apart_url:
                        figures["hostile"] += hostile(apart_url, seconds=args.hostile_seconds, apart=True,
                                                      shapes=shapes, isolated=isolated)
            for h in figures["hostile"]:
                print(f"hostile {h['reader']:<10} {h['cores']:<6} {h['shape']:<15} {h['entries']} x "
                      f"{h['blob_bytes']:>9,} B: "
                      f"{h['rounds']} rounds of "
                      f"{h['round_ms']:.0f} ms; scheduler step p50 {h['step_p50_ms']:.2f} p99 {h['step_p99_ms']:.2f} "
                      f"max {h['step_max_ms']:.2f} ms ({h['step_max_unqueued_ms']:.2f} unqueued) "
                      f"over {h['steps']} steps", flush=True)
        for family in (args.families.split(",") if "join" in sections else []):
            for seed in range(args.seeds):
                j = join(url, family=family, seed=seed)
                figures["join"].append(j)
                print(f"{family:<9} seed {seed}: GPU hit first 100 / all: fleet {j['fleet_hit_first_100']:.3f} / "
                      f"{j['fleet_hit_all']:.3f}, warm {j['warm_hit_first_100']:.3f} / {j['warm_hit_all']:.3f}, "
                      f"cold {j['cold_hit_first_100']:.3f} / {j['cold_hit_all']:.3f}; accuracy first 100: fleet "
                      f"{j['fleet_accuracy_first_100']:.2f}, warm {j['warm_accuracy_first_100']:.2f}, cold "
                      f"{j['cold_accuracy_first_100']:.2f}; catch-up hit / accuracy (requests): warm "
                      f"{j['warm_catch_up_hit']} / {j['warm_catch_up_accuracy']}, cold {j['cold_catch_up_hit']} / "
                      f"{j['cold_catch_up_accuracy']} of {j['joiner_requests']}", flush=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(figures, f, indent=1)
    print(f"wrote {args.json}\n")
    print(markdown(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
