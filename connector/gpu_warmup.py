"""Warm-up requests: CacheScout's prefetch into vLLM's GPU prefix cache.

A KV connector cannot put blocks into vLLM's GPU prefix cache by itself: only a request computes
them (or, with LMCache beside CacheScout, loads them from its CPU tier). So when the scheduler side
predicts an agent's call and that agent's anchor is not on the GPU, it asks its own server for a
one-token completion of the anchor's tokens, marked `cachescout.warmup` in `kv_transfer_params`.
Its prefill brings the anchor's blocks into the cache; the predicted call then finds them there.
The policy does not learn from a warm-up (it is no call): its blocks are filed as a prefetch of the
agent's anchor, and judged used or wasted like any prefetch.

When to send one is the scheduler side's decision (scheduler_side.py: an idle prefill, room the
policy predicts dead). This module only sends: from a background thread, one request at a time, so
the scheduler's thread never waits on HTTP; an offer while one is in flight is declined.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("cachescout.connector")

WARMUP_KEY = "cachescout.warmup"   # kv_transfer_params key marking a warm-up; its value: the agent
# The lowest priority vLLM's priority scheduling can be asked for here (lower values go first).
LOWEST_PRIORITY = 1 << 30


class WarmupSender:
    """Sends warm-up completions to `url` (this server's OpenAI API) from a background thread."""

    def __init__(self, url: str, model: str, *, timeout_s: float, priority: int | None = None,
                 api_key: str | None = None) -> None:
        """`priority`: sent with each request when the server schedules by priority (None: not
        sent, as vLLM refuses it otherwise); `api_key`: the server's, when it requires one."""
        self.url = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.timeout_s = timeout_s
        self.priority = priority
        self.api_key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY")
        # Written by the sender's thread, read by the scheduler's: every key exists from the start.
        self.stats: Counter[str] = Counter({"warmups_sent": 0, "warmups_failed": 0})
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=1)
        self._busy = threading.Event()    # set from an accepted offer until its answer (or failure)
        self._logged_failure = False
        self._thread = threading.Thread(target=self._run, name="cachescout-warmup", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._busy.is_set()

    def offer(self, agent: str, tokens: Sequence[int], tags: dict[str, Any] | None = None) -> bool:
        """Queue a warm-up of `tokens` (the agent's anchor); False if one is still in flight."""
        if self._busy.is_set():
            return False
        params: dict[str, Any] = {**(tags or {}), WARMUP_KEY: agent}
        body: dict[str, Any] = {"model": self.model, "prompt": list(tokens), "max_tokens": 1,
                                "temperature": 0.0, "kv_transfer_params": params}
        if self.priority is not None:
            body["priority"] = self.priority
        self._busy.set()
        try:
            self._queue.put_nowait(body)
        except queue.Full:     # only if close() raced us
            self._busy.clear()
            return False
        return True

    def _run(self) -> None:
        while True:
            body = self._queue.get()
            if body is None:
                return
            try:
                self._send(body)
                self.stats["warmups_sent"] += 1
            except Exception as e:   # noqa: BLE001 - any failure is counted; serving never sees it
                self.stats["warmups_failed"] += 1
                if not self._logged_failure:
                    self._logged_failure = True
                    log.warning("CacheScout: a GPU warm-up request to %s failed (%s: %.200s); "
                                "later failures are only counted (warmups_failed)", self.url, type(e).__name__, e)
            finally:
                self._busy.clear()

    def _send(self, body: dict[str, Any]) -> None:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            response.read(1 << 16)

    def close(self) -> None:
        """Stop the thread; a request in flight is left to end on its own timeout (daemon thread)."""
        try:
            self._queue.get_nowait()       # a warm-up not yet sent is dropped
        except queue.Empty:
            pass
        self._queue.put_nowait(None)
