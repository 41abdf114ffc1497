"""A slow, exact, pure-Python oracle of the MX rules in docs/numerics.md (Fractions, no torch), for cross-checks."""
from __future__ import annotations

import math
from fractions import Fraction

from mfqat.formats import ElementFormat


def floor_log2_exact(v: Fraction) -> int:
    e = math.floor(math.log2(v)) if v > 0 else 0
    while Fraction(2) ** e > v:
        e -= 1
    while Fraction(2) ** (e + 1) <= v:
        e += 1
    return e


def round_element(y: Fraction, fmt: ElementFormat) -> Fraction:
    if fmt.family == "mxint":
        step = 2 ** fmt.int_shift
        c = max(min(round(y * step), fmt.code_max), fmt.code_min)
        return Fraction(c, step)
    a = abs(y)
    if a == 0:
        return Fraction(0)
    e = max(floor_log2_exact(a), fmt.emin)
    quantum = Fraction(2) ** (e - fmt.mbits)
    q = min(round(a / quantum) * quantum, Fraction(fmt.max_normal))
    return q if y > 0 else -q


def fake_quantize_block(values: list[float], fmt: ElementFormat) -> list[float]:
    """OCP floor rule for one block of finite floats; returns exact dequantized floats."""
    amax = max(abs(Fraction(v)) for v in values)
    if amax == 0:
        return [0.0 for _ in values]
    s = max(min(floor_log2_exact(amax) - fmt.emax, 127), -127)
    x = Fraction(2) ** s
    return [float(round_element(Fraction(v) / x, fmt) * x) for v in values]
