"""GPU warm-ups beside a real vLLM server (vLLM's CPU build, the tiny random Llama): CacheScout with
LMCache's CPU tier and `gpu_warmup_url` pointing at the server itself. An agent's calls teach
CacheScout its anchor and that sessions start with it; vLLM's prefix cache is then reset (the
anchor leaves the GPU, LMCache's CPU tier keeps it); while an unrelated request runs, CacheScout
sends a warm-up of the anchor, which vLLM loads from LMCache; the agent's next call finds the whole
anchor on the GPU, and its greedy output is the one it had with the anchor computed."""

from __future__ import annotations

import json

import pytest
from conftest import need_redis
from server_calls import complete as _complete
from server_calls import post as _post
from server_calls import wait_for as _wait_for

from cachescout.bench import serve

AGENT_CALLS = 8


def _anchor() -> list[int]:
    return [2000 + (i * 53) % 20000 for i in range(256)]          # 8 blocks of 32


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    need_redis()
    from cachescout.bench.tiny_model import build
    work = tmp_path_factory.mktemp("warmup")
    options = serve.ServeOptions(model=str(build()), gpu_blocks=64)
    anchor = _anchor()
    # Tasks of 5 blocks: a prompt that left the previous one within its last 3 blocks would read as
    # that conversation edited, not as a new session of the agent.
    nxt = anchor + [40000 + i for i in range(160)]
    out: dict = {}
    with serve.redis_server(work) as redis_url:
        # A handful of calls gives the model little confidence yet (0.1 here): the bar is lowered
        # so that they suffice (the default, 0.3, takes more traffic).
        server = serve.Server("cachescout-lmcache-warmup", options, 1024, work, redis_url,
                              connector_extra={"policy": {"prefetch_min_confidence": 0.05}},
                              env={"VLLM_SERVER_DEV_MODE": "1"})
        try:
            out["reference"] = _complete(server.url, nxt)            # computed: nothing cached yet
            for i in range(AGENT_CALLS):                             # the agent's calls, each a new session
                _complete(server.url, anchor + [30000 + 200 * i + k for k in range(160)])
            before = _wait_for(server, "vllm:cachescout_requests", AGENT_CALLS + 1)
            out["before"] = before
            out["reset"] = _post(server.url, "/reset_prefix_cache")
            # Steps happen only while a request is in flight: an unrelated one gives the connector its chance.
            _complete(server.url, [50000 + i for i in range(300)], max_tokens=24)
            out["after_warmup"] = _wait_for(server, "vllm:cachescout_warmup_blocks", 1)
            out["next"] = _complete(server.url, nxt)
            out["after"] = _wait_for(server, "vllm:cachescout_warmed_calls", 1)
        finally:
            server.stop()
            out["log"] = server.log_path.read_text(errors="replace")
    counts = {k.removeprefix("vllm:cachescout_"): v for k, v in out.get("after", {}).items()
              if k.startswith("vllm:cachescout_") and ("warm" in k or "anchor" in k)}
    print("warm-up:", json.dumps(counts))
    return out


def test_a_warm_up_brought_the_reset_anchor_back_from_lmcache(warmed):
    assert warmed["reset"] == {"success": True}
    before, after = warmed["before"], warmed["after"]
    assert before.get("vllm:cachescout_warmups_sent", 0) == 0          # the anchor was on the GPU
    assert after["vllm:cachescout_warmups_sent"] >= 1 and after.get("vllm:cachescout_warmups_failed", 0) == 0
    assert after["vllm:cachescout_warmup_blocks"] >= 8
    assert "Retrieved " in warmed["log"]                                 # LMCache loaded it


def test_the_next_call_found_the_anchor_and_its_output_is_unchanged(warmed):
    after = warmed["after"]
    assert after["vllm:cachescout_warmed_calls"] == 1 and after["vllm:cachescout_warmed_on_gpu"] == 1
    assert warmed["next"] == warmed["reference"]
    # The warm-up taught the policy nothing: it counts the calls alone.
    assert after["vllm:cachescout_requests"] == AGENT_CALLS + 3
