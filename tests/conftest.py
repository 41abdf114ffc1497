import os
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

MX_FORMATS = ["mxint8", "mxint7", "mxint6", "mxint5", "mxint4", "mxint3", "mxint2",
              "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1"]
MXFP_FORMATS = [f for f in MX_FORMATS if f.startswith("mxfp")]


def assert_formats_equal_the_anchors(model, anchor, formats) -> None:
    """Each format of the prepared ``model`` gives the logits of ``load_anchor(anchor, fmt=f)``, bit for bit."""
    import mfqat

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for f in formats:
        mfqat.set_format(model, f)
        with torch.no_grad():
            got = model(ids).logits
            want = mfqat.load_anchor(anchor, fmt=f)(ids).logits
        assert torch.equal(got, want), f


def one_line_exit_2(argv, capsys, expect: str) -> str:
    """Run ``mfqat ARGV``; assert it exits 2 with one ``mfqat CMD: error: ...`` line holding ``expect``."""
    from mfqat.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, err
    assert err.startswith(f"mfqat {argv[0]}: error: ") and "\n" not in err and expect in err, err
    return err


def dead_pid() -> int:
    """The pid of a process that has exited (a leftover's owner that no longer runs)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture(params=MX_FORMATS)
def mx_format(request):
    return request.param


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a rendezvous or a server the test starts), drawn at random
    *below* the kernel's ephemeral range: a port the kernel hands out (``bind(0)``) is also what other tests'
    outgoing gloo connections are given, and a rank that connected to one of those instead of its own store
    aborted (seen with 2 xdist workers running two-rank tests at once)."""
    import random
    import socket

    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no free port below the range: let the kernel pick one
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Shared tiny models, built once per test module (module scope, as where they were pasted before). A module
# that needs another model of the same name defines its own fixture, which pytest uses there instead.

@pytest.fixture(scope="module")
def tok():
    """The tiny byte tokenizer (mfqat.data.sources.tiny_tokenizer)."""
    from mfqat.data.sources import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="module")
def anchor(tok, tmp_path_factory):
    """A tiny tied Llama (seed 0) saved as an mxint8 anchor with the tokenizer."""
    import mfqat
    from mfqat.data.sources import tiny_llama

    return mfqat.save_anchor(tiny_llama(vocab_size=len(tok), tie=True), tmp_path_factory.mktemp("anchor") / "anchor",
                             "mxint8", tok)


@pytest.fixture(scope="module")
def untied_anchor(tok, tmp_path_factory):
    """A tiny Llama (seed 0) with an untied lm_head, saved as an mxint8 anchor with the tokenizer."""
    import mfqat
    from mfqat.data.sources import tiny_llama

    return mfqat.save_anchor(tiny_llama(vocab_size=len(tok)), tmp_path_factory.mktemp("untied") / "a", "mxint8", tok)


@pytest.fixture(scope="module")
def tiny_dir(tok, tmp_path_factory):
    """A tiny tied Llama (seed 0) and the tokenizer saved as a Hugging Face folder (safetensors)."""
    from mfqat.data.sources import tiny_llama

    d = tmp_path_factory.mktemp("tiny_hf")
    tiny_llama(vocab_size=len(tok), tie=True).save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    return d


def growth_slope(measure, small_layers: int, large_layers: int) -> float:
    """Extra peak bytes per extra bf16 byte of model between two depths of the same width: ``measure(layers)``
    gives (peak growth, the model's bf16 bytes) of a child process. A ratio, never a time."""
    small, small_bytes = measure(small_layers)
    large, large_bytes = measure(large_layers)
    slope = (large - small) / (large_bytes - small_bytes)
    print(f"growth {small / 2**20:.0f} MiB at {small_bytes / 2**20:.0f} MiB, {large / 2**20:.0f} MiB at "
          f"{large_bytes / 2**20:.0f} MiB: slope {slope:.2f}")
    return slope
