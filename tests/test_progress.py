"""Progress bars in logs (mfqat.progress): few lines when stderr is a file, none with MFQAT_PROGRESS=0;
the dependency-noise filters drop only the two known messages."""
import logging
import sys
import time

from tqdm.auto import tqdm

from mfqat.progress import progress, quiet_dependency_logs


def _frames(path) -> int:
    text = path.read_text()
    return sum(1 for line in text.replace("\r", "\n").split("\n") if line.strip())


def _run(bar_factory, steps=60, dt=0.01):
    bar = bar_factory(total=steps, desc="MF-QAT")
    for i in range(steps):
        time.sleep(dt)
        bar.set_postfix(loss=f"{1.0 / (i + 1):.3f}")  # what the training loops do every step
        bar.update(1)
    bar.close()


def test_few_progress_lines_when_stderr_is_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("MFQAT_PROGRESS", raising=False)
    # the redraw interval far beyond the run, so the frame count does not depend on how fast this machine is
    monkeypatch.setattr("mfqat.progress.LOG_INTERVAL", 1e6)
    plain, ours = tmp_path / "tqdm.txt", tmp_path / "mfqat.txt"
    with open(plain, "w") as fh:
        monkeypatch.setattr(sys, "stderr", fh)
        _run(tqdm)
    with open(ours, "w") as fh:
        monkeypatch.setattr(sys, "stderr", fh)
        _run(progress)
        for _ in progress(range(1000), desc="ppl", leave=False):
            pass
    monkeypatch.setattr(sys, "stderr", sys.__stderr__)
    assert _frames(plain) >= 30  # plain tqdm redraws on every set_postfix
    assert _frames(ours) <= 3, ours.read_text()  # start + end of the bar (+ the cleared inner one)
    assert "60/60" in ours.read_text()


def test_progress_off_and_forced(tmp_path, monkeypatch):
    log = tmp_path / "log.txt"
    with open(log, "w") as fh:
        monkeypatch.setenv("MFQAT_PROGRESS", "0")
        _run(lambda **kw: progress(file=fh, **kw), steps=5, dt=0)
    assert log.read_text() == ""
    with open(log, "w") as fh:
        monkeypatch.setenv("MFQAT_PROGRESS", "1")
        _run(lambda **kw: progress(file=fh, **kw), steps=5, dt=0)
    assert _frames(log) >= 5  # tqdm's own behaviour, postfix redraws included
    monkeypatch.delenv("MFQAT_PROGRESS")
    assert progress(range(3), disable=True).disable  # a caller's disable=True is kept


def test_quiet_dependency_logs_drops_only_the_known_messages(caplog):
    quiet_dependency_logs()
    quiet_dependency_logs()  # idempotent
    assert len(logging.getLogger("torchao").filters) == 1
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_mxfp8.so: no CUDA")
        logging.getLogger("torch.utils._pytree").warning(
            "%s is an Enum subclass and is now natively supported ... Calling register_constant() on Enum", "E")
        logging.getLogger("torchao").warning("something else")
        logging.getLogger("torch.utils._pytree").warning("another pytree warning")
    assert [r.getMessage() for r in caplog.records] == ["something else", "another pytree warning"]
