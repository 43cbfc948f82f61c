"""`cachescout` command line. Errors become one-line messages and non-zero exit codes here, once."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

EXIT_USAGE = 2
EXIT_ERROR = 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cachescout", description="Agent-aware KV-cache manager for vLLM.")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="replay multi-agent workloads and compare eviction policies",
                       description="Replay the built-in multi-agent workloads on a vLLM-semantics prefix cache "
                                   "and compare policies on the same trace, cache size and run.")
    b.add_argument("--workloads", default="gsm8k,mtbench,gaia,swebench",
                   help="comma-separated task families (default: all four)")
    b.add_argument("--policies", default="lru,cachescout,cachescout-hints,oracle",
                   help="comma-separated policies (default lru,cachescout,cachescout-hints,oracle)")
    b.add_argument("--sessions", type=int, default=300, help="sessions per workload (default 300)")
    b.add_argument("--rate", type=float, default=2.0, help="session arrivals per second (default 2)")
    b.add_argument("--routing", default="learned", help="learned, uniform or random (default learned)")
    b.add_argument("--arrivals", default="poisson", help="poisson or bursty (default poisson)")
    b.add_argument("--seed", type=int, default=1)
    b.add_argument("--gpu-blocks", type=int, default=None,
                   help="GPU cache size in blocks (default: sized per workload so LRU hits about 68%%)")
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument("--cpu-blocks", type=int, default=0,
                   help="LMCache CPU tier size in blocks for every policy but lru (default 0: none)")
    b.add_argument("--redis-blocks", type=int, default=0, help="Redis tier size in blocks (default 0: none)")
    b.add_argument("--cpu-ratio", type=float, default=0.0,
                   help="CPU tier as a multiple of each workload's GPU cache (instead of --cpu-blocks)")
    b.add_argument("--redis-ratio", type=float, default=0.0, help="Redis tier as a multiple of the GPU cache")
    b.add_argument("--cost-profile", default="llama3.1-8b-h200",
                   help="step-time profile from bench/data/cost_profiles.json (default llama3.1-8b-h200)")
    b.add_argument("--trace", default=None, help="replay this JSONL trace (.jsonl or .jsonl.gz) instead")
    b.add_argument("--trace-block-size", type=int, default=512,
                   help="block size of trace records without 'block_size' (default 512, as Mooncake)")
    b.add_argument("--strict-trace", action="store_true", help="reject a trace with any malformed line")
    b.add_argument("--export-trace", default=None, metavar="DIR",
                   help="write each built-in workload's calls to DIR/<workload>.jsonl")
    b.add_argument("--json", default="results.json", help="where to write results (default results.json)")
    b.add_argument("--plots", default="results.png", help="where to write the PNG plots (default results.png)")
    b.add_argument("--no-sweeps", action="store_true", help="skip the cache-size and load sweeps (and the plots)")
    b.add_argument("--ttft-budget-ms", type=float, default=1000.0,
                   help="p99 TTFT budget for the load sustained (default 1000)")
    b.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                   help="workloads replayed in parallel processes (default: the CPU count, at most 4)")
    b.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def _bench(args: argparse.Namespace) -> int:
    from .policies import REGISTRY
    from .replay import CostProfile
    from .run import BenchOptions, run
    from .workloads import FAMILIES, ROUTINGS

    families = [f for f in args.workloads.split(",") if f]
    policies = [p for p in args.policies.split(",") if p]
    for f in families:
        if f not in FAMILIES:
            raise ValueError(f"--workloads: unknown workload {f!r}; choose from {', '.join(FAMILIES)}")
    for name in policies:
        if name not in REGISTRY:
            raise ValueError(f"--policies: unknown policy {name!r}; choose from {', '.join(sorted(REGISTRY))}")
    if args.routing not in ROUTINGS:
        raise ValueError(f"--routing must be one of {', '.join(ROUTINGS)}, got {args.routing!r}")
    if (args.sessions < 1 or args.rate <= 0 or args.block_size < 1
            or (args.gpu_blocks is not None and args.gpu_blocks < 1)):
        raise ValueError("--sessions, --rate, --block-size and --gpu-blocks must be positive")
    if min(args.cpu_blocks, args.redis_blocks, args.cpu_ratio, args.redis_ratio) < 0:
        raise ValueError("--cpu-blocks, --redis-blocks, --cpu-ratio and --redis-ratio must be >= 0")
    CostProfile.named(args.cost_profile)   # an unknown name fails here, listing the known ones
    if args.trace_block_size < 1:
        raise ValueError("--trace-block-size must be a positive integer")
    if args.trace and args.export_trace:
        raise ValueError("--export-trace writes the built-in workloads; it cannot be combined with --trace")
    opts = BenchOptions(families=families, policies=policies, sessions=args.sessions, rate=args.rate,
                        routing=args.routing, arrivals=args.arrivals, seed=args.seed,
                        gpu_blocks=args.gpu_blocks, block_size=args.block_size, trace=args.trace,
                        trace_block_size=args.trace_block_size, strict_trace=args.strict_trace,
                        export_trace=args.export_trace, cpu_blocks=args.cpu_blocks,
                        redis_blocks=args.redis_blocks, cpu_ratio=args.cpu_ratio,
                        redis_ratio=args.redis_ratio, cost_profile=args.cost_profile,
                        sweeps=not args.no_sweeps, ttft_budget_ms=args.ttft_budget_ms,
                        plots=None if args.no_sweeps else args.plots, jobs=max(1, args.jobs))
    progress = None if args.quiet else _progress_line
    report = run(opts, progress)
    if not args.quiet:
        sys.stderr.write("\r\033[K")
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    print(f"wrote {args.json}" + ("" if args.no_sweeps else f" and {args.plots}"))
    return 0


def _progress_line(text: str) -> None:
    sys.stderr.write("\r\033[K" + text)
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "bench":
            return _bench(args)
    except KeyboardInterrupt:
        print("cachescout: interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"cachescout {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_ERROR
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
