"""Issue 47: never overwrite or delete what a user has; refuse bad input before the work.

Outputs go through one guard (mfqat.storage.guard): never inside, equal to or above an input, an
existing folder only when it is the command's own earlier output and --overwrite is given, a file
mfqat did not write never replaced, a leftover deleted only when it carries mfqat's mark.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mfqat
from mfqat.cli import main
from mfqat.data.sources import tiny_llama, tiny_tokenizer


def _one_line_exit_2(argv, capsys, expect):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, err
    assert err.startswith(f"mfqat {argv[0]}: error: ") and "\n" not in err and expect in err, err
    return err


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture(scope="module")
def anchor(tmp_path_factory):
    d = tmp_path_factory.mktemp("outputs")
    tok = tiny_tokenizer()
    return mfqat.save_anchor(tiny_llama(vocab_size=len(tok), tie=True), d / "anchor", "mxint8", tok)


# --- leftovers are ours before they are removed ----------------------------------------------------------------

def test_a_user_folder_named_like_a_leftover_partial_is_kept(tmp_path, caplog):
    pid = dead_pid()
    user = tmp_path / f".a.{pid}-deadbeef.partial"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    killed = tmp_path / f".a.{pid}-0badc0de.partial"  # what a killed save leaves: the mark names its PID
    (killed / ".mfqat-partial").mkdir(parents=True)
    (killed / ".mfqat-partial" / "pid").write_text(str(pid))
    wrong = tmp_path / f".a.{pid}-0badf00d.partial"  # a mark naming another PID is not the writer's
    (wrong / ".mfqat-partial").mkdir(parents=True)
    (wrong / ".mfqat-partial" / "pid").write_text(str(pid + 1))
    backup = tmp_path / f".a.old-{pid}"  # named like a backup, but no anchor
    backup.mkdir()
    (backup / "notes.txt").write_text("mine")
    mfqat.save_anchor(tiny_llama(), tmp_path / "a")
    assert (user / "thesis.tex").read_text() == "years of work"
    assert (backup / "notes.txt").read_text() == "mine" and wrong.is_dir()
    assert not killed.exists()
    assert f"left {user.name}" in caplog.text and "carries no mark" in caplog.text
    assert not (tmp_path / "a" / ".mfqat-partial").exists(), "the mark must not end up in the artifact"
