#!/usr/bin/env python
"""Pre-release check: do the tests fail when the product breaks?

Each entry of mutations.yaml (beside this script) plants one named bug in a temporary copy of the
repository: its pattern, found inside the named function wherever the function now sits and whatever
the layout (mutation_specs.py says how), becomes its replacement. Then only the tests expected to catch
it run, with PYTHONPATH pointing at the copy. A mutation is *caught* when those tests fail; it
*survives* when they pass (a test gap). Before any mutation the same tests run once on the unmodified
copy and must pass.

    python scripts/dev/mutation_check.py             # all mutations (tens of minutes on 2 cores)
    python scripts/dev/mutation_check.py -k nf4      # those whose name contains "nf4"
    python scripts/dev/mutation_check.py -k a,b -j 2 # containing a or b, two at a time, each in its own copy
    python scripts/dev/mutation_check.py --list

Prints caught/planted and exits 1 when a mutation survives, its tests error, or a spec no longer applies
([spec]: the pattern is not exactly once in its function; fix the entry in mutations.yaml).
"""
from __future__ import annotations

import argparse
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Tuple

from mutation_specs import Mutation, SpecError, load, plant

ROOT = Path(__file__).resolve().parents[2]
IGNORE = shutil.ignore_patterns(".venv", ".git", "out", "runs", "__pycache__", ".pytest_cache", ".hypothesis",
                                "*.egg-info", "build", "dist")


def copy_repo(dst: Path) -> Path:
    """The working tree without .venv/.git/out/caches; the built C++ extension comes along."""
    shutil.copytree(ROOT, dst, ignore=IGNORE)
    for so in (ROOT / "mfqat").glob("_C*.so"):  # also when a pattern above ever ignores it
        if not (dst / "mfqat" / so.name).exists():
            shutil.copy2(so, dst / "mfqat" / so.name)
    return dst


def run_tests(copy: Path, tests: Tuple[str, ...], timeout: int) -> Tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1", "TRITON_INTERPRET": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("MFQAT_BACKEND", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    try:
        r = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timeout"
    lines = (r.stdout + r.stderr).strip().splitlines()
    why = next((l.strip() for l in lines if l.startswith("E ")), "")  # the first failure line, if any
    return r.returncode, (lines[-1] if lines else "") + (f"  | {why[:110]}" if why else "")


def plant_and_test(copy: Path, m: Mutation, timeout: int) -> Tuple[bool, str, str]:
    """Plant ``m`` in ``copy``, run its tests, restore the file: (caught, report line, problem or "")."""
    try:
        path, original, mutated = plant(copy, m)
    except SpecError as e:
        return False, f"[spec    ] {e}", str(e)
    path.write_text(mutated)
    try:
        t = time.perf_counter()
        rc, tail = run_tests(copy, m.tests, timeout)
    finally:
        path.write_text(original)
    problem = ""
    if rc == 1:  # pytest: tests failed
        verdict = "caught  "
    elif rc == 0:
        verdict = "SURVIVED"
        problem = f"{m.name}: survived {' '.join(m.tests)}"
    else:  # usage error, no tests collected, interrupted, timeout: not evidence of a catch
        verdict = f"ERROR {rc}"
        problem = f"{m.name}: pytest exit {rc} ({tail})"
    return rc == 1, f"[{verdict}] {m.name:40s} {time.perf_counter() - t:5.1f}s  {tail}", problem


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", default="", help="only mutations whose name contains this (a comma list: any of them)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--no-baseline", action="store_true", help="skip the run on the unmodified copy")
    p.add_argument("--timeout", type=int, default=300, help="seconds per pytest run")
    p.add_argument("-j", "--jobs", type=int, default=1, help="mutations tested at once, each in its own copy")
    args = p.parse_args(argv)
    try:
        muts = [m for m in load() if any(k in m.name for k in args.k.split(","))]
    except (SpecError, OSError) as e:  # a malformed data file: one line, before any copy is made
        print(f"mutation_check: error: {e}", file=sys.stderr)
        return 2
    if args.list:
        for m in muts:
            print(f"{m.name:40s} {m.file}:{m.function}  ->  {' '.join(m.tests)}")
        return 0
    t0 = time.perf_counter()
    problems: List[str] = []
    with tempfile.TemporaryDirectory(prefix="mfqat-mutants-") as tmp:
        copies = [copy_repo(Path(tmp) / f"repo{i}") for i in range(max(1, args.jobs))]
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for m in muts for t in m.tests))
            rc, tail = run_tests(copies[0], tests, args.timeout * 2)
            print(f"baseline (unmodified copy, {len(tests)} test ids): {'pass' if rc == 0 else 'FAIL'}  {tail}")
            if rc != 0:
                print("the targeted tests must pass before mutating; fix them first")
                return 1
        free: "queue.Queue[Path]" = queue.Queue()
        for c in copies:
            free.put(c)
        lock = threading.Lock()

        def one(m: Mutation) -> bool:
            copy = free.get()  # each worker plants its bug in its own copy of the repository
            try:
                caught, line, problem = plant_and_test(copy, m, args.timeout)
            finally:
                free.put(copy)
            with lock:
                print(line, flush=True)
                if problem:
                    problems.append(problem)
            return caught

        with ThreadPoolExecutor(max_workers=len(copies)) as pool:
            caught = sum(pool.map(one, muts))
    print(f"\nmutation check: {caught}/{len(muts)} caught ({time.perf_counter() - t0:.0f}s)")
    for line in problems:
        print("  - " + line)
    return 0 if caught == len(muts) and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
