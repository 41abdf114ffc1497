"""Steps that still load a whole model are refused up front when they cannot fit (mfqat.memory.check_fits):
``export-mlx`` from a source that does not map tensor by tensor, ``convert`` of a family transformers converts on
save, ``eval`` of a plain HF model. The boundary is the least each holds - its weights in the dtype it loads them,
as many copies as it keeps, and the libraries - so a budget one byte short is refused, naming the step, and
nothing is written; the exact budget is not."""
import pytest
import torch
from safetensors.torch import load_file, save_file

import mfqat
from mfqat.cli.app import main
from mfqat.data.sources import tiny_llama, tiny_tokenizer
from mfqat.memory import LIBRARY_BYTES, BudgetError, check_fits
from mfqat.models.catalog import SUPPORTED, build


def test_check_fits_refuses_past_the_budget_with_the_step_and_sizes():
    check_fits("step", 100, LIBRARY_BYTES + 100)
    with pytest.raises(BudgetError, match=r"^step needs at least 0\.5 GiB, over --max-memory \(0\.5 GiB\); nothing "
                                          r"was written: do this"):
        check_fits("step", 100, LIBRARY_BYTES + 99, "do this")
    check_fits("step", 10 ** 15, 0)  # an unknown budget: no check


@pytest.fixture(scope="module")
def old_folder(tmp_path_factory):
    """A tiny Llama saved as older checkpoints were, in a ``pytorch_model.bin``: transformers loads it, mfqat cannot
    read it tensor by tensor (no safetensors headers: the size is the model's parameters, from its config)."""
    tok = tiny_tokenizer()
    root = tmp_path_factory.mktemp("old")
    model = tiny_llama(vocab_size=len(tok))
    model.save_pretrained(root / "src")
    tensors = load_file(root / "src" / "model.safetensors")
    (root / "old").mkdir()
    torch.save(tensors, root / "old" / "pytorch_model.bin")
    (root / "old" / "config.json").write_text((root / "src" / "config.json").read_text())
    tok.save_pretrained(root / "old")
    return root / "old", sum(p.numel() for p in model.parameters())


def test_an_export_that_must_load_the_model_is_refused_one_byte_short(old_folder, tmp_path):
    pytest.importorskip("mlx_lm")
    from mfqat.export import to_mlx

    folder, numel = old_folder
    need = 4 * numel + LIBRARY_BYTES  # the float32 model
    with pytest.raises(BudgetError, match=r"export-mlx: .* does not map tensor by tensor \(no safetensors weights\)"
                                          r".*loading it whole in float32 needs at least .* over --max-memory"):
        to_mlx(folder, tmp_path / "m", recipe="uniform:mxint4", max_memory=need - 1)
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m*"))
    rep = to_mlx(folder, tmp_path / "m", recipe="uniform:mxint4", max_memory=need, verify=False)
    assert rep["ptq"].startswith("loaded model")


def test_convert_of_a_family_loaded_whole_is_refused_one_byte_short(tmp_path, capsys):
    from mfqat.anchor.dequantized import why_not_streamed
    from mfqat.export.mlx_sizes import anchor_parameters

    model_type, extra = SUPPORTED["gpt_neox"]
    path = mfqat.save_anchor(build(model_type, extra, 256), tmp_path / "a", "mxint8", tiny_tokenizer())
    anchor = mfqat.read_anchor(path, lazy=True)
    assert why_not_streamed(anchor) is not None  # GPT-NeoX's fused qkv: converted on save
    need = 8 * anchor_parameters(anchor) + LIBRARY_BYTES  # the float32 state dict and model
    with pytest.raises(SystemExit) as e:
        main(["convert", str(path), "--to", "mxint4", "--out", str(tmp_path / "c"), "--max-memory", str(need - 1)])
    assert e.value.code == 2 and not (tmp_path / "c").exists()
    assert "convert: " in capsys.readouterr().err
    main(["convert", str(path), "--to", "mxint4", "--out", str(tmp_path / "c"), "--max-memory", str(need)])
    assert (tmp_path / "c" / "mfqat_convert.json").is_file()


def test_eval_of_an_hf_model_is_refused_one_byte_short(tmp_path, capsys):
    from mfqat.anchor.tensors import default_targets

    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok))
    model.to(torch.bfloat16).save_pretrained(tmp_path / "src")
    tok.save_pretrained(tmp_path / "src")
    params = dict(model.named_parameters())
    numel = sum(p.numel() for p in params.values()) + sum(params[k].numel() for k in default_targets(model, 32))
    need = 2 * numel + LIBRARY_BYTES  # the bfloat16 model and a copy of its targets
    args = ["eval", str(tmp_path / "src"), "--formats", "mxint4", "--blocks", "2", "--seq-len", "32", "--dtype",
            "bfloat16", "--plot", str(tmp_path / "p.png")]
    with pytest.raises(SystemExit) as e:
        main(args + ["--max-memory", str(need - 1)])
    assert e.value.code == 2 and "eval: " in capsys.readouterr().err and not (tmp_path / "p.png").exists()
    main(args + ["--max-memory", str(need)])
    assert (tmp_path / "p.png").is_file()


def test_eval_compare_is_refused_before_anything_runs_when_its_float32_model_cannot_fit(tmp_path, capsys, monkeypatch):
    """``eval ANCHOR --compare --fp-model FP`` loads FP whole in float32 after the anchor's rows: refused up front,
    one byte short of that model and a copy of its targets, before the anchor's evaluation is spent."""
    from mfqat.anchor.tensors import default_targets
    from mfqat.data import sources

    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok))
    model.to(torch.bfloat16).save_pretrained(tmp_path / "fp")
    tok.save_pretrained(tmp_path / "fp")
    anchor = mfqat.save_anchor(model, tmp_path / "a", "mxint8", tok)
    params = dict(model.named_parameters())
    need = 4 * (sum(p.numel() for p in params.values()) + sum(params[k].numel() for k in default_targets(model, 32)))
    need += LIBRARY_BYTES
    args = ["eval", str(anchor), "--formats", "mxint4", "--blocks", "2", "--seq-len", "32", "--compare",
            "--fp-model", str(tmp_path / "fp"), "--plot", str(tmp_path / "p.png")]
    with pytest.raises(SystemExit) as e:
        main(args + ["--max-memory", str(need - 1)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "eval --compare/--bnb: " in err and "ppl" not in err
    assert not (tmp_path / "p.png").exists()
    loads = []
    real = sources.load_model
    monkeypatch.setattr(sources, "load_model", lambda *x, **k: loads.append(x) or real(*x, **k))
    main(args + ["--bnb", "nf4", "--max-memory", str(need)])
    assert (tmp_path / "p.png").is_file()
    assert len(loads) == 1, "--compare and --bnb loaded the full-precision model twice"
    out = capsys.readouterr().out
    assert "bnb_nf4" in out and "direct ppl" in out


def test_convert_scale_search_is_refused_before_its_calibration_pass(tmp_path, capsys, monkeypatch):
    """A convert that will be refused for memory says so before ``--scale-search``'s calibration pass runs (the
    pass over the whole model would otherwise be spent first)."""
    from mfqat.anchor import search

    model_type, extra = SUPPORTED["gpt_neox"]
    path = mfqat.save_anchor(build(model_type, extra, 256), tmp_path / "a", "mxint8", tiny_tokenizer())

    def refuse(*a, **k):
        raise AssertionError("the calibration pass ran before the memory check")
    monkeypatch.setattr(search, "search_scales", refuse)
    with pytest.raises(SystemExit) as e:
        main(["convert", str(path), "--to", "mxint4", "--scale-search", "--out", str(tmp_path / "c"),
              "--max-memory", "1"])
    assert e.value.code == 2 and "convert: " in capsys.readouterr().err and not (tmp_path / "c").exists()


VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                                3512.
Pages active:                            240170.
Pages inactive:                          236818.
Pages speculative:                         1902.
Pages throttled:                              0.
Pages wired down:                        130431.
Pages purgeable:                            842.
"Translation faults":                1290873245.
Pages copy-on-write:                   53460281.
Pages zero filled:                    544391127.
Pages reactivated:                     34221233.
Pages purged:                           3372845.
File-backed pages:                       127436.
Anonymous pages:                         351454.
Pages stored in compressor:              663107.
Pages occupied by compressor:            193394.
"""


def test_macos_available_memory_is_its_free_inactive_and_speculative_pages():
    """A Mac has no /proc/meminfo: the default budget is vm_stat's free, inactive and speculative pages at its page
    size (16 KiB on Apple silicon), not the pages 'wired', 'active', 'purgeable' (counted in active/inactive too),
    'purged' (a counter) or the compressor's."""
    from mfqat.memory import darwin_available

    assert darwin_available(VM_STAT) == 16384 * (3512 + 236818 + 1902)
    assert darwin_available(VM_STAT.replace("16384", "4096")) == 4096 * (3512 + 236818 + 1902)
    with pytest.raises(ValueError, match="vm_stat"):
        darwin_available("Mach Virtual Memory Statistics:\nPages active: 5.\n")
