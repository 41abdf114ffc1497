#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: the CUDA/Triton kernel tests, then the GPU
# benchmarks (fake-quant vs copy bandwidth vs torchao), as a table. Uses the machine's own python3
# (with torch + triton); installs nothing. Writes logs to ${OUT:-/tmp/mfqat_gpu}.
#     bash scripts/gpu_check.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOG="${OUT:-/tmp/mfqat_gpu}"
mkdir -p "$LOG"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MFQAT_NO_EXT=1
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG/gpu.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$LOG/gpu.txt"
echo "== kernel tests (triton on cuda vs the reference) =="
"$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "cuda or dispatch" 2>&1 | tee "$LOG/tests.txt" | tail -5
status=${PIPESTATUS[0]}
echo "== fake-quant bandwidth, fp32 and bf16 (ratios to clone in the same run) =="
for dt in float32 bfloat16; do
  "$PY" scripts/bench_quant.py --device cuda --dtype "$dt" --size 8192 --repeats 20 --backends triton,reference 2>&1 \
    | grep -v "Failed to load" | tee "$LOG/bench_quant_$dt.txt"
done
echo "== fused train-through-anchor kernel (triton on cuda, bit-exact with two passes) =="
"$PY" -m pytest -q -p no:cacheprovider tests/test_through_kernel.py 2>&1 | tee "$LOG/tests_through.txt" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "== MX scale search kernels, MXINT and MXFP (triton on cuda, bit-exact with the oracle) =="
"$PY" -m pytest -q -p no:cacheprovider tests/test_search_kernel.py tests/test_search_kernel_mxfp.py \
  -k "cuda or triton_search" 2>&1 | tee "$LOG/tests_search.txt" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "== bitsandbytes QLoRA on CUDA (NF4 base, paged 8-bit AdamW, a tiny Llama) =="
"$PY" -m pytest -q -p no:cacheprovider tests/test_qlora.py tests/test_eval_bnb.py 2>&1 | tee "$LOG/tests_qlora.txt" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$PY" -c "import sys; from mfqat.data.sources import tiny_llama, tiny_tokenizer; t = tiny_tokenizer(); \
tiny_llama(vocab_size=len(t), tie=True).save_pretrained(sys.argv[1]); t.save_pretrained(sys.argv[1])" "$LOG/tiny"
"$PY" -m mfqat.cli train --model "$LOG/tiny" --no-qat --base nf4 --lora-rank 8 --optim paged_adamw8bit --steps 2 \
  --seq-len 32 --batch-size 2 --eval-blocks 2 --out "$LOG/qlora_run" 2>&1 | tail -4 | tee "$LOG/qlora_run.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit "$status"
