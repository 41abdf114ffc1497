"""scripts/gpu_check.sh stays runnable where no GPU is: bash syntax, the summary's parsing of each
stage's log, the --smoke run of every stage on CPU, and the run-wide time budget."""
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STAGES = ["build", "cuda_tests", "quant_float32", "quant_bfloat16", "train", "qlora", "triton_aot", "kernels_static"]
sys.path.insert(0, str(ROOT / "scripts" / "dev"))
import gpu_summary  # noqa: E402


def run_check(out: Path, *args, budget=None, timeout=600):
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    if budget:
        env["GPU_CHECK_BUDGET"] = str(budget)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)


def stages(out: Path) -> dict:
    return {line.split("\t")[0]: line.split("\t")[1] for line in (out / "stages.tsv").read_text().splitlines()}


def test_script_is_valid_bash():
    run = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


QUANT_LOG = """device=cuda dtype=float32 shape=(8192, 8192) threads=16 clone=0.20 ms backends=['triton', 'cuda']
format       backend           ms  x clone  % clone  torchao ms  torchao/ours
mxint8       triton          0.25     1.25      80%         nan           nan
mxint8       cuda            0.22     1.10      91%         nan           nan
mxfp4_e2m1   triton          0.40     2.00      50%        0.50          1.25
mxfp4_e2m1   cuda            0.25     1.25      80%        0.50          2.00
anchor:format            backend     fused ms  two-pass ms  speed-up
mxint8:mxint4            cuda            0.30         0.50     1.67x
"""
TRAIN_LOG = """device=cuda dtype=bfloat16 batch=8x256 threads=16 format=mxint4 rounds=5 quantized weights=106.2M
plain                  median 0.050 s/step (min 0.049, max 0.052) | ratio to plain 1.000x
MF-QAT [auto]          median 0.055 s/step (min 0.054, max 0.056) | ratio to plain 1.100x
MF-QAT [cuda]          median 0.054 s/step (min 0.054, max 0.056) | ratio to plain 1.080x
plain x3 accumulated   median 0.140 s/step (min 0.139, max 0.141) | ratio to plain 2.800x
joint x3 [auto]        median 0.160 s/step (min 0.159, max 0.161) | ratio to plain 3.200x | per format 1.067x | to plain x3 accumulated 1.143x (paired median 1.140x)
CPU time (all threads; robust to time stolen by other tenants of the machine):
joint x3 [auto]        median 9.000 CPU-s/step | ratio to plain 9.000x
"""
QLORA_LOG = """| run | eval format | held-out ppl | peak RSS MiB | s/step |
|---|---|---|---|---|
| LoRA, fp base | fp | 20.00 | 3000 | 0.50 |
| LoRA, nf4 base (bnb, double quant) | nf4 | 21.00 | 2000 | 0.40 |
| MX-QLoRA, one adapter cycled 8/6/4 | mxint8 | 20.50 | 1800 | 0.60 |
"""


def test_summary_pulls_each_stages_numbers(tmp_path):
    logs = {"build": "mfqat: building ...\n  CUDA op: built into mfqat._C; MFQAT_BACKEND=cuda runs it\n",
            "cuda_tests": "....\n150 passed, 3 skipped in 41.20s\n", "quant_float32": QUANT_LOG, "train": TRAIN_LOG,
            "qlora": QLORA_LOG, "kernels_static": "| table |\n\n96 compilations, 0 failed, 2 spill\n  SPILLS x\n"}
    rows = []
    for name, text in logs.items():
        (tmp_path / f"{name}.log").write_text(text)
        rows.append(f"{name}\tok\t3\t{tmp_path / (name + '.log')}")
    rows.append("triton_aot\tskipped: out of time (budget 570 s)\t0\t")
    (tmp_path / "stages.tsv").write_text("\n".join(rows) + "\n")
    assert gpu_summary.main([str(tmp_path)]) == 0
    table = (tmp_path / "summary.md").read_text()
    row = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert "CUDA op: built" in row["build"]
    assert "150 passed, 3 skipped" in row["cuda_tests"]
    assert "triton 50-80%; cuda 80-91%" in row["quant_float32"]  # clone_ms / ms per backend, min-max
    assert "MF-QAT [cuda] 1.080x" in row["train"] and "joint x3 [auto] 3.200x (to plain xK, paired 1.140x)" in row["train"]
    assert "9.000x" not in row["train"]  # the CPU-time block is not the wall-time result
    assert "peak 1800 vs 2000 MiB (0.90x), step 0.60 vs 0.40 s (1.50x)" in row["qlora"]
    assert "96 compilations, 0 failed, 2 spill" in row["kernels_static"]
    assert "skipped: out of time" in row["triton_aot"]
    assert "### quant_float32" in table and "mxfp4_e2m1   cuda" in table  # the benchmark's own table follows
    assert gpu_summary.main([str(tmp_path / "nowhere")]) == 2


@pytest.mark.slow
def test_smoke_run_runs_every_stage_on_cpu(tmp_path):
    """--smoke: each stage's real command line with tiny CPU settings (~45 s on 2 busy cores); a flag a
    script lost, a renamed test or a broken summary fails here rather than on the next GPU."""
    run = run_check(tmp_path, "--smoke")
    got = stages(tmp_path)
    assert list(got) == STAGES, run.stdout[-2000:]
    assert all(s == "ok" for s in got.values()), (got, run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-2000:]
    table = (tmp_path / "summary.md").read_text()
    assert "CUDA op: not built" in table or "CUDA op: built" in table
    assert "cpp " in next(line for line in table.splitlines() if line.startswith("| quant_float32"))
    assert "joint x2 [auto]" in next(line for line in table.splitlines() if line.startswith("| train"))


def tiny_model_seconds(out: Path) -> float:
    """How long the --smoke run's first step (a tiny Llama and its tokenizer saved, in a new python)
    takes on this machine now."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sys; from mfqat.data.sources import tiny_llama, tiny_tokenizer; "
                    "t = tiny_tokenizer(); tiny_llama(vocab_size=len(t)).save_pretrained(sys.argv[1]); "
                    "t.save_pretrained(sys.argv[1])", str(out)],
                   check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    return time.perf_counter() - t


def test_the_budget_stops_starting_stages(tmp_path):
    """A stage starts only with 15 s of the run's budget left, and its limit is cut to what is left.
    The budget is 15 s plus three times the run's own first step, timed here, so the first stage starts
    on a busy machine too; then the stages that do not fit are skipped and never started (no log, no
    command line), and each started stage's limit is at most the budget. Outcomes, not seconds: how
    many stages fit depends on the machine, that the first does and the last does not does not."""
    budget = 15 + math.ceil(3 * tiny_model_seconds(tmp_path / "timed"))
    run = run_check(tmp_path / "run", "--smoke", budget=budget)
    got = stages(tmp_path / "run")
    assert list(got) == STAGES, run.stdout[-2000:]
    skipped = [k for k, v in got.items() if v.startswith("skipped: out of time")]
    assert skipped and skipped == STAGES[-len(skipped):], got
    started = re.findall(r"^== (\w+) \(limit (-?\d+)s\)", run.stdout, re.M)
    assert started and [name for name, _ in started] == [k for k, v in got.items() if not v.startswith("skipped")], got
    for name in skipped:
        assert not (tmp_path / "run" / f"{name}.log").exists(), f"{name} was started"
    for name, limit in started:
        assert 15 <= int(limit) <= budget, (name, limit, budget)  # cut to what was left, never under 15 s
