"""`mfqat eval --bnb nf4,int8`: bitsandbytes NF4 (double quant) and LLM.int8 rows next to the MX formats."""
import pytest
import torch

from mfqat.cli import main
from mfqat.data.sources import tiny_llama, tiny_tokenizer

pytest.importorskip("bitsandbytes")


def test_rows_are_the_bnb_models_and_differ_from_fp(tiny_dir):
    from transformers import AutoModelForCausalLM

    from mfqat.eval.bnb import bnb_rows, load_quantized
    from mfqat.eval.perplexity import perplexity
    from mfqat.train.lora import bnb_config

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    blocks = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    fp = perplexity(model, blocks)
    rows = {r["format"]: r for r in bnb_rows(model, {b: bnb_config(b) for b in ("nf4", "int8")}, blocks)}
    assert list(rows) == ["bnb_nf4", "bnb_int8"]
    assert rows["bnb_nf4"]["bits/weight"] == pytest.approx(4.127, abs=1e-3)
    # one fp32 absmax per row: 8 + 32 * rows / weights over q/k/v/o (64x64), gate/up (128x64), down (64x128)
    assert rows["bnb_int8"]["bits/weight"] == pytest.approx(8 + 32 * (4 * 64 + 2 * 128 + 64) / (4 * 64 * 64 + 3 * 64 * 128))
    q = load_quantized(model, bnb_config("nf4"))
    assert type(q.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    assert rows["bnb_nf4"]["perplexity"] == perplexity(q, blocks)  # the row is that model's
    for r in rows.values():
        assert r["perplexity"] != fp
    assert abs(rows["bnb_int8"]["perplexity"] - fp) < abs(rows["bnb_nf4"]["perplexity"] - fp)


def test_cli_table_has_bnb_rows_beside_mx(tiny_dir, tmp_path, capsys):
    main(["eval", str(tiny_dir), "--formats", "mxint8,mxint4", "--bnb", "nf4,int8", "--blocks", "2",
          "--seq-len", "16", "--plot", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    names = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert names[1:] == ["mxint8", "mxint4", "bnb_nf4", "bnb_int8"] and (tmp_path / "p.png").is_file()


@pytest.mark.parametrize("extra,expect", [(["--bnb", "nf3"], "--bnb nf3: choose from nf4, int8"),
                                          (["--bnb", "nf4", "ANCHOR"], "give the model it came from as --fp-model")])
def test_bad_bnb_flags_are_usage_errors(tiny_dir, tmp_path, capsys, extra, expect):
    import mfqat

    model = str(tiny_dir)
    if "ANCHOR" in extra:
        extra = extra[:-1]
        model = str(mfqat.save_anchor(tiny_llama(vocab_size=len(tiny_tokenizer())), tmp_path / "a", "mxint8",
                                      tokenizer=tiny_tokenizer()))
    with pytest.raises(SystemExit) as e:
        main(["eval", model, *extra])
    assert e.value.code == 2 and expect in capsys.readouterr().err
