#!/usr/bin/env python
"""The one summary table of scripts/gpu_check.sh, from its stage list and logs.

    python scripts/dev/gpu_summary.py LOG_DIR      # reads LOG_DIR/stages.tsv, writes LOG_DIR/summary.md

stages.tsv: one line a stage, tab-separated: name, status (ok / FAILED rc=N / TIMEOUT after N s /
skipped: why), seconds, log file. Each row of the table gives the stage's headline numbers, pulled
from its log: the pytest result line; bandwidth as % of clone() per backend (min-max over the
formats); the joint step's ratios to the plain step; MX-QLoRA against bitsandbytes NF4 QLoRA; the
static kernel table's spill count. The benchmark tables themselves follow the summary.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

WHAT = {
    "build": "(a) build the extension with the CUDA op",
    "cuda_tests": "(b) kernel tests on CUDA, Triton and the CUDA op, bit-exact vs the reference",
    "quant_float32": "(d) fake-quant bandwidth, fp32, % of clone()",
    "quant_bfloat16": "(d) fake-quant bandwidth, bf16, % of clone()",
    "train": "(e) joint MF-QAT step vs plain bf16 step, SmolLM2",
    "qlora": "(f) MX-QLoRA vs bitsandbytes NF4 QLoRA",
    "triton_aot": "(c) tests/test_triton_aot.py, this machine's ptxas",
    "kernels_static": "(c) scripts/bench/bench_kernels_static.py, this machine's ptxas",
}


def pytest_line(text: str) -> Optional[str]:
    """pytest's final counts ("12 passed, 3 skipped in 4.2s")."""
    found = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", text, re.M)
    return found[-1] if found else None


def quant_bandwidth(text: str) -> Optional[str]:
    """bench_quant.py's rows -> per backend the min-max of clone_ms / ms over the formats, in %."""
    clone = re.search(r"clone=([\d.]+) ms", text)
    if not clone:
        return None
    per: Dict[str, List[float]] = {}
    for m in re.finditer(r"^(mx\w+)\s+(\w+)\s+([\d.]+)\s+[\d.]+\s", text, re.M):
        per.setdefault(m.group(2), []).append(100 * float(clone.group(1)) / float(m.group(3)))
    return "; ".join(f"{b} {min(v):.0f}-{max(v):.0f}%" for b, v in per.items()) or None


def train_ratios(text: str) -> Optional[str]:
    """bench_train.py's wall-time block -> the joint step's ratios and each MF-QAT backend's ratio to plain."""
    wall = text.split("CPU time")[0]
    parts = []
    for m in re.finditer(r"^(MF-QAT \[\w+\]|joint x\d+ \[[\w-]+\]).*?ratio to plain ([\d.]+)x"
                         r"(?:.*?paired median ([\d.]+)x)?", wall, re.M):
        parts.append(f"{m.group(1)} {m.group(2)}x" + (f" (to plain xK, paired {m.group(3)}x)" if m.group(3) else ""))
    return "; ".join(parts) or None


def qlora_compare(text: str) -> Optional[str]:
    """bench_qlora.py's Markdown rows -> MX-QLoRA (cycled) peak MiB and s/step against NF4 QLoRA's."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| run")]
    nf4 = next((r for r in rows if r[0].startswith("LoRA, nf4")), None)
    mx = next((r for r in rows if r[0].startswith("MX-QLoRA, one adapter cycled")), None)
    if not (nf4 and mx):
        return None
    mem, step = float(mx[3]) / float(nf4[3]), float(mx[4]) / float(nf4[4])
    return (f"peak {mx[3]} vs {nf4[3]} MiB ({mem:.2f}x), step {mx[4]} vs {nf4[4]} s ({step:.2f}x) "
            "MX-QLoRA cycled vs NF4")


def static_line(text: str) -> Optional[str]:
    m = re.search(r"^(\d+ compilations, \d+ failed, \d+ spill)", text, re.M)
    return m.group(1) if m else None


def build_line(text: str) -> Optional[str]:
    m = re.search(r"CUDA op: (built|not built)[^\n]*", text)
    return m.group(0)[:90] if m else None


def headline(name: str, text: str) -> str:
    """The numbers a stage's row shows (empty when its log has none)."""
    if name == "build":
        found = build_line(text)
    elif name.startswith("quant_"):
        found = quant_bandwidth(text)
    elif name == "train":
        found = train_ratios(text)
    elif name == "qlora":
        found = qlora_compare(text)
    elif name == "kernels_static":
        found = static_line(text)
    else:
        found = pytest_line(text)
    return found or ""


def summarize(log_dir: Path) -> str:
    """The summary table (Markdown), then each benchmark's own table from its log."""
    lines = ["| stage | what | status | seconds | result |", "|---|---|---|---|---|"]
    details = []
    for raw in (log_dir / "stages.tsv").read_text().splitlines():
        name, status, seconds, log = (raw.split("\t") + ["", "", ""])[:4]
        path = Path(log) if log else None
        text = path.read_text(errors="replace") if path and path.is_file() else ""
        lines.append(f"| {name} | {WHAT.get(name, '')} | {status} | {seconds} | {headline(name, text)} |")
        if name.startswith(("quant_", "train", "qlora")) and text:
            details.append(f"\n### {name}\n\n```\n{text.strip()[-6000:]}\n```")
    machine = log_dir / "gpu.txt"  # the GPU, torch and ptxas the run used
    head = f"```\n{machine.read_text().strip()}\n```\n\n" if machine.is_file() else ""
    return head + "\n".join(lines) + "\n" + "\n".join(details) + "\n"


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not (Path(args[0]) / "stages.tsv").is_file():
        print("usage: gpu_summary.py LOG_DIR (holding gpu_check.sh's stages.tsv)", file=sys.stderr)
        return 2
    text = summarize(Path(args[0]))
    (Path(args[0]) / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
