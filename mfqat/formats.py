"""One registry of element formats: MXINT-k, MXFP ExMy (OCP Microscaling), NVFP4, NF4 and affine.

Also the bitsandbytes baselines: ``nf4_dq`` (NF4 with double quantization of the absmax, as
``quantize_4bit(compress_statistics=True)``) and ``int8_absmax`` (symmetric 127/absmax per block;
any block size, so per row / per tensor by choosing the row / tensor length).

``nvfp4`` is NVIDIA's 4-bit float: E2M1 elements (the mxfp4 grid), one E4M3 (float8_e4m3fn) scale per
16 consecutive elements, an optional float32 per-tensor ``global_scale`` (mfqat.quant.nvfp4 has the rule).

Every format knows its bit width, its family (Slice-and-Scale converts only inside a family),
its largest element exponent ``emax``, its largest normal value and its code range. Names are
lower case; ``mxfp8`` means ``mxfp8_e4m3`` and ``mxfp6`` means ``mxfp6_e2m3`` (docs/numerics.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Dict, Tuple, Union

MX_BLOCK_SIZES: Tuple[int, ...] = (8, 16, 32, 64, 128, 256)
NVFP4_BLOCK = 16  # NVIDIA's block (MLX mode "nvfp4" takes group 16 only)
NF4_BLOCK_SIZES: Tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)
AFFINE_GROUP_SIZES: Tuple[int, ...] = (32, 64, 128)
DQ_GROUP = 256  # double quantization: absmax values per 8-bit group (bitsandbytes)

# The QLoRA NF4 code book (normal-float quantiles), as in bitsandbytes.
NF4_CODEBOOK: Tuple[float, ...] = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


@dataclass(frozen=True)
class ElementFormat:
    """An element format and its block-scaling convention.

    Attributes:
        name: canonical lower-case name (``mxint4``, ``mxfp6_e2m3``, ``nf4``, ``affine4``).
        family: ``mxint``, ``mxfp``, ``nvfp4``, ``nf4`` or ``affine``.
        bits: bits per stored element code.
        emax: exponent of the largest power of two below the max normal (0 for MXINT).
        max_normal: largest representable element magnitude.
        ebits, mbits, bias: exponent / mantissa bits and exponent bias (MXFP only).
        code_min, code_max: range of the stored integer codes (bit patterns for MXFP).
        default_block_size: block (group) size used when none is given.
        block_sizes: block sizes the format allows (empty: any positive size).
        double_quant: NF4 only: the absmax are themselves 8-bit quantized (bitsandbytes).
        group: a grouped affine format's own MLX group (``affine3@g128``: 128, whatever group its caller
            asks for); 0 for every other format (the caller's group applies).
    """

    name: str
    family: str
    bits: int
    emax: int = 0
    max_normal: float = 0.0
    ebits: int = 0
    mbits: int = 0
    bias: int = 0
    code_min: int = 0
    code_max: int = 0
    default_block_size: int = 32
    block_sizes: Tuple[int, ...] = field(default=MX_BLOCK_SIZES)
    double_quant: bool = False
    group: int = 0

    @property
    def is_mx(self) -> bool:
        """True for formats with a shared E8M0 power-of-two scale per block."""
        return self.family in ("mxint", "mxfp")

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal element (MXFP); subnormals sit below it."""
        return 1 - self.bias

    @property
    def int_shift(self) -> int:
        """MXINT: codes carry an implicit 2^-(bits-2) (the element scale)."""
        return self.bits - 2

    def bits_per_weight(self, block_size: int | None = None) -> float:
        """Storage cost per element including the shared scales (and biases)."""
        bs = self.default_block_size if block_size is None else block_size
        if self.is_mx or self.family == "nvfp4":  # one 8-bit scale per block (E8M0; E4M3 for nvfp4)
            return self.bits + 8.0 / bs
        if self.family == "nf4" and self.double_quant:
            return self.bits + (8.0 + 32.0 / DQ_GROUP) / bs  # 8-bit absmax + fp32 per 256 of them
        if self.family in ("nf4", "absmax"):
            return self.bits + 32.0 / bs
        return self.bits + 32.0 / bs  # affine: 16-bit scale + 16-bit bias per group

    def resolve_block_size(self, block_size: int | None) -> int:
        """``block_size``, or the format's default when it is None (0 is an error, not "default")."""
        bs = self.default_block_size if block_size is None else block_size
        self.check_block_size(bs)
        return bs

    def check_block_size(self, block_size: int) -> None:
        """Raise ValueError when ``block_size`` is not allowed for this format."""
        if not self.block_sizes:
            if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
                raise ValueError(f"block_size={block_size} is not allowed for format '{self.name}'; "
                                 f"give a positive integer (the row length for per-row scales)")
            return
        if isinstance(block_size, bool) or block_size not in self.block_sizes:
            raise ValueError(
                f"block_size={block_size} is not allowed for format '{self.name}'; "
                f"allowed block sizes: {list(self.block_sizes)}"
            )

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.name


def _mxint(k: int) -> ElementFormat:
    qmax = 2 ** (k - 1) - 1
    return ElementFormat(
        name=f"mxint{k}", family="mxint", bits=k, emax=0,
        max_normal=qmax / 2 ** (k - 2), code_min=-qmax, code_max=qmax,
    )


def _mxfp(name: str, ebits: int, mbits: int, bias: int, max_normal: float, emax: int) -> ElementFormat:
    bits = 1 + ebits + mbits
    return ElementFormat(
        name=name, family="mxfp", bits=bits, emax=emax, max_normal=max_normal,
        ebits=ebits, mbits=mbits, bias=bias, code_min=0, code_max=2 ** bits - 1,
    )


def _affine(k: int) -> ElementFormat:
    return ElementFormat(
        name=f"affine{k}", family="affine", bits=k, code_min=0, code_max=2 ** k - 1,
        default_block_size=64, block_sizes=AFFINE_GROUP_SIZES,
    )


FORMATS: Dict[str, ElementFormat] = {}
for _k in range(2, 9):
    FORMATS[f"mxint{_k}"] = _mxint(_k)
for _f in (
    _mxfp("mxfp8_e4m3", 4, 3, 7, 448.0, 8),
    _mxfp("mxfp8_e5m2", 5, 2, 15, 57344.0, 15),
    _mxfp("mxfp6_e3m2", 3, 2, 3, 28.0, 4),
    _mxfp("mxfp6_e2m3", 2, 3, 1, 7.5, 2),
    _mxfp("mxfp4_e2m1", 2, 1, 1, 6.0, 2),
):
    FORMATS[_f.name] = _f
# NVFP4: E2M1 elements (ebits/mbits/bias/emax/max_normal as mxfp4_e2m1), E4M3 block scales, block 16 only.
FORMATS["nvfp4"] = ElementFormat(
    name="nvfp4", family="nvfp4", bits=4, emax=2, max_normal=6.0, ebits=2, mbits=1, bias=1,
    code_min=0, code_max=15, default_block_size=NVFP4_BLOCK, block_sizes=(NVFP4_BLOCK,),
)
FORMATS["nf4"] = ElementFormat(
    name="nf4", family="nf4", bits=4, max_normal=1.0, code_min=0, code_max=15,
    default_block_size=64, block_sizes=NF4_BLOCK_SIZES,
)
FORMATS["nf4_dq"] = ElementFormat(
    name="nf4_dq", family="nf4", bits=4, max_normal=1.0, code_min=0, code_max=15,
    default_block_size=64, block_sizes=NF4_BLOCK_SIZES, double_quant=True,
)
FORMATS["int8_absmax"] = ElementFormat(
    name="int8_absmax", family="absmax", bits=8, max_normal=127.0, code_min=-127, code_max=127,
    default_block_size=64, block_sizes=(),
)
for _k in range(2, 9):
    FORMATS[f"affine{_k}"] = _affine(_k)

ALIASES: Dict[str, str] = {"mxfp8": "mxfp8_e4m3", "mxfp6": "mxfp6_e2m3", "mxfp4": "mxfp4_e2m1"}
GROUP_MARK = "@g"  # affine3@g128: affine3 stored in groups of 128, whatever the export's --group-size

FormatLike = Union[str, ElementFormat]


def known_formats() -> list[str]:
    """All names the registry accepts (canonical names and aliases)."""
    return sorted(FORMATS) + sorted(ALIASES)


def get_format(fmt: FormatLike) -> ElementFormat:
    """Look a format up by name or alias (case-insensitive); ElementFormat passes through."""
    if isinstance(fmt, ElementFormat):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"format must be a name or ElementFormat, got {type(fmt).__name__}")
    key = fmt.strip().lower()
    key = ALIASES.get(key, key)
    if GROUP_MARK in key:
        return _grouped_format(key, fmt)
    if key not in FORMATS:
        raise ValueError(f"unknown format '{fmt}'; known formats: {', '.join(known_formats())}")
    return FORMATS[key]


@lru_cache(maxsize=None)
def _grouped_format(key: str, given: str) -> ElementFormat:
    """``affineK@gN``: affine K bits in MLX groups of N (one of AFFINE_GROUP_SIZES), its own group."""
    base, _, group = key.partition(GROUP_MARK)
    if base not in FORMATS or FORMATS[base].family != "affine" or not group.isdigit() \
            or int(group) not in AFFINE_GROUP_SIZES:
        raise ValueError(f"unknown format '{given}'; a grouped format is an affine width and an MLX group, "
                         f"affineK@gN with N one of {', '.join(map(str, AFFINE_GROUP_SIZES))} (e.g. affine3@g128)")
    n = int(group)
    return replace(FORMATS[base], name=f"{base}{GROUP_MARK}{n}", default_block_size=n, block_sizes=(n,), group=n)


def grouped(fmt: FormatLike, group: int) -> str:
    """The name of affine format ``fmt`` held in groups of ``group`` whatever group its caller asks for
    (``grouped("affine3", 128)`` -> ``affine3@g128``)."""
    return get_format(f"{base_name(fmt)}{GROUP_MARK}{group}").name


def base_name(fmt: FormatLike) -> str:
    """The canonical name without a grouped format's group (``affine3@g128`` -> ``affine3``)."""
    return get_format(fmt).name.partition(GROUP_MARK)[0]


def canonical_name(fmt: FormatLike) -> str:
    """The canonical name of a format or alias (``mxfp4`` -> ``mxfp4_e2m1``)."""
    return get_format(fmt).name


def short_name(fmt: FormatLike) -> str:
    """The short user-facing name (``mxfp4_e2m1`` -> ``mxfp4``, ``mxfp8_e4m3`` -> ``mxfp8``)."""
    name = canonical_name(fmt)
    for alias, target in ALIASES.items():
        if target == name:
            return alias
    return name


def check_sliceable(src: FormatLike, dst: FormatLike, name: str = "tensor") -> None:
    """Raise ValueError unless ``dst`` is reachable from ``src`` by Slice-and-Scale."""
    s, d = get_format(src), get_format(dst)
    if not (s.is_mx and d.is_mx) or s.family != d.family:
        raise ValueError(
            f"{name}: cannot slice {s.name} to {d.name}: Slice-and-Scale stays inside one MX "
            f"family (mxint -> mxint, mxfp -> mxfp); save an anchor in the {d.family} family instead"
        )
    if d.bits > s.bits:
        raise ValueError(
            f"{name}: cannot slice {s.name} up to {d.name}: an anchor gives formats at or below "
            f"its own {s.bits} bits"
        )
