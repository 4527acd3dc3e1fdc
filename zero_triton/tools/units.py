"""Numbers on the command line: counts with an optional unit suffix, whole numbers,
positive numbers; each an argparse ``type=`` whose error names the fix.

One convention for every command: K, M, G (or B, billions), T are powers of ten, as
parameter counts are quoted (``memory --params 7B`` is 7e9); Ki, Mi, Gi, Ti are powers of
two (``bench --sizes 64Mi`` is 64 * 2**20 elements). Output labels follow the same rule.
Counts parse with ``parse_count``, exactly (Decimal, not float: 7.5e9 and 2**60 + 1 keep
every digit).
"""
from __future__ import annotations

import argparse
import math
import os
from decimal import Decimal, InvalidOperation, localcontext

UNITS = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9, "T": 10**12,
         "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
SUFFIXES = "K/M/G(B)/T = 10**3/10**6/10**9/10**12, Ki/Mi/Gi/Ti = 2**10/2**20/2**30/2**40"
MAX_COUNT = 2**63 - 1  # torch counts elements in int64


def format_count(n: int) -> str:
    """``n`` with the largest suffix that divides it (binary first: 64Mi, then 7B), else
    the digits."""
    for unit in ("Ti", "Gi", "Mi", "Ki", "T", "B", "M", "K"):
        scale = UNITS[unit.upper()]
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def parse_count(text: str, example: str = "7B") -> int:
    """``text`` as a positive int: digits (``_`` separators allowed), a decimal or an
    exponent form (``7.5e9``), optionally followed by a suffix (``7B``, ``1.5K``, ``64Mi``;
    either case; see the module docstring). Raises ``argparse.ArgumentTypeError`` naming
    the fix, so it serves as an argparse ``type=``."""
    number = str(text).strip().replace("_", "")
    scale = 1
    for width in (2, 1):
        suffix = number[-width:].upper() if len(number) > width else ""
        if suffix in UNITS and (width == 2 or suffix != "I"):
            number, scale = number[:-width], UNITS[suffix]
            break
    suffixes = "K, M, G/B, T or Ki, Mi, Gi, Ti"
    try:
        value = Decimal(number)
    except InvalidOperation:
        value = None
    if value is None or not value.is_finite():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number; pass a positive count such as {example} "
            f"(suffixes {suffixes})")
    if value.adjusted() > 30:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; pass a count up to "
                                         f"{MAX_COUNT:.3g}, e.g. {example}")
    with localcontext() as ctx:
        ctx.prec = len(number) + 20  # enough digits for the product to be exact
        value *= scale
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; pass e.g. {example}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not positive; pass a count > 0, "
                                         f"e.g. {example}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; pass a count up to "
                                         f"{MAX_COUNT:.3g}, e.g. {example}")
    return int(value)


def whole_number(minimum: int = 1, example: str = "4"):
    """An argparse type: a whole number >= ``minimum`` (no suffixes)."""
    def parse(text) -> int:
        try:
            value = int(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; pass e.g. {example}") from None
        if value < minimum:
            why = ("is not positive" if minimum == 1 else "is negative" if minimum == 0
                   else f"is less than {minimum}")
            raise argparse.ArgumentTypeError(f"{text!r} {why}; pass a whole number >= {minimum}")
        return value
    return parse


def positive_number(what: str = "number", example: str = "1"):
    """An argparse type: a finite float > 0 (``what`` names it in the error)."""
    def parse(text) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive {what}; pass e.g. {example}")
        return value
    return parse


# A CPU rank is a process with torch loaded and a model to train: about this much memory.
RANK_BYTES = 512 * 2**20


def max_cpu_ranks() -> tuple[int, str]:
    """How many CPU ranks this machine can start (4 per core, and RANK_BYTES of available
    memory each), with the reason in words: commands that spawn ranks check it before
    starting any."""
    cores = os.cpu_count() or 1
    try:
        with open("/proc/meminfo") as fh:
            info = dict(line.split(":", 1) for line in fh)
        avail = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        avail = None
    by_cores = 4 * cores
    by_memory = avail // RANK_BYTES if avail is not None else by_cores
    limit = max(1, min(by_cores, by_memory))
    why = (f"{cores} cores (4 ranks each)" if by_cores <= by_memory else
           f"{avail / 2**30:.1f} GiB of available memory ({RANK_BYTES >> 20} MiB per rank)")
    return limit, why


def rank_count(example: str = "4"):
    """An argparse type: a whole number of CPU ranks, >= 1 and at most what this machine
    can start (``max_cpu_ranks``)."""
    whole = whole_number(1, example)

    def parse(text) -> int:
        value = whole(text)
        limit, why = max_cpu_ranks()
        if value > limit:
            raise argparse.ArgumentTypeError(
                f"{value} ranks are more than this machine can run: at most {limit}, for {why}; "
                f"pass e.g. {min(limit, int(example))}")
        return value
    return parse
