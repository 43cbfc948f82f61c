"""Synthetic prompts for tests: blocks named by content, hashed in a chain like vLLM's."""

from __future__ import annotations

import hashlib

from cachescout.bench.trace import parse_trace
from cachescout.policy import block_key


def chain(blocks: list) -> list[int]:
    """Chained block keys: block i's key covers blocks 0..i (sha256, as vLLM does)."""
    out = []
    prev = b""
    for b in blocks:
        prev = hashlib.sha256(prev + repr(b).encode()).digest()
        out.append(block_key(prev))
    return out


def anchor(name: str, n: int, header: int = 0) -> list:
    """An agent's anchor: an optional shared header then `n` blocks private to `name`."""
    return [("hdr", i) for i in range(header)] + [(name, i) for i in range(n)]


def task(session: int, n: int = 3) -> list:
    return [("task", session, i) for i in range(n)]


class StallingProxy:
    """A TCP proxy to 127.0.0.1:`target` that goes silent while `stall` is true (a network that
    drops packets: the client sees timeouts, not refused connections)."""

    def __init__(self, target: int) -> None:
        import socket
        import threading

        self.target = target
        self.stall = False
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._closed = False
        self._threads: list = []
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()

    def _pump(self, src, dst) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if not self.stall:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def __enter__(self) -> "StallingProxy":
        return self

    def __exit__(self, *exc) -> None:
        self._closed = True
        self._server.close()


def queued_behind_two_stores() -> list:
    """Trace sessions in which a call waits while other prompts are stored over its CPU copy.

    A's prompt (4 blocks of 16 tokens) is stored in the CPU tier; ten seconds later two other
    prompts of 5 blocks each and A's next call (A's prompt and one block more) arrive together. A
    GPU cache of 8 blocks admits one other prompt at a time, so A's call waits while both are
    stored into a CPU tier of 8 blocks, as a call waits behind others on a loaded server."""
    lines = ['{"timestamp": 0, "input_length": 64, "output_length": 2, "hash_ids": [1, 2, 3, 4]}',
             '{"timestamp": 10000, "input_length": 80, "output_length": 40, "hash_ids": [11, 12, 13, 14, 15]}',
             '{"timestamp": 10000, "input_length": 80, "output_length": 2, "hash_ids": [21, 22, 23, 24, 25]}',
             '{"timestamp": 10000, "input_length": 80, "output_length": 2, "hash_ids": [1, 2, 3, 4, 5]}']
    sessions, _ = parse_trace(lines, block_size=16)
    return sessions
