"""`cachescout`: the command line. Errors CacheScout raises on purpose (`CacheScoutError`) and the
file system's become one-line messages and exit codes here, once; anything else is a defect and
shows its traceback."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence

from cachescout.policy import CacheScoutError, ExternalError, InputError

from .args import json_object, number as _number

EXIT_USAGE = 2
EXIT_ERROR = 1


def _parser() -> argparse.ArgumentParser:
    # exit_on_error=False: a bad value becomes one line from main(), not usage text and exit 2 here.
    p = argparse.ArgumentParser(prog="cachescout", description="Agent-aware KV-cache manager for vLLM.",
                                exit_on_error=False)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", add_help=False, help="replay multi-agent workloads and compare eviction policies "
                                                 "(cachescout bench --help lists its flags)")
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
    c.add_argument("--gpu-warmup", action="store_true",
                   help="send GPU warm-ups of predicted anchors to this server (gpu_warmup_url http://127.0.0.1:PORT) "
                        "at the lowest priority (vLLM with --scheduling-policy priority); docs/usage.md")
    c.add_argument("--port", type=_number(1, 65535, integer=True), default=8000,
                   help="the port vLLM serves on (default 8000, vllm serve's own)")
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


def bench_parser() -> argparse.ArgumentParser:
    """`cachescout bench`'s own parser (its flags come from the benchmark, loaded here)."""
    try:
        command = importlib.import_module("cachescout.bench.command")
    except ImportError as exc:
        raise ExternalError(f"the benchmark is not installed here ({exc}); install cachescout[bench] "
                            "(the serving image carries only the operator commands)") from None
    b = argparse.ArgumentParser(prog="cachescout bench", description=command.DESCRIPTION, exit_on_error=False)
    command.add_arguments(b)
    return b


def _state(args: argparse.Namespace) -> int:
    from cachescout.connector.shared_state import SharedStateSettings
    from cachescout.connector.state_admin import collect, open_store, render, reset

    raw = json_object(args.shared_state, "--shared-state")
    raw.update({k: v for k, v in (("url", args.url), ("deployment", args.deployment)) if v is not None})
    settings = SharedStateSettings.from_mapping(raw, "--shared-state")
    try:
        import redis
    except ImportError:
        raise ExternalError("cachescout state needs the redis package: pip install 'cachescout[redis]'") from None
    try:
        store = open_store(settings, args.model)
    except CacheScoutError:
        raise
    except ValueError as exc:   # redis-py refusing what it was given
        raise InputError(f"--shared-state: {exc}") from None
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
        raise ExternalError(f"Redis at {settings.target()}: {type(exc).__name__}: {exc}") from None
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

    extra = json_object(args.settings, "--settings", " (kv_connector_extra_config)")
    tiers = args.cpu_gib > 0 or bool(args.redis_url)
    if args.state_url or args.deployment:
        if not args.state_url:
            raise InputError("--deployment goes with --state-url")
        if "shared_state" in extra:
            raise InputError("give the shared state either in --settings or with --state-url, not both")
        extra["shared_state"] = {"url": args.state_url, "password_env": "CACHESCOUT_STATE_PASSWORD",
                                 **({"deployment": args.deployment} if args.deployment else {})}
    serve_args = f" --port {args.port}" if args.port != 8000 else ""
    if args.gpu_warmup:
        if "gpu_warmup_url" in extra:
            raise InputError("give gpu_warmup_url either in --settings or with --gpu-warmup, not both")
        extra["gpu_warmup_url"] = f"http://127.0.0.1:{args.port}"
        serve_args += " --scheduling-policy priority"
    kvt = kv_transfer_config(extra, lmcache=tiers, cpu_gib=args.cpu_gib)
    yaml = lmcache_yaml(cpu_gib=args.cpu_gib, redis_url=args.redis_url, chunk_size=args.chunk_size) if tiers else None
    env = f"LMCACHE_CONFIG_FILE={shlex.quote(args.lmcache_file)} PYTHONHASHSEED=0 " if tiers else ""
    if args.state_url:
        env = env if tiers else "PYTHONHASHSEED=0 "
        print("# Every replica needs the same PYTHONHASHSEED and the state store's password in "
              "$CACHESCOUT_STATE_PASSWORD.")
    print("# Start vLLM with CacheScout" + (" and LMCache's CPU/Redis tiers" if tiers else "") + ":")
    print(f"{env}vllm serve {shlex.quote(args.model)}{serve_args} --kv-transfer-config {shlex.quote(json.dumps(kvt))}")
    print("\n# kv_transfer_config, readable:")
    print(json.dumps(kvt, indent=2))
    if yaml is not None:
        print(f"\n# LMCache configuration, to save as {args.lmcache_file} (PYTHONHASHSEED must be the same on "
              "every replica that shares Redis: LMCache's chunk keys use Python's hash):")
        print(yaml, end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    try:
        if command == "bench":
            parser = bench_parser()
            args = parser.parse_args(argv[1:])
            args.command = "bench"
        else:
            args = _parser().parse_args(argv)
    except argparse.ArgumentError as exc:
        print(f"cachescout: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CacheScoutError as exc:
        print(f"cachescout {command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        if args.command == "bench":
            return importlib.import_module("cachescout.bench.command").run(args)
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
    except (CacheScoutError, OSError) as exc:
        print(f"cachescout {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_ERROR
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
