"""Calls to a real vLLM server's OpenAI API and /metrics, for the real-engine tests."""

from __future__ import annotations

import json
import time
import urllib.request

from cachescout.bench import serve


def post(url: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read() or b"{}")


def complete(url: str, tokens: list[int], max_tokens: int = 8) -> str:
    """A greedy completion of a prompt given as token ids."""
    body = {"model": "model", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return post(url, "/v1/completions", body)["choices"][0]["text"]


def wait_for(server: serve.Server, name: str, at_least: float, timeout_s: float = 30.0) -> dict:
    """/metrics once `name` reaches `at_least` (vLLM reports counters every few seconds), or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        if metrics.get(name, 0.0) >= at_least or time.monotonic() > deadline:
            return metrics
        time.sleep(0.25)
