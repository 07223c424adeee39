#!/usr/bin/env bash
# One device call that verifies the GPU work end to end (run from the repository root on the
# GPU machine; logs land in $OUT, or ./verify-gpu-logs without it):
#   the whole test suite (GPU, interop with torch/JAX CUDA arrays, and everything else),
#   compute-sanitizer memcheck and racecheck over bench/sanitize_gpu.py,
#   python -m tileattn check / info, and python -m tileattn bench --backend gpu --quick.
# PYTEST_SELECT narrows the tests (e.g. PYTEST_SELECT="-k gpu"); default: all of them.
# The kernel cache comes from .kcache_in where the call carries it and goes back to $OUT
# (bench/device_steps.sh).
set -uo pipefail
export XLA_PYTHON_CLIENT_PREALLOCATE=false
logs=${OUT:-verify-gpu-logs}
OUT=$logs
source bench/device_steps.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import cupy, torch; print('cupy', cupy.__version__, '| torch', torch.__version__)"
status=0
verify_step() {  # NAME TIMEOUT COMMAND...: `step`, its output also appended to verify.log
  local name=$1
  echo "== $name" >>"$logs/verify.log"
  step "$@" || { echo "!! $name failed"; status=1; }
  cat "$logs/$name.txt" >>"$logs/verify.log"
  tail -n "${TAIL:-4}" "$logs/$name.txt"
}
verify_step pytest 480 python3 -m pytest tests -q -n 12 -p no:cacheprovider -rs ${PYTEST_SELECT:-}
verify_step memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/sanitize_gpu.py
verify_step racecheck 240 compute-sanitizer --tool racecheck --error-exitcode 1 python3 bench/sanitize_gpu.py
TAIL=12 verify_step check 120 python3 -m tileattn check --dtype float16
TAIL=14 verify_step info 60 python3 -m tileattn info --dtype float16
TAIL=30 verify_step bench 240 python3 -m tileattn bench --backend gpu --quick --dtype float16 --out "$logs/bench"
save_kernel_cache
exit $status
