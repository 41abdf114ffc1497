import pytest

import mfqat
from mfqat.formats import FORMATS, get_format, short_name


def test_aliases():
    assert get_format("mxfp8").name == "mxfp8_e4m3"
    assert get_format("MXFP6").name == "mxfp6_e2m3"
    assert get_format("mxfp4").name == "mxfp4_e2m1"
    assert short_name("mxfp4_e2m1") == "mxfp4"


def test_unknown_format_lists_known():
    with pytest.raises(ValueError, match="unknown format 'mxint9'.*mxint8"):
        get_format("mxint9")


@pytest.mark.parametrize("name,bits,emax,maxn", [
    ("mxint8", 8, 0, 127 / 64), ("mxint4", 4, 0, 7 / 4), ("mxint2", 2, 0, 1.0),
    ("mxfp8_e4m3", 8, 8, 448.0), ("mxfp8_e5m2", 8, 15, 57344.0), ("mxfp6_e3m2", 6, 4, 28.0),
    ("mxfp6_e2m3", 6, 2, 7.5), ("mxfp4_e2m1", 4, 2, 6.0),
])
def test_table(name, bits, emax, maxn):
    f = get_format(name)
    assert (f.bits, f.emax, f.max_normal) == (bits, emax, maxn)
    if f.family == "mxfp":
        # max normal is the largest finite pattern (E4M3: S.1111.110, others all ones)
        top = (2 - 2.0 ** -f.mbits) * 2.0 ** f.emax
        if name == "mxfp8_e4m3":
            top = 1.75 * 2 ** 8
        assert f.max_normal == top


def test_registry_has_everything():
    for k in range(2, 9):
        assert f"mxint{k}" in FORMATS and f"affine{k}" in FORMATS
    assert "nf4" in FORMATS
    assert mfqat.get_format("nf4").default_block_size == 64


def test_bits_per_weight():
    assert get_format("mxint4").bits_per_weight(32) == 4.25
    assert get_format("nf4").bits_per_weight(64) == 4.5
