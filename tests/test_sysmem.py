"""mfqat.cli.sysmem: with the mmap threshold fixed, tensors freed in the middle of the heap go back to the system
(issue 44: a refine's module-by-module weights stayed resident as heap fragments)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = r"""
import ctypes, json, sys, torch
from mfqat.cli.sysmem import return_freed_memory
class Mallinfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) * 1024
libc.mallopt(-3, 32 << 20)  # the threshold as glibc raises it after freeing big blocks
set_ = return_freed_memory() if sys.argv[1] == "on" else False
mid = [torch.ones(2 ** 21) for _ in range(64)]  # 64 x 8 MiB
mapped = libc.mallinfo2().hblkhd  # bytes in blocks with their own mapping (returned when freed)
before = rss()
mid.clear()
print(json.dumps({"set": set_, "mapped": mapped, "freed": before - rss()}))
"""


def _glibc_with_mallinfo2() -> bool:
    import ctypes

    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc_with_mallinfo2(), reason="glibc >= 2.33")
def test_tensors_freed_mid_heap_go_back_to_the_system(tmp_path):
    root = Path(__file__).resolve().parents[1]
    out = {}
    for mode in ("off", "on"):
        env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
        r = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True)
        out[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["on"]["set"]
    assert out["on"]["mapped"] >= 512 * 2 ** 20, out  # every 8 MiB block mapped on its own
    assert out["on"]["freed"] > 400 * 2 ** 20, out  # and given back when freed
    assert out["off"]["mapped"] < 64 * 2 ** 20, out  # glibc's raised threshold serves them from the heap


def test_the_users_own_setting_stands(monkeypatch):
    from mfqat.cli.sysmem import return_freed_memory

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert return_freed_memory() is False


def test_the_mfqat_commands_that_stream_set_it_as_they_start(monkeypatch, capsys, tmp_path):
    """refine and a refining or --gptq export-mlx set it (at 0.5B --gptq --no-refine peaked at 1.83 GiB with it,
    2.56 without); train, convert, eval and a plain --no-refine export do not (page faults on every new mapping cost
    them a quarter of their time for ~5% of their peak)."""
    from mfqat.cli import sysmem
    from mfqat.cli.app import main

    calls = []
    monkeypatch.setattr(sysmem, "return_freed_memory", lambda: calls.append(argv[0]))
    missing = str(tmp_path / "no-anchor")
    for argv in (["refine", missing, "--formats", "affine4"], ["train", "--help"], ["convert", missing, "--out", missing],
                 ["export-mlx", missing, "--out", missing], ["export-mlx", missing, "--out", missing, "--no-refine"],
                 ["export-mlx", missing, "--out", missing, "--no-refine", "--gptq"], ["eval", missing]):
        with pytest.raises(SystemExit):
            main(argv)
    assert calls == ["refine", "export-mlx", "export-mlx"]
