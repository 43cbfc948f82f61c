"""Queued requests' CPU-tier holds beside a real vLLM server (vLLM's CPU build, the tiny random
Llama, LMCache's CPU tier, no Redis), one request running at a time.

A's prompt is served and stored in LMCache's CPU tier. A long request then runs, and three more
queue behind it: B and C, two new prompts, and Q, A's prompt continued. B and C are stored while Q
waits, and the tier (40 chunks) cannot keep A's 8 chunks beside them (33 + 30). LMCache pins what
its lookup finds only when vLLM tries to admit Q: with `hold_queued` off its CPU copy of A is gone
by then and Q recomputes it; with it on (the default) CacheScout held it from Q's arrival, and Q
loads it. Either way Q's greedy output is the same."""

from __future__ import annotations

import threading
import time

import pytest
from server_calls import complete, wait_for

from cachescout.bench import serve

A = [3000 + (i * 37) % 20000 for i in range(512)]           # 8 LMCache chunks of 64 tokens
Q = A + [60000 + i for i in range(64)]
LONG = [9000 + i for i in range(64)]
B = [20000 + (i * 7) % 9000 for i in range(1536)]            # 24 chunks
C = [40000 + (i * 11) % 9000 for i in range(1920)]           # 30 chunks


def _run(server: serve.Server) -> dict:
    out: dict = {"A": complete(server.url, A, max_tokens=1)}
    before = wait_for(server, "vllm:prompt_tokens", len(A))
    threads = []

    def call(name, tokens, max_tokens):
        out[name] = complete(server.url, tokens, max_tokens=max_tokens)

    # The long request holds the only running slot; B, C and Q queue behind it, in this order.
    for name, tokens, max_tokens, pause in (("long", LONG, 1000, 0.5), ("B", B, 1, 0.15), ("C", C, 1, 0.15),
                                            ("Q", Q, 8, 0.0)):
        t = threading.Thread(target=call, args=(name, tokens, max_tokens))
        t.start()
        threads.append(t)
        time.sleep(pause)
    for t in threads:
        t.join(300)
    calls = len(A) + len(LONG) + len(B) + len(C) + len(Q)
    after = wait_for(server, "vllm:prompt_tokens", calls)
    time.sleep(3.0)   # workers' counters ride on the next reports
    after = server.metrics()
    out["loaded"] = after.get("vllm:external_prefix_cache_hits", 0) - before.get("vllm:external_prefix_cache_hits", 0)
    out["metrics"] = after
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from cachescout.bench.tiny_model import build
    work = tmp_path_factory.mktemp("hold")
    options = serve.ServeOptions(model=str(build()), gpu_blocks=64, max_num_seqs=1, cpu_ratio=1.25)
    got = {}
    for hold in (False, True):
        server = serve.Server("cachescout-lmcache", options, 2016, work, None, connector_extra={"hold_queued": hold})
        try:
            got[hold] = _run(server)
        finally:
            server.stop()
            got.setdefault(hold, {})["log"] = server.log_path.read_text(errors="replace")
    print("loaded from LMCache:", {h: r.get("loaded") for h, r in got.items()})
    return got


def test_without_the_hold_the_queued_request_recomputes_what_lmcache_had_on_its_arrival(runs):
    off = runs[False]
    assert off["loaded"] == 0
    assert off["metrics"].get("vllm:cachescout_queued_holds", 0) == 0


def test_held_from_its_arrival_the_queued_request_loads_its_prefix_from_lmcache(runs):
    on = runs[True]
    m = on["metrics"]
    assert m["vllm:cachescout_queued_holds"] >= 1 and m["vllm:cachescout_hold_chunks"] >= 7
    assert on["loaded"] >= len(A) - 2 * serve.BLOCK_SIZE     # all of A past what the GPU kept
    assert m.get("vllm:cachescout_hold_errors", 0) == 0


def test_the_queued_requests_output_is_the_same_loaded_or_recomputed(runs):
    assert runs[True]["Q"] == runs[False]["Q"] and runs[True]["A"] == runs[False]["A"]
