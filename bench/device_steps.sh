# Helpers for a device call (source it from the repository root on the GPU machine):
#
#   source bench/device_steps.sh
#   step tests 300 python3 -m pytest -n 16 tests/test_gpu.py -k decode
#   step sweep 120 python3 bench/sweep_cliffs_gpu.py --only "Nq 17"
#   save_kernel_cache
#
# `step NAME SECONDS COMMAND...` runs the command under a time limit with its output in
# $OUT/NAME.txt, prints the exit status and the output's last line, and returns the status. A time limit kills
# pytest but not its xdist workers, which then keep the GPU and the CPUs busy through the
# next steps (bench/NOTES-gpu.md, v50): `step` kills them after every step.
#
# The GPU suites compile a few hundred kernels on a cold cache (~3-5 minutes at 16 workers).
# CuPy's cache (CUPY_CACHE_DIR, here .kcache) survives between calls only while the machine
# stays warm; `save_kernel_cache` sends it back in $OUT as k.tgz.part* (files come back at
# most 16 MiB each), and a later call that carries .kcache_in (ignored by git; the parts
# there, or them joined into .kcache_in/k.tgz) starts from it: kernels whose sources did
# not change load instead of compiling.
export PYTHONPATH=${PYTHONPATH:-$PWD} CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/.kcache}
export PYTHONUNBUFFERED=1
OUT=${OUT:-device-logs}
mkdir -p "$OUT" "$CUPY_CACHE_DIR"
# Kernels this call compiles are newer than the marker; those it loads from the carried
# cache, whose access times are set back on extraction, are read after it.
touch -d "@$(( $(date +%s) - 1 ))" /tmp/kernel_cache_marker
cache_parts=(.kcache_in/k.tgz.part*)
[ -f .kcache_in/k.tgz ] && cache_parts=(.kcache_in/k.tgz)
if [ -f "${cache_parts[0]}" ]; then
    cat "${cache_parts[@]}" | tar xzf - -C "$(dirname "$CUPY_CACHE_DIR")"
    find "$CUPY_CACHE_DIR" -type f -exec touch -a -d 2000-01-01 {} +
    echo "kernel cache: $(find "$CUPY_CACHE_DIR" -type f | wc -l) files from .kcache_in"
fi

step() {  # step NAME SECONDS COMMAND...: the command's exit status
    local name=$1 limit=$2 status
    shift 2
    echo "== $name"
    timeout -k 5 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    status=$?
    echo "rc=$status $(tail -n 1 "$OUT/$name.txt")"
    pkill -9 -f "sys.stdin.readline" 2>/dev/null  # pytest-xdist workers a time limit left
    return $status
}

save_kernel_cache() {  # $OUT/k.tgz.partaa, ab, ...: 15 MiB each
    # Only the kernels this call compiled or loaded (see the marker above), so that the
    # cache stays within what a call carries (64 MiB) as sources change.
    (cd "$(dirname "$CUPY_CACHE_DIR")" && find "$(basename "$CUPY_CACHE_DIR")" -type f \
        \( -newer /tmp/kernel_cache_marker -o -anewer /tmp/kernel_cache_marker \) \
        > /tmp/kernel_cache_files)
    # A file system that keeps no access times (noatime) shows no loads: keep them all.
    if [ -f "${cache_parts[0]}" ] && ! find "$CUPY_CACHE_DIR" -type f -anewer /tmp/kernel_cache_marker \
        ! -newer /tmp/kernel_cache_marker | grep -q .; then
        (cd "$(dirname "$CUPY_CACHE_DIR")" && find "$(basename "$CUPY_CACHE_DIR")" -type f \
            > /tmp/kernel_cache_files)
    fi
    tar czf /tmp/kernel_cache.tgz -C "$(dirname "$CUPY_CACHE_DIR")" -T /tmp/kernel_cache_files \
        && split -b 15m /tmp/kernel_cache.tgz "$OUT/k.tgz.part" \
        && echo "kernel cache: $(du -h /tmp/kernel_cache.tgz | cut -f1) in $OUT/k.tgz.part*"
}
