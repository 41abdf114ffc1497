#!/usr/bin/env python
"""Static resource use of every Triton kernel, compiled ahead of time for sm_80, sm_90 and sm_100
(no GPU needed): registers per thread, spilled bytes (stores + loads; zero is the rule), shared
memory, warps, and the minimal global-memory bytes moved per element (each tensor the launch
touches, once, over the input's elements: e.g. fp32 in + fp32 out + int8 mask = 9 B/elem).

The launches are the wrappers' own (mfqat.quant.kernels.triton_aot records them), per format
family and input dtype at block 32, the heaviest variant (ceil, saturation mask, weighted search).

    python scripts/bench/bench_kernels_static.py                   # the default set (what tests/test_triton_aot.py compiles)
    python scripts/bench/bench_kernels_static.py --full            # + every MX format, block size, lighter variant
    python scripts/bench/bench_kernels_static.py --unaligned       # + each launch with pointers not 16-byte aligned
    python scripts/bench/bench_kernels_static.py --json out.json   # also write the rows as JSON

Prints a Markdown table, then how many compilations spill and the compile time per kernel.
Exits 1 when a kernel fails to compile.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from mfqat.eval.report import format_table
from mfqat.quant.kernels import triton_aot


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="every MX format, block size and lighter variant")
    p.add_argument("--unaligned", action="store_true", help="also each launch with unaligned pointers")
    p.add_argument("--targets", default=",".join(map(str, triton_aot.TARGETS)), help="comma-separated sm_ numbers")
    p.add_argument("-k", default="", help="only launches whose id contains this text")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    a = p.parse_args(argv)
    why = triton_aot.available()
    if why:
        print(f"cannot compile: {why}", file=sys.stderr)
        return 2
    todo = [l for l in triton_aot.launches(full=a.full) if a.k in l.id]
    if a.unaligned:
        todo += [triton_aot.unaligned(l) for l in todo]
    rows, failed, seconds = [], 0, defaultdict(list)
    for launch in todo:
        for arch in (int(t) for t in a.targets.split(",")):
            row = {"kernel": launch.kernel, "config": launch.config, "target": f"sm_{arch}",
                   "B/elem": round(launch.bytes_per_element, 4)}
            try:
                c = triton_aot.compile_launch(launch, arch)
            except triton_aot.KernelCompileError as e:
                failed += 1
                print(f"COMPILE ERROR {e}", file=sys.stderr)
                rows.append({**row, "regs": "ERROR"})
                continue
            seconds[launch.kernel].append(c.seconds)
            rows.append({**row, "regs": c.registers, "spills": c.spills, "stack": c.stack_frame,
                         "shared": c.shared, "warps": c.num_warps, "compile_s": round(c.seconds, 2)})
    print(format_table(rows, ["kernel", "config", "target", "regs", "spills", "stack", "shared", "warps", "B/elem"]))
    spilling = [r for r in rows if r.get("spills")]
    print(f"\n{len(rows)} compilations, {failed} failed, {len(spilling)} spill"
          + "".join(f"\n  SPILLS {r['kernel']} [{r['config']}] {r['target']}: {r['spills']} B" for r in spilling))
    print("compile seconds per kernel (mean, max over its compilations): " + ", ".join(
        f"{k} {sum(v) / len(v):.2f}/{max(v):.2f}" for k, v in seconds.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
