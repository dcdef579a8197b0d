#!/usr/bin/env bash
# Check eagertp on a CUDA machine: the CUDA tests (tests/test_cuda.py), then
# benchmarks/gpu_check.py (the symm_mem backend on every visible device against
# plain eager, with timings). At most 8 minutes (4 + 4, each bounded) on one GPU.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]      # OUTDIR defaults to ./gpu-check-logs
#
# Install the test extra first, next to the CUDA build of torch you use
# (pip keeps that torch, eagertp asks for torch >= 2.11):
#
#   pip install -e '.[test]'
#
# Logs go to OUTDIR/test_cuda.log and OUTDIR/gpu_check.log, gpu_check.py's
# results to OUTDIR/gpu_check.json. Exits non-zero if a test or a check fails.
# PYTHON names the interpreter (default python3); the checkout's eagertp is
# imported, installed or not.
set -u -o pipefail
out=${1:-gpu-check-logs}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 1
cd "$(dirname "$0")/.." || exit 1
python=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$python" -c "import torch; print('torch', torch.__version__, '| CUDA:', torch.cuda.is_available() and torch.cuda.get_device_name())"

status=0
# NB: what tests/test_cuda.py imports, and no more (hypothesis is the CPU suite's).
if "$python" -c "import pytest, expecttest" 2>/dev/null; then
  # The CUDA cases only: their CPU twins run in the CPU suite, and gpu_check.py runs below.
  (cd tests && timeout 240 "$python" -m pytest -q -rs -p no:cacheprovider test_cuda.py \
    -k "not on_cpu and not gpu_check" 2>&1 | tee "$out/test_cuda.log") || status=1
else
  echo "gpu_check: the CUDA tests need pytest and expecttest (pip install -e '.[test]'); skipping them" \
    | tee "$out/test_cuda.log"
  status=1
fi
timeout 240 "$python" benchmarks/gpu_check.py --json "$out/gpu_check.json" 2>&1 | tee "$out/gpu_check.log" || status=1
echo "gpu_check: logs in $out; exit $status"
exit $status
