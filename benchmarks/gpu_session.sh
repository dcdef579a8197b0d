#!/usr/bin/env bash
# The prepared device run for a session that has a GPU (issue #4), in one call:
# the CUDA tests (tests/test_cuda.py) and benchmarks/gpu_check.py, about 2-4
# minutes on a warm H200. Logs and gpu_check's JSON land in $OUT.
#
# The device machine's python3 has a CUDA torch but no expecttest, which the
# tests import. Fetch its wheel here first (PyPI works here, not there):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl expecttest
#
# then, with the device tool: run(command="bash benchmarks/gpu_session.sh",
# carry=[".whl"], timeout_s=540). .whl/ is git-ignored.
set -u -o pipefail
OUT=${OUT:-/tmp/eagertp-gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import expecttest" 2>/dev/null || { echo "gpu_session: no expecttest here; see the header"; exit 1; }
python3 -c "import torch; print('torch', torch.__version__, '| CUDA:', torch.cuda.is_available() and torch.cuda.get_device_name())"

status=0
# The CUDA cases only: their CPU twins ran in CI, and gpu_check runs below.
(cd tests && timeout 240 python3 -m pytest -q -rs -p no:cacheprovider test_cuda.py \
  -k "not on_cpu and not gpu_check" 2>&1 | tee "$OUT/test_cuda.log") || status=1
timeout 240 python3 benchmarks/gpu_check.py --json "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log" || status=1
echo "gpu_session: exit $status"
exit $status
