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


def _source_of(block, tok) -> str:
    chars = set(tok.decode(block.tolist()))  # "alpha " and "beta " share only "a" and the space
    return "alpha" if not chars & set("bet") else "beta" if not chars & set("lph") else "both"


@pytest.mark.parametrize("n_blocks, want", [(4, ["alpha", "alpha", "beta", "alpha"]), (8, None)])
def test_calibration_blocks_of_a_mix_are_in_proportion_from_the_first_block(two, n_blocks, want):
    """The consumers take the first few blocks (the sensitivity pass 4 x 128 tokens, about 2,000
    characters of English): each source must be there in proportion, whole blocks from one source."""
    from mfqat.data.sources import calibration_blocks, tiny_tokenizer

    a, b = two
    tok = tiny_tokenizer()
    blocks = calibration_blocks(tok, mixed_text(f"{a}:3,{b}:1"), n_blocks=n_blocks, seq_len=128)
    got = [_source_of(blk, tok) for blk in blocks]
    assert "both" not in got and got.count("alpha") == 3 * got.count("beta"), got
    if want:
        assert got == want


def test_a_source_shorter_than_a_block_drops_out_and_none_long_enough_is_refused(two, tmp_path):
    from mfqat.data.sources import calibration_blocks, tiny_tokenizer

    a, _ = two
    short = tmp_path / "short.txt"
    short.write_text("beta " * 5)
    tok = tiny_tokenizer()
    blocks = calibration_blocks(tok, mixed_text(f"{a}:1,{short}:1"), n_blocks=4, seq_len=128)
    assert [_source_of(blk, tok) for blk in blocks] == ["alpha"] * 4
    with pytest.raises(ValueError, match="fewer tokens than one block"):
        calibration_blocks(tok, mixed_text(f"{short}:1,{short}:2"), n_blocks=4, seq_len=128)


def test_the_command_lines_calibration_keeps_the_mix(two):
    """The route --calib-text takes (the CLI's mixed_text, then calibration_blocks): both sources in
    the first 8 blocks, as the scale search uses them."""
    from mfqat.cli.commands import calibration_ids
    from mfqat.data.sources import tiny_tokenizer

    a, b = two
    tok = tiny_tokenizer()
    got = [_source_of(blk, tok) for blk in calibration_ids(tok, f"{a}:1,{b}:1")]
    assert got.count("alpha") == got.count("beta") == 4, got


def test_reports_describe_the_calibration_text_without_holding_it(two):
    from mfqat.data.sources import describe_calibration

    a, b = two
    text = mixed_text(f"{a}:1,{b}:1")
    said = describe_calibration(text)
    assert "alpha" not in said and "2 sources" in said and str(len(text)) in said
    assert describe_calibration(None) == "pydoc training split"


@pytest.fixture(scope="module")
def tiny_anchor(tmp_path_factory):
    import torch

    import mfqat
    from mfqat.data.sources import tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    return mfqat.save_anchor(tiny_llama(vocab_size=len(tok)), tmp_path_factory.mktemp("gen") / "a", "mxint8", tok)


def test_the_generated_source_samples_the_model_reproducibly_and_mixes_by_blocks(tiny_anchor):
    """``generated`` is text the model itself samples (fixed seed: the same text twice, another seed
    another text); in a 1:1 mix with pydoc the blocks alternate, pydoc's first, each whole."""
    import torch

    from mfqat.data.generated import generated_text
    from mfqat.data.sources import calibration_blocks, tiny_tokenizer, token_blocks

    one = generated_text(str(tiny_anchor), n_tokens=96, seq_len=32)
    assert one and one == generated_text(str(tiny_anchor), n_tokens=96, seq_len=32)
    assert one != generated_text(str(tiny_anchor), n_tokens=96, seq_len=32, seed=1)
    tok = tiny_tokenizer()
    mix = mixed_text("pydoc:1,generated:1", model=str(tiny_anchor))
    blocks = calibration_blocks(tok, mix, n_blocks=4, seq_len=32)
    pydoc = token_blocks(tok, split_text(load_text(None))[0], 32, max_blocks=2)
    generated = token_blocks(tok, mix.sources[1][0], 32, max_blocks=2)
    assert torch.equal(blocks[0], pydoc[0]) and torch.equal(blocks[2], pydoc[1])
    assert torch.equal(blocks[1], generated[0]) and torch.equal(blocks[3], generated[1])
    assert not torch.equal(pydoc[0], generated[0])


def test_generated_without_a_model_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="needs the model"):
        mixed_text("pydoc:1,generated:1")


def test_generated_is_sized_to_the_blocks_its_consumer_reads_with_the_default_sample_first(tiny_anchor):
    """A consumer that needs 8 generated blocks more than the default 4,096 tokens give (in a 1:2 mix) gets
    them, where before the rest came from pydoc; the default sample comes first, so the first blocks (the
    sensitivity pass's) are the same whatever the size."""
    import math

    import torch

    from mfqat.data.generated import generated_text
    from mfqat.data.sources import calibration_blocks, tiny_tokenizer, token_blocks

    tok = tiny_tokenizer()
    default = mixed_text("pydoc:1,generated:2", model=str(tiny_anchor))
    want = len(token_blocks(tok, default.sources[1][0], 128)) + 8  # generated blocks the consumer needs
    n_blocks = math.ceil(want * 3 / 2)
    sized = mixed_text("pydoc:1,generated:2", model=str(tiny_anchor), n_blocks=n_blocks)
    assert default.sources[1][0] == generated_text(str(tiny_anchor))  # the text it always was
    assert sized.sources[1][0].startswith(default.sources[1][0])
    gen = token_blocks(tok, sized.sources[1][0], 128, max_blocks=want)
    blocks = calibration_blocks(tok, sized, n_blocks=n_blocks)
    from_generated = [any(torch.equal(b, g) for g in gen) for b in blocks]
    assert gen.shape[0] == want and sum(from_generated) == want
    assert from_generated[:3] == [True, False, True]


def test_generated_samples_its_share_of_the_blocks_plus_one_and_a_tenth_never_less_than_the_default():
    from mfqat.data.mix import generated_tokens

    assert generated_tokens(None) == generated_tokens(8) == generated_tokens(256, 0.05) == 4096
    assert generated_tokens(36) == 5210  # 37 blocks of 128, + 10%
    assert generated_tokens(256, 0.5) == 18164 and generated_tokens(256, 2 / 3) == 24218
    assert generated_tokens(192, 2 / 3, seq_len=256) == 36327


def test_export_and_refine_size_generated_text_to_what_they_read(tiny_anchor, tmp_path, monkeypatch):
    """The commands hand ``mixed_text`` the most blocks their steps read: GPTQ's, the refine's + 4 validation."""
    from mfqat.cli.app import main

    seen = []

    def spy(spec, model=None, n_blocks=None):
        seen.append(n_blocks)
        raise RuntimeError("stop after the calibration text")

    monkeypatch.setattr("mfqat.data.mix.mixed_text", spy)
    anchor = tiny_anchor
    for argv in (["export-mlx", str(anchor), "--out", str(tmp_path / "m"), "--recipe", "auto:6:affine", "--gptq",
                  "--gptq-blocks", "64", "--refine-blocks", "96", "--calib-text", "generated"],
                 ["export-mlx", str(anchor), "--out", str(tmp_path / "m"), "--recipe", "uniform:affine4",
                  "--calib-text", "generated"],
                 ["refine", str(anchor), "--calib-text", "generated"],
                 ["export-mlx", str(anchor), "--out", str(tmp_path / "m"), "--recipe", "auto:6:affine",
                  "--sensitivity-blocks", "48", "--calib-text", "generated"]):
        with pytest.raises(RuntimeError, match="stop after"):
            main(argv)
    assert seen == [100, 36, 36, 48]


def test_the_blocks_an_export_reads_size_generated_text():
    """GPTQ reads its ``n_blocks``, the refine ``n_blocks + n_valid``, the scale search 8: the largest wins."""
    from mfqat.export.gptq import GPTQConfig
    from mfqat.export.mlx_export import calibration_blocks_needed
    from mfqat.export.refine import RefineConfig

    assert calibration_blocks_needed(None, None) == 8
    assert calibration_blocks_needed(RefineConfig(), None) == 36
    assert calibration_blocks_needed(RefineConfig(n_blocks=256), GPTQConfig(n_blocks=192)) == 260
    assert calibration_blocks_needed(RefineConfig(), GPTQConfig()) == 256
    assert calibration_blocks_needed(RefineConfig(), None, 40) == 40  # auto:'s sensitivity pass on 40 blocks


def test_the_sensitivity_pass_scores_the_blocks_asked_for(tiny_anchor, tmp_path, capsys):
    """``--sensitivity-blocks 6``: sensitivity.json's calibration tokens are 6 blocks of 128; refused for a recipe
    with no sensitivity pass."""
    import json

    from mfqat.cli.app import main
    from .conftest import one_line_exit_2

    text = tmp_path / "calib.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 400)
    out = tmp_path / "m"
    main(["export-mlx", str(tiny_anchor), "--out", str(out), "--recipe", "auto:6:affine", "--no-refine",
          "--sensitivity-blocks", "6", "--calib-text", str(text), "--no-verify"])
    assert json.loads((out / "sensitivity.json").read_text())["calibration_tokens"] == 6 * 128
    capsys.readouterr()  # the export's progress bars
    one_line_exit_2(["export-mlx", str(tiny_anchor), "--out", str(tmp_path / "u"), "--recipe", "uniform:affine4",
                     "--sensitivity-blocks", "6"], capsys, "--sensitivity-blocks 6 sets auto:BPW's sensitivity pass")
