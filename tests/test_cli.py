"""The `mfqat` command a user expects: --version, help without torch, one-line errors (exit 2),
HF / mlx-lm flag aliases, JSON-lines datasets, --tokenizer, chat-template generation."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mfqat
from mfqat.cli import main
from mfqat.data.sources import tiny_llama, tiny_tokenizer

from .conftest import one_line_exit_2

ROOT = Path(__file__).resolve().parents[1]
CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


def _cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "mfqat.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=600)


def test_version_and_help_do_not_import_torch():
    code = ("import sys\nfrom mfqat.cli import main\nfor a in (['--version'], ['--help'], ['train', '--help'], "
            "['eval', '--help']):\n    try: main(a)\n    except SystemExit as e: assert e.code == 0, a\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert run.returncode == 0, run.stderr
    assert f"mfqat {mfqat.__version__}" in run.stdout
    assert "usage: mfqat train" in run.stdout and "--output-dir" in run.stdout and "--max-steps" in run.stdout


@pytest.fixture(scope="module")
def anchors(tmp_path_factory):
    """An anchor with a tokenizer, one without (trained with use_cache off), and the tokenizer folder."""
    d = tmp_path_factory.mktemp("cli")
    tok = tiny_tokenizer()
    tok.save_pretrained(d / "tok")
    model = tiny_llama(vocab_size=len(tok), tie=True)
    model.config.use_cache = False  # what gradient checkpointing leaves behind
    with_tok = mfqat.save_anchor(model, d / "anchor", "mxint8", tok)
    without = mfqat.save_anchor(model, d / "bare", "mxint8")
    return with_tok, without, d / "tok"


@pytest.mark.parametrize("argv,expect", [
    (["convert", "{d}/nope", "--out", "{d}/o"], "not an mfqat anchor"),
    (["convert", "{anchor}", "--to", "mxint9", "--out", "{d}/o"], "unknown format 'mxint9'"),
    (["eval", "{anchor}", "--compare"], "--fp-model"),
    (["eval", "--model", "{d}/missing"], "no such model folder"),
    (["export-mlx", "{bare}", "--out", "{d}/x"], "--tokenizer"),
    (["train", "--model", "tiny", "--text", "{d}/missing.txt"], "--text"),
    (["train", "--text", "{d}/a.txt", "--dataset", "{d}/b.jsonl"], "not both"),
    (["verify", "{d}"], "is not an mfqat anchor"),
    (["generate", "{anchor}", "--prompt", "hi"], "export-mlx"),
])
def test_user_mistakes_are_one_line_exit_2(anchors, tmp_path, capsys, argv, expect):
    anchor, bare, _ = anchors
    argv = [a.format(d=tmp_path, anchor=anchor, bare=bare) for a in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2
    assert err.startswith(f"mfqat {argv[0]}: error: ") and "\n" not in err and expect in err, err


@pytest.mark.parametrize("cmd", ["convert", "export-mlx", "eval", "generate", "serve", "mlx-train"])
def test_cli_model_given_twice_the_same_is_one_model_two_different_are_refused(anchors, tmp_path, capsys, cmd):
    """`mfqat CMD X --model X` is `mfqat CMD X` (the next check names X, not a second model); `mfqat CMD X
    --model Y` is one line, exit 2, before anything loads."""
    anchor, bare, _ = anchors
    extra = {"convert": ["--to", "mxint4", "--out", str(tmp_path / "o")], "export-mlx": ["--out", str(tmp_path / "o")],
             "generate": ["--prompt", "hi"]}.get(cmd, [])
    with pytest.raises(SystemExit) as e:
        main([cmd, str(anchor), "--model", str(bare), *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == f"mfqat {cmd}: error: two models given ({anchor} and --model {bare}); give one"
    missing = str(tmp_path / "missing")
    with pytest.raises(SystemExit) as e:
        main([cmd, missing, "--model", missing, *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "two models" not in err and "missing" in err, err
    assert not (tmp_path / "o").exists()


def test_cli_convert_with_the_anchor_as_positional_and_as_model_converts_it(anchors, tmp_path):
    anchor = anchors[0]
    main(["convert", str(anchor), "--model", str(anchor), "--to", "mxint4", "--out", str(tmp_path / "o")])
    assert json.loads((tmp_path / "o" / "mfqat_convert.json").read_text())["format"] == "mxint4"


def test_runtime_user_error_is_one_line_and_debug_shows_traceback(anchors, tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "mfqat.json").write_text("{not json")
    run = _cli("verify", str(tmp_path / "broken"))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().startswith("mfqat verify: error:") and len(run.stderr.strip().splitlines()) == 1
    run = _cli("verify", str(tmp_path / "broken"), MFQAT_DEBUG="1")
    assert "Traceback" in run.stderr


def test_hf_and_mlx_lm_aliases():
    from mfqat.train.args import build_parser

    a = build_parser().parse_args(["--output-dir", "o", "--max-steps", "7", "--learning-rate", "0.1"])
    b = build_parser().parse_args(["--save-path", "o", "--iters", "7", "--lr", "0.1"])
    assert (a.out, a.steps, a.lr) == (b.out, b.steps, b.lr) == ("o", 7, 0.1)


def test_anchor_config_is_marked_and_carries_a_model_card(anchors):
    anchor, _, _ = anchors
    cfg = json.loads((anchor / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mfqat"
    assert cfg["quantization_config"]["format"] == "mxint8" and cfg["quantization_config"]["block_size"] == 32
    assert cfg["use_cache"] is True
    card = (anchor / "README.md").read_text()
    assert card.startswith("---") and "mfqat" in card and "load_anchor" in card
    model = mfqat.load_anchor(anchor, "mxint4")  # the marked config still loads, and is not re-marked
    assert not hasattr(model.config, "quantization_config") or model.config.quantization_config is None
    main(["verify", str(anchor)])


def test_load_model_loads_an_anchor_as_an_anchor_and_refuses_missing_weights(anchors, tmp_path):
    from mfqat.data.sources import load_model

    anchor, bare, _ = anchors
    model, tok = load_model(str(anchor))
    ref = mfqat.load_anchor(anchor)
    for (k, v), w in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(v, w), k
    with pytest.raises(ValueError, match="tokenizer"):
        load_model(str(bare))
    # an HF folder whose weights file lacks layers: an error, not random weights
    from safetensors.torch import load_file, save_file
    plain = tmp_path / "plain"
    tiny_llama(vocab_size=len(tok), tie=True).save_pretrained(plain)
    tok.save_pretrained(plain)
    sd = {k: v for k, v in load_file(plain / "model.safetensors").items() if "layers.1." not in k}
    save_file(sd, plain / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="random weights"):
        load_model(str(plain))


def test_jsonl_datasets(tmp_path):
    from mfqat.data.jsonl import training_texts

    tok = tiny_tokenizer()
    tok.chat_template = CHAT
    f = tmp_path / "d.jsonl"
    rows = [{"text": "plain words"}, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"prompt": "Q?", "completion": " A."}] * 20
    f.write_text("\n".join(json.dumps(r) for r in rows))
    train, held = training_texts(str(f), None, tok)  # a .jsonl given as --text: read as a dataset
    text = train + held
    assert "{" not in text and "plain words" in text and "<|user|>hi" in text and "Q? A." in text
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "train.jsonl").write_text(json.dumps({"text": "train part"}))
    (tmp_path / "dir" / "valid.jsonl").write_text(json.dumps({"text": "valid part"}))
    assert training_texts(None, str(tmp_path / "dir"), tok) == ("train part", "valid part")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no 'text'"):
        training_texts(None, str(tmp_path / "bad.jsonl"), tok)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        training_texts(None, str(f), tok)


def test_train_on_a_jsonl_dataset_logs_to_accelerate_trackers(tmp_path):
    from accelerate.tracking import GeneralTracker

    from mfqat.train.loop import main as train_main

    class Tracker(GeneralTracker):  # accelerate's API for custom trackers (what --report-to names build)
        name, requires_logging_directory, main_process_only = "record", False, True

        def __init__(self):
            super().__init__()
            self.config, self.logged, self.finished = None, [], False

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            self.config = values

        def log(self, values, step=None, **kw):
            self.logged.append((step, dict(values)))

        def finish(self):
            self.finished = True

    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"record {i} " + "words " * 40}) for i in range(40)))
    rec = Tracker()
    s = train_main(["--model", "tiny", "--dataset", str(f), "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                    "--eval-blocks", "2", "--output-dir", str(tmp_path / "run"), "--formats", "mxint8",
                    "--eval-formats", "mxint8"], trackers=[rec])
    assert len(s["losses"]) == 2 and (tmp_path / "run" / "anchor" / "README.md").is_file()
    assert rec.config["steps"] == 2 and rec.finished
    assert [st for st, v in rec.logged if "train/loss" in v] == [1, 2]
    assert rec.logged[1][1]["train/loss"] == pytest.approx(s["losses"][1])
    assert rec.logged[-1][1]["eval/mxint8_ppl"] == pytest.approx(s["eval"][0]["perplexity"])


def test_export_mlx_with_tokenizer_flag_and_model_card(anchors, tmp_path, capsys):
    pytest.importorskip("mlx_lm")
    _, bare, tok_dir = anchors
    main(["export-mlx", "--model", str(bare), "--tokenizer", str(tok_dir), "--save-path", str(tmp_path / "x"),
          "--recipe", "uniform:mxint4"])
    out = tmp_path / "x"
    assert (out / "tokenizer.json").is_file() and "library_name: mlx" in (out / "README.md").read_text()
    main(["verify", str(out)])
    from mfqat.export import to_mlx
    from mfqat.storage.manifest import AnchorError
    with pytest.raises(AnchorError, match="tokenizer"):
        to_mlx(bare, tmp_path / "y", recipe="uniform:mxint4", verify=False)
    assert not (tmp_path / "y").exists()


def test_generate_applies_the_chat_template_as_mlx_lm_does(anchors, tmp_path):
    pytest.importorskip("mlx_lm")
    from mlx_lm import load
    from mlx_lm.generate import generate as mlx_generate

    from mfqat.mlx.serve import generate

    anchor, _, _ = anchors
    main(["export-mlx", str(anchor), "--out", str(tmp_path / "m"), "--recipe", "uniform:mxint8", "--no-verify"])
    cfg = tmp_path / "m" / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "chat_template": CHAT}))
    model, tok = load(str(tmp_path / "m"))
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Python is"}], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)
    want = mlx_generate(model, tok, prompt=ids, max_tokens=8)
    assert generate(str(tmp_path / "m"), "Python is", 8) == want
    raw = mlx_generate(model, tok, prompt=tok.encode("Python is"), max_tokens=8)
    assert generate(str(tmp_path / "m"), "Python is", 8, chat_template=False) == raw
    a = generate(str(tmp_path / "m"), "Python is", 8, temp=1.0, seed=3)
    assert a == generate(str(tmp_path / "m"), "Python is", 8, temp=1.0, seed=3)


def test_mlx_train_reads_mlx_lm_data_folder(tmp_path):
    pytest.importorskip("mlx_lm")
    tok = tiny_tokenizer()
    model_dir = tmp_path / "hf"
    tiny_llama(vocab_size=len(tok), tie=True).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("\n".join(json.dumps({"text": f"train {i} " + "alpha beta " * 30})
                                                for i in range(30)))
    (data / "valid.jsonl").write_text("\n".join(json.dumps({"prompt": "Q: ", "completion": "gamma delta " * 30})
                                                for _ in range(10)))
    main(["mlx-train", "--model", str(model_dir), "--data", str(data), "--formats", "mxint8", "--iters", "2",
          "--batch-size", "2", "--seq-len", "32", "--eval-blocks", "2", "--save-path", str(tmp_path / "run"),
          "--eval-formats", "mxint8"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and (tmp_path / "run" / "anchor" / "README.md").is_file()
    with pytest.raises(SystemExit) as e:
        main(["mlx-train", str(model_dir), "--data", str(tmp_path / "nodata"), "--out", str(tmp_path / "r2")])
    assert e.value.code == 2 and "--data" in str(e.value)


@pytest.mark.parametrize("argv, expect", [
    (["bench", "--formats", "mxint4,nope"], "--formats: unknown format 'nope'"),
    (["bench", "--formats", "", "--through", "mxint8-mxint4"], "give ANCHOR:FORMAT pairs"),
    (["bench", "--formats", "", "--through", "mxint8:nope"], "--through: unknown format 'nope'"),
])
def test_bench_refuses_unknown_formats_in_one_line(argv, expect, capsys):
    one_line_exit_2(argv, capsys, expect)
