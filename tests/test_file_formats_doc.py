"""docs/file-formats.md names every field mfqat's writers emit (issue 33 item 16): a field added to a writer
without its line in the doc fails here. The files are written by the real writers, not listed by hand."""
import json
import re
from pathlib import Path

import pytest

import mfqat
from mfqat.data.sources import tiny_llama, tiny_tokenizer

DOC = Path(__file__).resolve().parents[1] / "docs" / "file-formats.md"


def section(title: str) -> str:
    """The text of the doc's section whose heading contains ``title`` (up to the next heading of its level)."""
    text = DOC.read_text()
    m = re.search(rf"^(#+) [^\n]*{re.escape(title)}[^\n]*\n", text, re.M)
    assert m, f"docs/file-formats.md has no section '{title}'"
    level = len(m.group(1))
    end = re.search(rf"^#{{1,{level}}} ", text[m.end():], re.M)
    return text[m.end(): m.end() + end.start() if end else len(text)]


def undocumented(keys, text: str) -> list:
    return [k for k in keys if f"`{k}`" not in text]


@pytest.fixture(scope="module")
def anchor(tmp_path_factory):
    tok = tiny_tokenizer()
    return mfqat.save_anchor(tiny_llama(vocab_size=len(tok), tie=True), tmp_path_factory.mktemp("doc") / "a",
                             "mxint8", tok, step=3)


def test_every_mfqat_json_field_is_in_the_doc(anchor):
    meta = json.loads((anchor / "mfqat.json").read_text())
    assert not undocumented(meta, section("`mfqat.json`"))


def test_every_mfqat_convert_json_field_is_in_the_doc(anchor, tmp_path):
    from mfqat.cli import main

    main(["convert", str(anchor), "--out", str(tmp_path / "c"), "--to", "mxint4"])
    meta = json.loads((tmp_path / "c" / "mfqat_convert.json").read_text())
    assert not undocumented(meta, section("Converted checkpoint"))


def test_every_training_checkpoint_file_and_step_field_is_in_the_doc(tmp_path):
    from mfqat.train.loop import main as train_main

    out = tmp_path / "run"
    train_main(["--model", "tiny", "--steps", "1", "--seq-len", "16", "--batch-size", "2", "--eval-blocks", "1",
                "--qat-config", "fixed_mxint4", "--save-every", "1", "--out", str(out)])
    ck = out / "checkpoint-1"
    doc = section("Training checkpoints")
    step = json.loads((ck / "mfqat_step.json").read_text())
    assert not undocumented(step, doc)
    assert not undocumented(step["run"], doc)
    names = [p.name for p in ck.iterdir()]
    assert not [n for n in names if n not in doc], names
    scheduler = json.loads((ck / "mfqat_scheduler.json").read_text())
    assert not undocumented([k for k in scheduler if not k.startswith("_")], doc)


def test_every_mfqat_export_json_field_is_in_the_doc(anchor, tmp_path):
    pytest.importorskip("mlx_lm")
    from mfqat.export import to_mlx

    to_mlx(anchor, tmp_path / "x", recipe="uniform:mxint4")
    meta = json.loads((tmp_path / "x" / "mfqat_export.json").read_text())
    assert not undocumented(meta, section("`mfqat_export.json`"))
