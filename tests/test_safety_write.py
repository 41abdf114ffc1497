"""Issue 13, data loss: refuse foreign outputs, swap atomically, recover after kill -9, one writer."""
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import mfqat
from mfqat.anchor.checkpoint import AnchorError, read_anchor
from mfqat.cli import main as cli_main
from mfqat.data.sources import tiny_llama

from .conftest import dead_pid

ROOT = Path(__file__).resolve().parents[1]


def strays(folder: Path) -> list:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture
def model():
    return tiny_llama()


def test_save_refuses_a_user_folder_and_a_file(model, tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match="mine"):
            mfqat.save_anchor(model, user, overwrite=overwrite)
    assert (user / "notes.txt").read_text() == "keep me" and len(list(user.iterdir())) == 1
    f = tmp_path / "file"
    f.write_text("data")
    with pytest.raises(FileExistsError, match="file"):
        mfqat.save_anchor(model, f, overwrite=True)
    assert f.read_text() == "data" and strays(tmp_path) == []


def test_overwrite_needs_the_flag(model, tmp_path):
    path = mfqat.save_anchor(model, tmp_path / "a", step=1)
    with pytest.raises(FileExistsError, match="overwrite") as e:
        mfqat.save_anchor(model, path, step=2)
    assert "--force" not in str(e.value)
    assert read_anchor(path).meta["step"] == 1
    mfqat.save_anchor(model, path, step=2, overwrite=True)
    assert read_anchor(path).meta["step"] == 2 and strays(tmp_path) == []
    (tmp_path / "empty").mkdir()
    mfqat.save_anchor(model, tmp_path / "empty")  # an empty folder is fine


def test_convert_never_writes_over_its_input_or_the_cwd(model, tmp_path, monkeypatch):
    anchor = mfqat.save_anchor(model, tmp_path / "a")
    with pytest.raises(SystemExit, match="input"):
        cli_main(["convert", str(anchor), "--to", "mxint4", "--out", str(anchor), "--overwrite"])
    read_anchor(anchor)
    with pytest.raises(SystemExit):
        cli_main(["convert", str(anchor), "--to", "mxint4", "--out", str(anchor / "inside"), "--overwrite"])
    assert not (anchor / "inside").exists()
    work = tmp_path / "work"
    work.mkdir()
    (work / "thesis.tex").write_text("years of work")
    monkeypatch.chdir(work)
    with pytest.raises(SystemExit, match="current directory"):
        cli_main(["convert", str(anchor), "--to", "mxint4", "--out", ".", "--overwrite"])
    assert (work / "thesis.tex").read_text() == "years of work"
    out = tmp_path / "hf4"
    cli_main(["convert", str(anchor), "--to", "mxint4", "--out", str(out)])
    with pytest.raises(SystemExit, match="--overwrite"):
        cli_main(["convert", str(anchor), "--to", "mxint4", "--out", str(out)])
    cli_main(["convert", str(anchor), "--to", "mxint2", "--out", str(out), "--overwrite"])
    assert json.loads((out / "mfqat_convert.json").read_text())["format"] == "mxint2"


def test_failed_final_rename_puts_the_old_anchor_back(model, tmp_path, monkeypatch):
    path = mfqat.save_anchor(model, tmp_path / "a", step=1)
    real = os.replace

    def flaky(src, dst, *a, **k):
        if str(src).endswith(".partial") and Path(dst) == path.absolute():
            raise OSError("disk on fire")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(OSError, match="disk on fire"):
        mfqat.save_anchor(model, path, step=2, overwrite=True)
    monkeypatch.undo()
    assert read_anchor(path).meta["step"] == 1 and strays(tmp_path) == []


def test_next_save_recovers_a_crash_between_the_renames(model, tmp_path, caplog):
    path = mfqat.save_anchor(model, tmp_path / "a", step=1)
    pid = dead_pid()
    os.replace(path, tmp_path / f".a.old-{pid}")  # killed after moving the old anchor away
    (tmp_path / f".a.{pid}-0badc0de.partial" / ".mfqat-partial").mkdir(parents=True)  # as mark_partial left it
    (tmp_path / f".a.{pid}-0badc0de.partial" / ".mfqat-partial" / "pid").write_text(str(pid))
    (tmp_path / f".a.{pid}-0badc0de.partial" / "model.safetensors").write_bytes(b"half")
    with pytest.raises(FileExistsError):  # the old anchor is back, so a plain save refuses
        mfqat.save_anchor(model, path, step=2)
    assert read_anchor(path).meta["step"] == 1
    assert "restored" in caplog.text and "partial" in caplog.text and strays(tmp_path) == []


KILL_LOOP = r"""
import json, os, random, shutil, signal, statistics, sys, time, torch
torch.set_num_threads(1)
import mfqat
from mfqat.anchor.checkpoint import read_anchor
from mfqat.data.sources import tiny_llama
dest, trials = sys.argv[1], int(sys.argv[2])
parent = os.path.dirname(dest)
name = os.path.basename(dest)
model = tiny_llama()
random.seed(0)


def save(step):
    with torch.no_grad():
        model.model.norm.weight.fill_(step)
    mfqat.save_anchor(model, dest, step=step, overwrite=True)


def checked(path):  # a complete anchor: verifies, and its tensors are those of its own save
    a = read_anchor(path, verify=True)
    assert float(a.plain["model.norm.weight"][0]) == a.meta["step"], "metadata of one save, tensors of another"
    return a.meta["step"]


def backups_of():  # where a previous anchor waits when a kill fell between the two renames of a save
    return [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(f".{name}.old-")]


def read_byte(fd):
    b = os.read(fd, 1)
    assert b, "the saving child died on its own"
    return b


# how long one save takes on this machine now: the kill delays below are fractions of it
spent = []
for i in range(5):
    t = time.perf_counter()
    save(-1 - i)
    spent.append(time.perf_counter() - t)
t_save = statistics.median(spent)
stats = {"t_save_ms": round(1000 * t_save, 1), "complete": 0, "nothing": 0, "mid_save": 0,
         "between_saves": 0, "killed_in_first_save": 0, "restorable_backup": 0}
for t in range(trials):
    if t % 2 == 0:  # half the trials start from nothing (what killed writers left is removed too)
        for n in os.listdir(parent):
            f = os.path.join(parent, n)
            shutil.rmtree(f) if os.path.isdir(f) else os.unlink(f)
        before = None
    elif os.path.exists(dest):
        before = checked(dest)
    else:  # killed between the renames last time, the first save of this child puts the backup back
        old = backups_of()
        before = checked(old[0]) if old else None
    wait_saves = t % 3  # kill during the 1st, 2nd or 3rd save of this child
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        i = 0
        while True:
            i += 1
            os.write(w, b"s")
            save(1000 * (t + 1) + i)
            os.write(w, b"d")
    os.close(w)
    done = 0
    while done < wait_saves:  # events, not seconds: this child has finished wait_saves saves
        done += read_byte(r) == b"d"
    while read_byte(r) != b"s":  # ... and started the next one
        done += 1
    # the kills sweep the whole save, from its first write to its final rename and a little past it
    time.sleep(1.25 * t_save * ((7 * t) % trials + random.random()) / trials)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    rest = b""
    while True:
        chunk = os.read(r, 4096)
        if not chunk:
            break
        rest += chunk
    os.close(r)
    done += rest.count(b"d")
    stats["mid_save" if (rest[-1:] or b"s") == b"s" else "between_saves"] += 1
    stats["killed_in_first_save"] += done == 0
    first = 1000 * (t + 1) + 1
    if os.path.exists(dest):
        step = checked(dest)
        # the last finished save, the one in flight, or (none finished) the anchor that was there before
        allowed = {first + done - 1, first + done} if done else {before, first}
        assert step in allowed, (step, allowed, done)
        stats["complete"] += 1
    else:
        # killed between the two renames of a save: the previous anchor waits in a backup that the
        # next save puts back; with no previous anchor and no finished save, nothing
        backups = backups_of()
        if done or before is not None:
            assert len(backups) == 1, ("an anchor was there and is gone", done, before, backups)
            assert checked(backups[0]) in {before, first + done - 1}
            stats["restorable_backup"] += 1
        stats["nothing"] += 1
save(0)
stats["strays_after"] = [n for n in os.listdir(parent) if n.startswith(".")]
checked(dest)
print(json.dumps(stats))
"""


def test_kill_minus_9_loop_leaves_a_verified_anchor_or_nothing(tmp_path):
    """kill -9 a process that saves in a loop, at moments that follow the events of the save (the
    child says when each save starts and ends) plus a delay that is a fraction of a save timed in
    the same run, so a slow machine changes the numbers, not the outcome: every trial leaves the last
    finished anchor, the one being saved, or nothing (a restorable backup when there was an anchor),
    and the next save leaves no strays. That some kills landed mid-save is counted, not assumed."""
    trials = int(os.environ.get("MFQAT_KILL_TRIALS", "30"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", KILL_LOOP, str(tmp_path / "a"), str(trials)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    print(stats)
    assert stats["complete"] + stats["nothing"] == trials
    assert stats["mid_save"] > 0 and stats["complete"] > 0
    assert stats["strays_after"] == []


def test_concurrent_reader_and_writer(tmp_path):
    """A reader beside a writer that saves in a loop sees one save whole or a clear error. The loop
    ends on counts (saves done, reads done while a save was in flight), never on a clock, so a busy
    machine makes the test longer, not red."""
    model = tiny_llama()
    with torch.no_grad():
        model.model.norm.weight.fill_(0)
    path = mfqat.save_anchor(model, tmp_path / "a", step=0)
    want, cap = 20, 3000  # cap: the writer gives up (and the test fails) if reads never meet saves
    n = {"saves": 0, "saving": False, "reads": 0, "during_a_save": 0, "clear_errors": 0}
    errors = []

    def writer():
        while n["saves"] < cap and not (n["saves"] >= want and n["during_a_save"] >= want):
            i = n["saves"] + 1
            with torch.no_grad():
                model.model.norm.weight.fill_(i)
            n["saving"] = True
            mfqat.save_anchor(model, path, step=i, overwrite=True)
            n["saving"] = False
            n["saves"] = i

    t = threading.Thread(target=writer)
    t.start()
    while t.is_alive():
        before = (n["saving"], n["saves"])
        try:
            a = read_anchor(path)
        except AnchorError as e:  # a clear error naming the anchor is allowed, a raw one or a mixed read is not
            assert str(path) in str(e) and ("while it was read" in str(e) or "no such folder" in str(e)), e
            n["clear_errors"] += 1
            continue
        except Exception as e:  # pragma: no cover - the bug this test is for
            errors.append(repr(e))
            continue
        assert float(a.plain["model.norm.weight"][0]) == a.meta["step"], "metadata of one save, tensors of another"
        n["reads"] += 1
        n["during_a_save"] += before[0] or n["saving"] or n["saves"] != before[1]
    t.join()
    print(n)
    assert errors == []
    assert n["saves"] < cap, f"no reads overlapped the saves: {n}"
    assert n["reads"] >= want and n["during_a_save"] >= want


def test_second_writer_gets_a_clear_error(model, tmp_path):
    from mfqat.storage.io import WriterBusyError, atomic_directory

    dest = tmp_path / "a"
    with atomic_directory(dest, kind="anchor"):
        with pytest.raises(WriterBusyError, match=f"{dest}.*another process is writing"):
            mfqat.save_anchor(model, dest)
    mfqat.save_anchor(model, dest)
    assert strays(tmp_path) == []


def test_artifacts_follow_the_umask(model, tmp_path):
    old = os.umask(0o022)
    try:
        path = mfqat.save_anchor(model, tmp_path / "a")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    for f in path.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


def test_convert_leaves_out_files_the_anchor_manifest_lacks(model, tmp_path):
    """Issue 33 item 4 for `mfqat convert`: a chat_template.jinja dropped into the anchor after saving is
    not sealed into the converted checkpoint as if verified; the listed tokenizer files are."""
    from mfqat.data.sources import tiny_tokenizer
    anchor = mfqat.save_anchor(model, tmp_path / "a", tokenizer=tiny_tokenizer())
    (anchor / "chat_template.jinja").write_text("{{ 'planted' }}")
    with pytest.warns(UserWarning, match="chat_template.jinja not in the anchor's manifest"):
        cli_main(["convert", str(anchor), "--to", "mxint4", "--out", str(tmp_path / "hf4")])
    manifest = json.loads((tmp_path / "hf4" / "mfqat_convert.json").read_text())["manifest"]
    assert "tokenizer.json" in manifest and "chat_template.jinja" not in manifest
    assert "planted" not in "".join(p.read_text(errors="replace") for p in (tmp_path / "hf4").iterdir()
                                    if p.suffix in (".json", ".jinja"))
