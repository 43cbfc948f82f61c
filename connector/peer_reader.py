"""Peers' entries fetched and checked in a helper process, off vLLM's interpreter lock.

Reading other replicas' snapshots is the one part of a round whose cost someone else decides: an
entry of up to `max_blob_bytes`, in any shape a writer with access to the keys likes. Done in the
serving process, every step of that work holds the interpreter lock that vLLM's scheduler thread
needs; paced finely it still left rare waits of 5-18 ms over long runs (parsing replies and page
faults in C, with the lock held). So a helper process does it: it fetches the peers' entries that
changed, decodes and checks them with the same bounded decoder, keeps the accepted ones, and answers
each round with one snapshot, the sum of every accepted peer's counts (weighted, renamed to this
replica's agents). The serving process decodes only that (paced), a snapshot no larger than the
agents it knows, whatever the peers wrote.

    background thread ("cachescout-state")        helper (python -m cachescout.connector.peer_reader)
    read the index (names, generations, sizes)
    peers (name, gen, seq, key, size, weight),
    names, epoch  ------------------------------>  fetch the changed ones, decode, check, keep
                  <------------------------------  verdicts (refused: why; vanished), one snapshot
    decode it (paced), add own counts, publish

Frames on the pipes: 4 bytes of length (big-endian), then the body: msgpack for requests and
verdicts, the snapshot's own bytes for the sum. The helper exits when its stdin closes, so it never
outlives the process that started it; one that hangs is killed at the round's deadline and started
again at the next round.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack

_READ = 64 * 1024            # bytes taken from the pipe at a time (os.read lets go of the lock meanwhile)
_MAX_HEADER = 1 << 20        # a verdicts frame larger than this is not the helper's
_MAX_BODY = 64 * 1024 * 1024  # nor a snapshot larger than this
_READY_S = 20.0              # a helper that has not answered its greeting by then is not coming


class PeerReaderError(Exception):
    """The helper failed this round (Redis unreachable from it, or it died or hung)."""


class PeerReader:
    """The serving process's side: starts the helper, asks it each round, kills it if it hangs."""

    def __init__(self, hello: Mapping[str, Any], deadline_s: float,
                 command: Sequence[str] = (sys.executable, "-m", "cachescout.connector.peer_reader")) -> None:
        self._hello = dict(hello)
        self.deadline_s = deadline_s
        self._command = list(command)
        self._proc: subprocess.Popen | None = None
        self._stop: weakref.finalize | None = None   # stops the helper, also if this object is dropped
        self.starts = 0
        self.failed_starts = 0   # in a row
        self.closed = False      # terminate() was called: no helper is started again

    def exchange(self, request: Mapping[str, Any], tick: Callable[[], None] | None = None) -> tuple[dict, list[bytes]]:
        """(verdicts, the summed snapshot's bytes in parts) for one round's `request`."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            proc = self._start()
        try:
            _write(proc, msgpack.packb(request, use_bin_type=True), time.monotonic() + self.deadline_s)
            deadline = time.monotonic() + self.deadline_s
            header = _read_frame(proc, deadline, _MAX_HEADER, tick)
            body = _read_frame(proc, deadline, _MAX_BODY, tick)
            verdicts = msgpack.unpackb(b"".join(header), raw=False, strict_map_key=True)
        except Exception as exc:
            self.kill()
            raise PeerReaderError(f"the helper process reading peers' entries {exc}") from None
        if not isinstance(verdicts, dict):
            self.kill()
            raise PeerReaderError("the helper process reading peers' entries answered out of turn")
        if verdicts.get("error"):
            raise PeerReaderError(str(verdicts["error"])[:500])
        return verdicts, body

    def _start(self) -> subprocess.Popen:
        self.kill()
        if self.closed:
            raise PeerReaderError("the helper process reading peers' entries is stopped (closing)")
        self.starts += 1
        self.failed_starts += 1
        # stderr goes nowhere: the helper reports through its answers, and Python's own complaints
        # (it cannot start) show as the exit code below.
        try:
            proc = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, close_fds=True)
        except OSError as exc:
            raise PeerReaderError(f"the helper process reading peers' entries could not be started "
                                  f"({type(exc).__name__}: {exc})") from None
        self._proc = proc
        self._stop = weakref.finalize(self, _stop_helper, proc)
        if self.closed:          # terminate() came while it started
            self.kill()
            raise PeerReaderError("the helper process reading peers' entries is stopped (closing)")
        try:
            deadline = time.monotonic() + min(_READY_S, self.deadline_s)
            _write(proc, msgpack.packb(self._hello, use_bin_type=True), deadline)
            ready = msgpack.unpackb(b"".join(_read_frame(proc, deadline, _MAX_HEADER, None)), raw=False)
        except Exception as exc:
            code = proc.poll()
            self.kill()
            raise PeerReaderError(f"the helper process reading peers' entries did not start "
                                  f"({'exit code ' + str(code) if code is not None else exc})") from None
        if not isinstance(ready, dict) or ready.get("error"):
            self.kill()
            raise PeerReaderError(f"the helper process reading peers' entries refused to start: "
                                  f"{str(ready.get('error') if isinstance(ready, dict) else ready)[:300]}")
        self.failed_starts = 0
        return proc

    def terminate(self) -> None:
        """From another thread than the one asking (a shutdown): kill the helper process, so that a
        round waiting on it ends at once (it reads the end of the pipe), and start none again. The
        pipes are left to the asking thread (`kill`): closed from here, their descriptor numbers
        could be reused by another file while that thread still reads them. Never raises."""
        self.closed = True
        proc = self._proc
        if proc is not None:
            try:
                proc.kill()
            except OSError:
                pass

    def kill(self) -> None:
        """Stop the helper (closing its stdin first: it exits at once then), from the thread that
        asks it (or once that thread is gone). Never raises."""
        self._proc = None
        stop, self._stop = self._stop, None
        if stop is not None:
            stop()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid


def _stop_helper(proc: subprocess.Popen) -> None:
    for f in (proc.stdin, proc.stdout):
        try:
            if f is not None:
                f.close()
        except OSError:
            pass
    try:
        proc.wait(0.2)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(1.0)
        except subprocess.TimeoutExpired:
            pass
    except Exception:  # noqa: BLE001 - stopping a helper must not fail a shutdown
        pass


def _write(proc: subprocess.Popen, body: bytes, deadline: float) -> None:
    assert proc.stdin is not None
    fd = proc.stdin.fileno()
    data = memoryview(len(body).to_bytes(4, "big") + body)
    while data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [fd], [], left)[1]:
            raise TimeoutError("did not take its request in time")
        n = os.write(fd, data[:_READ])
        data = data[n:]


def _read_frame(proc: subprocess.Popen, deadline: float, limit: int,
                tick: Callable[[], None] | None) -> list[bytes]:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    head = b"".join(_read_exactly(fd, 4, deadline, tick))
    n = int.from_bytes(head, "big")
    if n > limit:
        raise ValueError(f"sent a frame of {n} bytes, over {limit}")
    return _read_exactly(fd, n, deadline, tick)


def _read_exactly(fd: int, n: int, deadline: float, tick: Callable[[], None] | None) -> list[bytes]:
    parts: list[bytes] = []
    while n > 0:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError("did not answer in time")
        got = os.read(fd, min(n, _READ))
        if not got:
            raise EOFError("exited")
        parts.append(got)
        n -= len(got)
        if tick is not None:
            tick()
    return parts


# -- the helper ---------------------------------------------------------------------------------------
class _Helper:
    """The helper's state: a Redis client, and the peers it accepted, by name: ((epoch, gen, seq), rows)."""

    def __init__(self, hello: Mapping[str, Any]) -> None:
        from .shared_state import SharedStateSettings, connect
        from .state_store import StateKeys, StateStore
        settings = SharedStateSettings.from_mapping(hello["settings"], check_environment=False)
        self.store = StateStore(connect(settings), StateKeys(hello["deployment"], hello["model"]),
                                max_blob_bytes=settings.max_blob_bytes, max_replicas=settings.max_replicas)
        self.cache: dict[str, tuple[tuple[str, int, int], dict[str, dict[str, float]]]] = {}

    def answer(self, req: Mapping[str, Any]) -> tuple[dict, bytes]:
        from cachescout.policy import StateDecodeError, TransitionSnapshot

        from .shared_state import _renamed
        epoch, half_life, names = str(req["epoch"]), float(req["half_life"]), dict(req["names"])
        peers = [(str(n), int(g), int(s), str(k), int(z), float(w)) for n, g, s, k, z, w in req["peers"]]
        want = [(n, k, z) for n, g, s, k, z, _ in peers if self.cache.get(n, (None,))[0] != (epoch, g, s)]
        got = self.store.fetch(want) if want else {}
        refused: dict[str, str] = {}
        vanished: list[str] = []
        cache: dict[str, tuple[tuple[str, int, int], dict[str, dict[str, float]]]] = {}
        total: dict[str, dict[str, float]] = {}
        for name, gen, seq, _, _, weight in peers:
            key = (epoch, gen, seq)
            old = self.cache.get(name)
            if old is not None and old[0] == key:
                rows = old[1]
            elif name in got:
                try:
                    snap = TransitionSnapshot.decode(got.pop(name))
                except StateDecodeError as exc:
                    refused[name] = str(exc)
                    continue
                if snap.half_life != half_life:
                    refused[name] = f"half_life {snap.half_life} != {half_life}"
                    continue
                rows = snap.decayed_rows()
            else:
                vanished.append(name)    # its key no longer holds a string
                continue
            cache[name] = (key, rows)
            if weight > 0:
                _renamed(rows, names, weight, drop_unknown=True, into=total)
        self.cache = cache
        body = TransitionSnapshot.from_rows(half_life, total).encode() if total else b""
        return {"refused": refused, "vanished": vanished, "accepted": sorted(cache)}, body


def _serve(stdin: Any, stdout: Any) -> int:
    def read() -> bytes | None:
        head = stdin.read(4)
        if len(head) < 4:
            return None
        body = stdin.read(int.from_bytes(head, "big"))
        return body if body is not None else None

    def send(body: bytes) -> None:
        stdout.write(len(body).to_bytes(4, "big") + body)
        stdout.flush()

    first = read()
    if first is None:
        return 0
    try:
        helper = _Helper(msgpack.unpackb(first, raw=False))
    except Exception as exc:  # noqa: BLE001 - reported to the serving process, which logs it
        send(msgpack.packb({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    send(msgpack.packb({"ready": True}))
    _background_priority()
    while True:
        raw = read()
        if raw is None:
            return 0
        body = b""
        try:
            verdicts, body = helper.answer(msgpack.unpackb(raw, raw=False))
        except Exception as exc:  # noqa: BLE001 - Redis errors and defects alike end the round, not the helper
            verdicts = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        send(msgpack.packb(verdicts, use_bin_type=True))
        send(body)


def _background_priority() -> None:
    """From the first round on, run on CPU time vLLM's threads leave idle (Linux's SCHED_IDLE: a
    thread of vLLM's that wakes takes the CPU from it at once), elsewhere at the lowest priority.
    (Started at normal priority: on a saturated machine an idle-priority start would never end.)"""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except OSError:
            pass


def main() -> int:
    # The frames go to the original stdout; anything else printed goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        return _serve(sys.stdin.buffer, out)
    except (BrokenPipeError, KeyboardInterrupt):
        return 0


if __name__ == "__main__":
    sys.exit(main())
