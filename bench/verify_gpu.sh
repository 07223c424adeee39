#!/usr/bin/env bash
# One device call that verifies the GPU work end to end (run from the repository root on the
# GPU machine; logs land in $OUT, or ./verify-gpu-logs without it):
#   the whole test suite (GPU, interop with torch/JAX CUDA arrays, and everything else),
#   compute-sanitizer memcheck and racecheck over bench/sanitize_gpu.py,
#   python -m tileattn check / info, and python -m tileattn bench --backend gpu --quick.
# PYTEST_SELECT narrows the tests (e.g. PYTEST_SELECT="-k gpu"); default: all of them.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
logs=${OUT:-verify-gpu-logs}
mkdir -p "$logs"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import cupy, torch; print('cupy', cupy.__version__, '| torch', torch.__version__)"
status=0
step() {  # step NAME TIMEOUT COMMAND...: run, append its output to verify.log, print its tail
  local name=$1 limit=$2; shift 2
  echo "== $name" | tee -a "$logs/verify.log"
  timeout "$limit" "$@" >"$logs/step.log" 2>&1 || { echo "!! $name failed ($?)"; status=1; }
  cat "$logs/step.log" >>"$logs/verify.log"
  tail -n "${TAIL:-4}" "$logs/step.log"
}
step pytest 480 python3 -m pytest tests -q -n 12 -p no:cacheprovider -rs ${PYTEST_SELECT:-}
step memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/sanitize_gpu.py
step racecheck 240 compute-sanitizer --tool racecheck --error-exitcode 1 python3 bench/sanitize_gpu.py
TAIL=12 step check 120 python3 -m tileattn check --dtype float16
TAIL=14 step info 60 python3 -m tileattn info --dtype float16
TAIL=30 step bench 240 python3 -m tileattn bench --backend gpu --quick --dtype float16 --out "$logs/bench"
rm -f "$logs/step.log"
exit $status
