"""--calib-text mixes: several sources with weights, in proportion from the first token."""
import subprocess
import sys

import pytest

from mfqat.data.mix import mixed_text, parse_mix
from mfqat.data.sources import load_text, split_text


@pytest.fixture
def two(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("alpha " * 20000)
    b.write_text("beta " * 20000)
    return a, b


def test_parse_mix_reads_weights_and_refuses_bad_ones():
    assert parse_mix("a.txt:2,b.txt") == [("a.txt", 2.0), ("b.txt", 1.0)]
    assert parse_mix("notes/:0.5, pydoc") == [("notes/", 0.5), ("pydoc", 1.0)]
    for bad in ("a.txt:-1", "a.txt:0", ","):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_the_mix_is_in_proportion_from_its_first_characters_and_keeps_everything(two):
    a, b = two
    text = mixed_text(f"{a}:3,{b}:1")
    head = text[:40000].split()
    ratio = sum(w == "alpha" for w in head) * 6 / (sum(w == "beta" for w in head) * 5)  # per character
    assert 2.7 < ratio < 3.3, ratio
    assert sorted(text.split()) == sorted((a.read_text() + b.read_text()).split())  # no word lost or split


def test_one_source_is_read_as_before_and_pydoc_is_its_training_split(two):
    a, _ = two
    assert mixed_text(str(a)) == load_text(str(a))
    train, held = split_text(load_text(None))
    assert mixed_text("pydoc") == train and held[-2000:] not in mixed_text("pydoc:1,pydoc:1")


@pytest.mark.parametrize("spec, message", [("missing.txt:2", "missing.txt: no such"), ("{a}:-2", "positive")])
def test_export_refuses_a_bad_mix_before_any_work(spec, message, two, tmp_path):
    spec = spec.format(a=two[0])
    p = subprocess.run([sys.executable, "-m", "mfqat", "export-mlx", "tiny", "--out", str(tmp_path / "o"),
                        "--recipe", "auto:4.5", "--calib-text", spec], capture_output=True, text=True)
    assert p.returncode == 2 and message in p.stderr, p.stderr[-500:]
    assert not (tmp_path / "o").exists()
