"""Issue 33 item 10: a long text (one 20 MB line) is read and tokenized in bounded memory, and the token
blocks stay exactly those of tokenizing the whole text at once (every benchmark's pydoc blocks)."""
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from mfqat.data import sources
from mfqat.data.sources import load_text, pydoc_text, split_text, text_pieces, tiny_tokenizer, token_blocks

WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()


def old_blocks(tok, text, seq_len, max_blocks=None):
    """The reader before issue 33: the whole text tokenized in one call."""
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    n = ids.numel() // seq_len if max_blocks is None else min(ids.numel() // seq_len, max_blocks)
    return ids[: n * seq_len].reshape(n, seq_len)


def one_line(n_chars, seed=0):
    rng = random.Random(seed)
    words = rng.choices(WORDS, k=n_chars // 3)
    return " ".join(w + rng.choice(["", "", ",", "."]) for w in words)[:n_chars]


@pytest.mark.parametrize("size", [sources.TOKENIZE_CHARS, 4096, 300])
def test_pydoc_blocks_are_those_of_the_whole_text(size, monkeypatch):
    tok = tiny_tokenizer()
    train, held = split_text(load_text(None))
    monkeypatch.setattr(sources, "TOKENIZE_CHARS", size)
    assert len(list(text_pieces(train, size))) > 1  # the cuts are exercised
    for text, seq_len, max_blocks in ((train, 128, None), (held, 256, 8), (train, 64, 40)):
        assert torch.equal(token_blocks(tok, text, seq_len, max_blocks), old_blocks(tok, text, seq_len, max_blocks))


@pytest.mark.slow
def test_pydoc_blocks_of_the_embedded_model_tokenizer_are_unchanged():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(sources.smollm2_dir(), gguf_file=sources.SMOLLM2_GGUF)
    assert sources.cuts_are_exact(tok)
    train, held = split_text(pydoc_text())
    for text, seq_len in ((train, 128), (held, 256), (train[:20000] + held[:20000], 32)):
        assert torch.equal(token_blocks(tok, text, seq_len), old_blocks(tok, text, seq_len))


def test_text_pieces_cut_before_a_space_after_a_non_space_and_keep_every_character():
    text = "ab  cd\t\n ef gh " * 50 + "x" * 200 + " end"
    pieces = list(text_pieces(text, 64))
    assert "".join(pieces) == text and all(0 < len(p) <= 64 for p in pieces)
    for before, p in zip(pieces, pieces[1:]):
        assert (p[0] == " " and not before[-1].isspace()) or p.startswith("x"), (before, p)  # hard cut: no space
    assert list(text_pieces("", 8)) == [""] and list(text_pieces("short", 8)) == ["short"]


def test_a_tokenizer_whose_ids_change_at_cuts_gets_the_whole_text(monkeypatch):
    tok = tiny_tokenizer()
    calls = []
    monkeypatch.setattr(sources, "TOKENIZE_CHARS", 300)
    monkeypatch.setattr(sources, "cuts_are_exact", lambda t: False)
    real = sources._encode
    monkeypatch.setattr(sources, "_encode", lambda t, s: calls.append(len(s)) or real(t, s))
    text = pydoc_text()[:5000]
    assert torch.equal(token_blocks(tok, text, 64), old_blocks(tok, text, 64)) and calls == [5000]


PEAK = textwrap.dedent("""
    import json, sys
    from mfqat.data.jsonl import training_texts
    from transformers import AutoTokenizer
    from mfqat.data.sources import load_text, split_text, token_blocks
    tok = AutoTokenizer.from_pretrained(sys.argv[4])
    def status(key):  # VmHWM: this process's peak resident memory (ru_maxrss would count the forking parent's)
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))
    base = status("VmRSS")
    whole = token_blocks(tok, split_text(load_text(sys.argv[1]))[0], 256)   # every block of a 4 MB line
    small = status("VmHWM") - base
    if small > 300e6:  # the whole text in one call (~1 GB here): stop before the 20 MB line takes ~5 GB
        sys.exit(print(json.dumps({"small": small, "big": None, "blocks": whole.shape[0]})))
    train, held = split_text(load_text(sys.argv[2]))                          # 20 MB line, as train reads it
    token_blocks(tok, train, 256, max_blocks=64), token_blocks(tok, held, 256, max_blocks=8)
    train, held = training_texts(None, sys.argv[3], tok)                      # one 20 MB JSON-lines record
    token_blocks(tok, train, 256, max_blocks=64)
    print(json.dumps({"small": small, "big": status("VmHWM") - base, "blocks": whole.shape[0]}))
""")



@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak memory from /proc (Linux)")
def test_one_huge_line_is_tokenized_in_bounded_memory(tmp_path):
    """Before: ~4.7 GB for one 20 MB line (the whole text in one tokenizer call); ~1 GB for 4 MB."""
    (tmp_path / "small.txt").write_text(one_line(4_000_000))
    big = one_line(20_000_000, seed=1)
    (tmp_path / "big.txt").write_text(big)
    (tmp_path / "big.jsonl").write_text(json.dumps({"text": big}) + "\n")
    del big
    tiny_tokenizer().save_pretrained(tmp_path / "tok")  # trained here: training peaks above what is measured
    r = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "small.txt"), str(tmp_path / "big.txt"),
                        str(tmp_path / "big.jsonl"), str(tmp_path / "tok")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["blocks"] > 10000
    assert got["small"] < 300e6, got  # the ids of 4M tokens (int64) and one piece's encoding
    assert got["big"] < 600e6, got  # measured: 83 MB and 130 MB (before: 1.0 GB and 5.2 GB)


def test_only_the_pieces_max_blocks_need_are_tokenized(monkeypatch):
    tok = tiny_tokenizer()
    text = one_line(200_000)
    seen = []
    real = sources._encode
    monkeypatch.setattr(sources, "_encode", lambda t, s: seen.append(len(s)) or real(t, s))
    blocks = token_blocks(tok, text, 64, max_blocks=3)
    assert torch.equal(blocks, old_blocks(tok, text, 64, 3))
    assert len([n for n in seen if n > len(sources._CUT_PROBE)]) == 1  # one piece of text (and the probe)
