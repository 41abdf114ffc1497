"""load_anchor(..., calib=...) and `mfqat eval --scale-search`: the output-aware scale search in PyTorch."""
import pytest
import torch

import mfqat
from mfqat.cli import main
from mfqat.data.sources import calibration_blocks, tiny_llama, tiny_tokenizer
from mfqat.anchor.importance import importance_matrix


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    """(tokenizer, MXINT8 anchor, MXFP8 anchor, calibration blocks) of a tiny Llama with heavy-tailed
    weights: blocks where floor is not the best exponent."""
    d = tmp_path_factory.mktemp("search")
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(tok), tie=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(torch.rand_like(p) ** 3 * 4)
    int8 = mfqat.save_anchor(model, d / "int8", "mxint8", tok)
    fp8 = mfqat.save_anchor(model, d / "fp8", "mxfp8", tok)
    return tok, int8, fp8, calibration_blocks(tok, None, n_blocks=4, seq_len=64)


def linear_weights(model):
    return {f"{n}.weight": m.weight.detach().clone() for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and "layers" in n}


@pytest.mark.parametrize("fmt", ["mxint4", "mxint3"])
def test_calibrated_load_is_the_weighted_search_of_each_block(heavy, fmt):
    _, int8, _, calib = heavy
    got = linear_weights(mfqat.load_anchor(int8, fmt, calib=calib))
    importance = importance_matrix(mfqat.load_anchor(int8), calib)  # measured in the anchor's own format
    anchor = mfqat.read_anchor(int8)
    changed = 0
    for name, q in anchor.quantized.items():
        imp = importance[name[: -len(".weight")]]
        want = mfqat.slice_and_scale(q, fmt, "search", imp).dequantize(torch.float32)
        assert torch.equal(got[name], want), name
        changed += not torch.equal(want, mfqat.slice_and_scale(q, fmt, "floor").dequantize(torch.float32))
    assert changed > 0  # the search moved some blocks away from floor
    plain = linear_weights(mfqat.load_anchor(int8, fmt))
    assert all(torch.equal(plain[n], mfqat.slice_and_scale(q, fmt).dequantize(torch.float32))
               for n, q in anchor.quantized.items())  # without calib: the recorded rule, untouched


@pytest.mark.parametrize("which,fmt", [("int8", "mxint8"), ("int8", None), ("fp8", "mxfp4"), ("int8", "affine4")])
def test_formats_the_search_does_not_serve_keep_their_rule_and_say_so(heavy, which, fmt):
    _, int8, fp8, calib = heavy
    path = int8 if which == "int8" else fp8
    with pytest.warns(UserWarning, match="scale search is not used for") as caught:
        model = mfqat.load_anchor(path, fmt, calib=calib)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert model.mfqat_scale_search == {"formats": [], "tensors": 0}
    got, want = linear_weights(model), linear_weights(mfqat.load_anchor(path, fmt))
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_calib_must_be_token_ids_of_the_anchors_vocabulary(heavy):
    _, int8, _, calib = heavy
    for bad in (calib.float(), calib[0], calib[:0], calib.bool()):
        with pytest.raises(ValueError, match=r"calib: expected token ids of shape \(blocks, seq_len\)"):
            mfqat.load_anchor(int8, "mxint4", calib=bad)
    with pytest.raises(ValueError, match="tokenize the calibration text with the anchor's own tokenizer"):
        mfqat.load_anchor(int8, "mxint4", calib=calib + 10 ** 6)
    with pytest.raises(ValueError, match="unknown format .mxint9."):
        mfqat.load_anchor(int8, "mxint9", calib=calib)


def test_a_searched_load_reports_what_it_searched(heavy):
    _, int8, _, calib = heavy
    rep = mfqat.load_anchor(int8, "mxint4", calib=calib).mfqat_scale_search
    assert rep["formats"] == ["mxint4"] and rep["tensors"] == 14 and rep["calibration_tokens"] == calib.numel()
    assert mfqat.load_anchor(int8, "mxint4").mfqat_scale_search is None


def test_eval_scale_search_changes_the_searched_formats_only(heavy, tmp_path, capsys):
    _, int8, _, _ = heavy
    rows = {}
    for flag in ([], ["--scale-search"]):
        main(["eval", str(int8), "--formats", "mxint8,mxint4", "--blocks", "2", "--seq-len", "64",
              "--plot", str(tmp_path / "p.png"), "--overwrite", *flag])
        out = capsys.readouterr().out
        rows[bool(flag)] = {line.split("|")[1].strip(): line for line in out.splitlines()
                            if line.startswith("|") and "mxint" in line}
    assert "scale search: mxint4 lowered with the output-aware per-block exponent (14 tensors" in out
    assert rows[True]["mxint8"] == rows[False]["mxint8"]  # the anchor's own format: never searched
    assert rows[True]["mxint4"] != rows[False]["mxint4"]


@pytest.mark.parametrize("argv,expect", [
    (["eval", "{hf}", "--scale-search"], "--scale-search lowers an anchor"),
    (["eval", "{int8}", "--calib-text", "{hf}"], "add --scale-search"),
    (["convert", "{int8}", "--to", "mxint8", "--scale-search", "--out", "{d}/c"], "--to mxint8 is not searched"),
    (["convert", "{int8}", "--scale-search", "--out", "{d}/c"], "--to (the anchor format) is not searched"),
    (["convert", "{int8}", "--to", "mxint4", "--calib-text", "{hf}", "--out", "{d}/c"], "add --scale-search"),
])
def test_scale_search_flag_mistakes_exit_2_before_loading(heavy, tmp_path, capsys, argv, expect):
    tok = tiny_tokenizer()
    tiny_llama(vocab_size=len(tok)).save_pretrained(tmp_path / "hf")
    argv = [x.format(hf=tmp_path / "hf", int8=heavy[1], d=tmp_path) for x in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and expect in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_convert_scale_search_writes_the_calibrated_weights(heavy, tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    tok, int8, _, _ = heavy
    main(["convert", str(int8), "--to", "mxint3", "--scale-search", "--out", str(tmp_path / "c")])
    got = linear_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "c"))
    want = linear_weights(mfqat.load_anchor(int8, "mxint3", calib=calibration_blocks(tok, None, n_blocks=8)))
    floor = linear_weights(mfqat.load_anchor(int8, "mxint3"))
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert any(not torch.equal(got[n], floor[n]) for n in want)
    assert json.loads((tmp_path / "c" / "mfqat_convert.json").read_text())["scale_search"] is True
