"""The MX scale rule of each format: a measured default table, per-run overrides, and lookups.

An MX block's shared exponent is chosen by a rule (mfqat.quant.reference.mx_shared_exponent):
``floor`` (OCP: floor(log2 amax) - emax, the block maximum may saturate) or ``ceil`` (the smallest
exponent at which nothing saturates). Which is better depends on the format: post-training
perplexity of SmolLM2-135M on two held-out texts (scripts/bench/bench_scale_rule.py, BENCHMARKS.md
"Scale rules") decides :data:`DEFAULT_SCALE_RULE`; a format absent from it uses floor.

One resolved table ({format: rule} for every MX format) is what training (MFQATLinear, both
roundings of train-through-anchor), anchors (``mfqat.json`` / config.json ``scale_rules``),
Slice-and-Scale on load, the exporters and MLX use, so a format is quantized the same way
everywhere.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

from mfqat.formats import FORMATS, canonical_name, get_format
from mfqat.quant.reference import SCALE_RULES

# Measured defaults (scripts/bench/bench_scale_rule.py, BENCHMARKS.md "Scale rules"): a format is listed only
# where its rule beat floor on BOTH held-out texts, direct and via Slice-and-Scale, by a clear margin.
# mxfp4: ceil 26.5 / 33.6 vs floor 29.1 / 36.5 direct, 24.8 / 25.8 vs 28.5 / 28.9 sliced (pydoc / licence).
# Floor kept: every MXINT format (ceil is worse: mxint4 33.6 vs 26.6, mxint3 2503 vs 488); mxfp8_e4m3 and
# mxfp6_e2m3 (ceil ahead by 0.2-2.7% direct, identical when sliced from a floor MXFP8 anchor).
DEFAULT_SCALE_RULE: Dict[str, str] = {"mxfp4_e2m1": "ceil"}

# Formats whose output-aware scale search (export-mlx --scale-search) beat the default rule on both texts
# when lowering an MXINT8 anchor (mxint3: 94 / 136 vs 464 / 692); MXFP formats lost to theirs.
SCALE_SEARCH_FORMATS = ("mxint6", "mxint5", "mxint4", "mxint3")

# The rule name of that search in a scale_rules table: training through the anchor then searches with the
# importance it records, and the anchor stores it (docs/numerics.md). Allowed for the formats below an
# 8-bit anchor of either family (trained in, the MXFP formats' search is measured separately from the
# post-training one above: BENCHMARKS.md "Joint MF-QAT", MXFP family).
SEARCH_RULE = "search"
SEARCH_RULE_FORMATS = (*SCALE_SEARCH_FORMATS, "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4_e2m1")
SEARCH_ANCHORS = ("mxint8", "mxfp8_e4m3")  # the anchors a searched format trains through

MX_FORMATS = tuple(name for name, f in FORMATS.items() if f.is_mx)


def check_scale_rules(rules: object, where: str = "scale_rules") -> Dict[str, str]:
    """Validate {format: rule} (aliases allowed) and return it with canonical format names."""
    if not isinstance(rules, Mapping):
        raise ValueError(f"{where}: expected a mapping {{format: rule}}, got {type(rules).__name__}")
    out: Dict[str, str] = {}
    for fmt, rule in rules.items():
        try:
            name = canonical_name(fmt)
        except (KeyError, ValueError, AttributeError):
            name = None
        if name not in MX_FORMATS:
            raise ValueError(f"{where}: {fmt!r} is not an MX format; scale rules apply to {list(MX_FORMATS)}")
        if rule == SEARCH_RULE and name not in SEARCH_RULE_FORMATS:
            raise ValueError(f"{where}[{fmt!r}]: the '{SEARCH_RULE}' rule is for {list(SEARCH_RULE_FORMATS)} only "
                             "(lowered from an 8-bit anchor of their family); use floor or ceil")
        if rule not in SCALE_RULES and rule != SEARCH_RULE:
            raise ValueError(f"{where}[{fmt!r}]: unknown scale rule {rule!r}; choose one of "
                             f"{(*SCALE_RULES, SEARCH_RULE)}")
        out[name] = rule
    return out


def resolve_scale_rules(scale_rule: str = "floor", overrides: Optional[Mapping[str, str]] = None
                        ) -> Dict[str, str]:
    """{format: rule} for every MX format: ``overrides`` first; then, while ``scale_rule`` is floor
    (the default), the measured :data:`DEFAULT_SCALE_RULE`; else ``scale_rule`` for every format."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"unknown scale_rule {scale_rule!r}; choose one of {SCALE_RULES}")
    base = {f: (DEFAULT_SCALE_RULE.get(f, "floor") if scale_rule == "floor" else scale_rule) for f in MX_FORMATS}
    return {**base, **check_scale_rules(overrides or {})}


def rule_of(rules: Optional[Mapping[str, str]], fmt: str, fallback: str = "floor") -> str:
    """The rule of ``fmt`` in a resolved table, or ``fallback`` when there is no table or entry."""
    return rules.get(fmt, fallback) if rules else fallback


def recorded_scale_rules(rules: Mapping[str, str], anchor_format: str) -> Dict[str, str]:
    """The part of a resolved table an anchor records: its own format and every format it slices to."""
    a = get_format(anchor_format)
    return {name: rules.get(name, "floor") for name in MX_FORMATS
            if FORMATS[name].family == a.family and FORMATS[name].bits <= a.bits}


def anchor_rules(anchor_format: str, scale_rule: str = "floor",
                 table: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """What ``save_anchor`` records: ``table`` (a prepared model's or the caller's, else the measured
    defaults; ``scale_rule`` as in :func:`resolve_scale_rules`), with a non-floor ``scale_rule`` also
    setting the anchor format's own rule, cut to the anchor's family (:func:`recorded_scale_rules`)."""
    rules = resolve_scale_rules(scale_rule, table)
    if scale_rule != "floor":
        rules[get_format(anchor_format).name] = scale_rule
    return recorded_scale_rules(rules, anchor_format)


def anchor_scale_rules(meta: Mapping) -> Dict[str, str]:
    """The rules an anchor's formats are sliced with: its ``scale_rules`` (mfqat.json), or, for an
    anchor written before per-format rules (none recorded), floor for every lower format (what
    Slice-and-Scale then did) and the anchor's own ``scale_rule`` for its format."""
    rules = dict(meta.get("scale_rules") or {})
    if not rules:
        rules = dict.fromkeys(MX_FORMATS, "floor")
    rules[meta["anchor_format"]] = meta.get("scale_rule", "floor")
    return rules
