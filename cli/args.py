"""Argument types shared by every `cachescout` command."""

from __future__ import annotations

import argparse
import math


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
