"""A fast smoke run of every demo stage on a tiny Llama saved as an HF folder, plus the CLI."""
import json

import pytest

from mfqat.cli import main as cli
from mfqat.data.sources import tiny_tokenizer
from mfqat.cli.demo import run_demo


def test_demo_smoke(tiny_dir, tmp_path, capsys):
    s = run_demo(str(tmp_path / "demo"), steps=4, eval_blocks=2, model_name=str(tiny_dir))
    assert [r["format"] for r in s["rows"]] == ["mxint8", "mxint6", "mxint5", "mxint4", "mxint3", "mxint2"]
    by = {r["format"]: r for r in s["rows"]}
    assert by["mxint8"]["+ scale search"] is None and by["mxint2"]["+ scale search"] is None
    assert by["mxint3"]["+ scale search"] != by["mxint3"]["MF-QAT ppl"]  # the search moved blocks
    assert (tmp_path / "demo" / "ppl_vs_bpw.png").stat().st_size > 5000
    rows = s["exports"]["rows"]
    assert set(rows) == {"mfqat uniform:affine4 --no-refine", "mfqat uniform:affine4", "mfqat auto:4.7:affine",
                         "mlx_lm q4 g64", "mlx_lm mixed_4_6"}
    refined, plain = rows["mfqat uniform:affine4"], rows["mfqat uniform:affine4 --no-refine"]  # the default refines
    assert refined["refine_steps"] == 64 and rows["mfqat auto:4.7:affine"]["refine_steps"] == 64  # a tiny model: 64
    assert plain["refine_steps"] is None
    assert refined["stored_bits_per_weight"] == pytest.approx(plain["stored_bits_per_weight"], abs=1e-6)
    assert refined["weights_bit_exact"] and refined["perplexity"] != plain["perplexity"]
    ours, theirs = plain, rows["mlx_lm q4 g64"]
    assert ours["stored_bits_per_weight"] == pytest.approx(theirs["stored_bits_per_weight"], abs=5e-3)  # same tensors (file headers differ)
    assert ours["weights_bit_exact"] and ours["completion"]
    assert rows["mfqat auto:4.7:affine"]["stored_bits_per_weight"] <= rows["mlx_lm mixed_4_6"]["stored_bits_per_weight"] + 0.2
    out = capsys.readouterr().out
    assert "MF-QAT ppl" in out and "+ scale search" in out and "mfqat auto:4.7:affine" in out and "mlx_lm mixed_4_6" in out
    assert f"{ours['perplexity']:.3f}"[:5] in out
    # a re-run reuses every stage
    run_demo(str(tmp_path / "demo"), steps=4, eval_blocks=2, model_name=str(tiny_dir))
    assert "reusing" in capsys.readouterr().out


def test_cli_convert_eval_export(tiny_dir, tmp_path, capsys):
    import mfqat
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    anchor = mfqat.save_anchor(model, tmp_path / "anchor", "mxint8", AutoTokenizer.from_pretrained(tiny_dir))
    cli(["convert", str(anchor), "--to", "mxint4", "--out", str(tmp_path / "hf4")])
    m4 = AutoModelForCausalLM.from_pretrained(tmp_path / "hf4")
    ref = mfqat.load_anchor(anchor, "mxint4")
    assert (m4.model.layers[0].mlp.up_proj.weight == ref.model.layers[0].mlp.up_proj.weight).all()
    cli(["eval", str(anchor), "--formats", "mxint8,mxint4", "--blocks", "2", "--plot", str(tmp_path / "p.png"),
         "--compare", "--fp-model", str(tiny_dir)])
    out = capsys.readouterr().out
    assert "mxint4" in out and "direct ppl" in out and (tmp_path / "p.png").is_file()
    cli(["export-mlx", str(anchor), "--out", str(tmp_path / "mlx"), "--recipe", "seed"])
    assert json.loads((tmp_path / "mlx" / "mfqat_export.json").read_text())["verify"]["weights_bit_exact"]
    rep = json.loads((tmp_path / "mlx" / "mfqat_export.json").read_text())
    assert f"stored {rep['stored_bits_per_weight']:.3f} bits/weight on disk" in capsys.readouterr().out


def test_the_embedded_model_is_named_for_what_it_is(tiny_dir, tmp_path, capsys, monkeypatch):
    """Issue 33 item 15: the embedded model is SmolLM2-135M-Instruct's Q4_1 GGUF dequantized, not a
    full-precision model; eval, the demo and --help say so (a tiny model stands in for its weights here)."""
    import mfqat
    from mfqat.data import sources

    real = sources.load_model
    monkeypatch.setattr(sources, "load_model", lambda name=None, **k: real(str(tiny_dir) if name in (None, "smollm2")
                                                                           else name, **k))
    cli(["eval", "smollm2", "--formats", "mxint8", "--blocks", "1", "--plot", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    assert "base (embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float32)) perplexity" in out
    cli(["eval", str(tiny_dir), "--formats", "mxint8", "--blocks", "1", "--plot", str(tmp_path / "p2.png")])
    assert "base (full precision) perplexity" in capsys.readouterr().out
    anchor = mfqat.save_anchor(real(str(tiny_dir))[0], tmp_path / "a", "mxint8", tiny_tokenizer())
    cli(["eval", str(anchor), "--formats", "mxint4", "--blocks", "1", "--plot", str(tmp_path / "p3.png")])
    assert "base (anchor format mxint8) perplexity" in capsys.readouterr().out
    assert sources.model_label(None) == sources.model_label("smollm2") != sources.model_label(str(tiny_dir))
    for cmd in (["demo", "--help"], ["train", "--help"]):
        with pytest.raises(SystemExit):
            cli(cmd)
        assert "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized" in " ".join(capsys.readouterr().out.split())
