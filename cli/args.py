"""Argument types shared by every `cachescout` command."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, integer: bool = False):
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


def json_object(text: str, flag: str, what: str = "") -> dict:
    """`text` parsed as a JSON object, or an InputError naming `flag`."""
    import json

    from cachescout.policy import InputError

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{flag} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InputError(f"{flag} must be a JSON object{what}, got {text!r:.80}")
    return value


def setting_flags(cls: Any, prefix: str = "--") -> list[tuple[str, str, dataclasses.Field]]:
    """(flag, dest, field) for every `setting` field of a settings class that is a flag: the
    field's name after `prefix`, dashed, unless the setting names its own flag or none."""
    from cachescout.policy import settings_of

    out = []
    for name, f in settings_of(cls).items():
        flag = f.metadata["flag"]
        if flag is False:
            continue
        flag = flag if isinstance(flag, str) else prefix + name.replace("_", "-")
        out.append((flag, flag.removeprefix("--").replace("-", "_"), f))
    return out


def add_setting_flags(parser: argparse._ActionsContainer, cls: Any, prefix: str = "--",
                      metavars: dict[str, str] | None = None) -> None:
    """One flag per `setting` field of `cls` (see setting_flags): its type, range or choices checked
    as it is parsed, its meaning the help, its default the field's."""
    for flag, dest, f in setting_flags(cls, prefix):
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        m = f.metadata
        doc = m["doc"].replace("%", "%%")
        if kind == "bool":
            parser.add_argument(flag, dest=dest, action="store_true", help=doc)
            continue
        shown = "" if f.default is None or "(default" in doc else (
            f" (default {f.default:g})" if isinstance(f.default, (int, float)) else f" (default {f.default})")
        base = kind.removesuffix(" | None")
        parse = (number(m["lo"], m["hi"], lo_open=m["lo_open"], integer=base == "int")
                 if base in ("int", "float") else str)
        parser.add_argument(flag, dest=dest, type=parse, default=f.default, choices=m["choices"],
                            metavar=(metavars or {}).get(f.name), help=doc + shown)


def setting_values(args: argparse.Namespace, cls: Any, prefix: str = "--") -> dict[str, Any]:
    """The values `add_setting_flags(parser, cls, prefix)` parsed, by field name: `cls(**them)`."""
    return {f.name: getattr(args, dest) for _, dest, f in setting_flags(cls, prefix)}
