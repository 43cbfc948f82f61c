"""Synthetic prompts for tests: blocks named by content, hashed in a chain like vLLM's."""

from __future__ import annotations

import hashlib

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
