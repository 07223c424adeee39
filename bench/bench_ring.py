"""Ring attention (tileattn.distributed) benchmark: exactness, scaling, reach.

    mpiexec -n 2 python bench/bench_ring.py                         # CPU, a small table
    python bench/bench_ring.py --simulate 2                         # 2 ranks in one process
    NCCL_NVLS_ENABLE=0 mpiexec -n 2 python bench/bench_ring.py --gpu --dtype bfloat16 \\
        --heads 32 --head-dim 128 --seqlens 131072 524288 1048576 --causal both --layout zigzag
    NCCL_NVLS_ENABLE=0 mpiexec -n 2 python bench/bench_ring.py --gpu --check   # exactness
    NCCL_NVLS_ENABLE=0 mpiexec -n 2 python bench/bench_ring.py --gpu --reach   # longest N

Scaling (the default mode), for each N and causal setting:

* ``t(1, N)``: `tileattn.forward` (and `backward`) of the whole problem on rank 0's device
  alone (``--no-baseline`` skips it, e.g. to rerun the ring alone).
* ``t(P, N)``: `td.forward` (and `td.backward`) on P ranks, each holding N/P rows; the
  slowest rank's time. Efficiency ``t(1, N) / (P t(P, N))``.
* time per ring step (the slowest rank's slowest and fastest step: zigzag keeps them level
  under a causal mask, contiguous does not), and the forward's time after its last step
  (the cast of the float32 accumulator to the input dtype).
* share of communication hidden behind compute: ``t_comm`` is the time of the call's
  shifts alone, with no compute; the exposed part is the time the compute stream spent
  waiting for arriving arrays in the timed call (events recorded before and after each
  wait, the slowest rank's sum): hidden = ``1 - exposed / t_comm`` (1 = every byte moved
  while computing; clipped to [0, 1]). A wait also lasts while a slower neighbour is still
  computing what it sends, so the exposed time is an upper bound on the communication left
  in the open and the hidden share a lower bound.
* peak memory per rank: GPU, the peak of CuPy's pool during the run (inputs included);
  CPU, the process's peak resident set.

The scaling mode first checks the ring against the float64 golden model on a small problem
of the same heads and dtype. Every mode prints each row as soon as it has it (runs are time-limited), and a markdown
table at the end. Times are wall-clock around a synchronised device, the ranks started
together by an all-gather; ``--repeats`` runs (median) after one warm-up call at a small N
that compiles the kernels.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np

import tileattn
import tileattn.distributed as td
from tileattn.distributed.ring import ring_backward, ring_forward
from tileattn.testing import attention_error, bfloat16


def log(group, message):
    if group.rank == 0:
        print(message, flush=True)


# --------------------------------------------------------------------------- devices


class Device:
    """Array creation, synchronisation and peak memory for host or GPU arrays."""

    def __init__(self, gpu: bool, device_id: int = 0):
        self.gpu = gpu
        if gpu:
            import cupy

            self.cupy = cupy
            self.device_id = device_id
            cupy.cuda.Device(device_id).use()
            self.pool = cupy.get_default_memory_pool()
            self.peak = 0
            pool = self.pool

            def malloc(size):
                memory = pool.malloc(size)
                self.peak = max(self.peak, pool.used_bytes())
                return memory

            cupy.cuda.set_allocator(malloc)

    def random(self, shape, dtype, seed):
        """Normal values in `dtype`, drawn one (batch, head) slice at a time so that the
        float32 draw never needs more than a slice of extra memory (a 1M x 128 bfloat16
        head is 256 MiB; the whole array at 32 heads would need 16 GiB more)."""
        if not self.gpu:
            values = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
            return values.astype(dtype)
        from tileattn.distributed.layouts import empty_like_shape, from_float

        cupy = self.cupy
        rng = cupy.random.default_rng(seed)
        out = empty_like_shape(cupy.empty(0), shape, dtype)
        bits = out.view(np.uint16) if out.dtype.itemsize == 2 else out
        for index in np.ndindex(*shape[:-2]):
            values = from_float(rng.standard_normal(shape[-2:], dtype=np.float32), dtype)
            bits[index] = values.view(np.uint16) if out.dtype.itemsize == 2 else values
        return out

    def sync(self):
        if self.gpu:
            self.cupy.cuda.get_current_stream().synchronize()

    def reset_peak(self):
        if self.gpu:
            self.peak = self.pool.used_bytes()

    def peak_bytes(self) -> int:
        if self.gpu:
            return self.peak
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def to_host(self, array):
        return array.get() if self.gpu else array


def gib(n_bytes) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"


# --------------------------------------------------------------------------- timing


def timed(group, device, function, repeats):
    """Median over `repeats` of the slowest rank's wall time of `function()`."""
    times = []
    result = None
    for _ in range(repeats):
        device.sync()
        group.allgather(None)  # start together
        start = time.perf_counter()
        result = function()
        device.sync()
        elapsed = time.perf_counter() - start
        times.append(max(group.allgather(elapsed)))
    return statistics.median(times), result


def local_problem(device, args, n, rank, dtype):
    """This rank's shards, drawn directly at N/P rows (no rank ever holds the whole)."""
    n_local = n // args.ranks
    q = device.random((1, args.heads, n_local, args.head_dim), dtype, 4 * rank)
    k = device.random((1, args.kv_heads, n_local, args.head_dim), dtype, 4 * rank + 1)
    v = device.random((1, args.kv_heads, n_local, args.head_dim), dtype, 4 * rank + 2)
    do = device.random((1, args.heads, n_local, args.head_dim), dtype, 4 * rank + 3)
    return q, k, v, do


class StepTracer:
    """A ring's `trace` callback recording when each event was reached (CUDA events on the
    compute stream on the GPU), read back after the call: the forward's step times and the
    time the compute stream spent waiting for arriving arrays."""

    def __init__(self, device):
        self.device = device
        self.marks = []  # (event name, CUDA event or host time)

    def _now(self):
        if self.device.gpu:
            event = self.device.cupy.cuda.Event()
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, a, b) -> float:
        if self.device.gpu:
            return self.device.cupy.cuda.get_elapsed_time(a, b) / 1e3
        return b - a

    def __call__(self, name, step):
        self.marks.append((name, self._now()))

    def begin(self):
        self.marks = [("begin", self._now())]

    def step_times(self) -> list:
        """Seconds from the start to the first step's end, between steps' ends, and from the
        last step's end to "forward-end" (waits included: they are part of the time)."""
        ends = [mark for name, mark in self.marks if name in ("begin", "forward",
                                                               "forward-end")]
        return [self._seconds(a, b) for a, b in zip(ends, ends[1:])]

    def exposed(self) -> float:
        """Seconds between each wait's start and the arrival it waited for."""
        return sum(self._seconds(previous[1], mark[1])
                   for previous, mark in zip(self.marks, self.marks[1:])
                   if mark[0].endswith("-received"))


def shift_time(group, device, arrays, shifts, repeats):
    """The slowest rank's time for `shifts` ring shifts of `arrays`, with no compute."""
    like = arrays[0]
    transport = group.transport("cuda" if device.gpu else "host", like)

    def run():
        block = arrays
        for _ in range(shifts):
            block = transport.shift(block).wait()
    return timed(group, device, run, repeats)[0]


# --------------------------------------------------------------------------- scaling


def validate_small(group, device, args, dtype, causal_settings):
    """Before timing: the ring on a small problem of the benchmark's shape against the
    float64 golden model of the whole (tileattn's reference backend on the host)."""
    n = 2 * group.size * 128
    rng = np.random.default_rng(7)
    heads, kv_heads = min(args.heads, 4), min(args.kv_heads, 4)
    shapes = ((1, heads, n, args.head_dim), (1, kv_heads, n, args.head_dim),
              (1, kv_heads, n, args.head_dim), (1, heads, n, args.head_dim))
    whole = [rng.standard_normal(shape).astype(dtype) for shape in shapes]
    wide = [a.astype(np.float64) for a in whole]
    to_device = device.cupy.asarray if device.gpu else (lambda a: a)
    worst = 0.0
    for causal in causal_settings:
        local = [to_device(td.shard(a, group, layout=args.layout)) for a in whole]
        o, lse = td.forward(*local[:3], group=group, layout=args.layout, causal=causal,
                            return_lse=True, backend=args.backend)
        grads = td.backward(local[3], *local[:3], o, lse, group=group, layout=args.layout,
                            causal=causal, backend=args.backend)
        o_gold, lse_gold = tileattn.forward(*wide[:3], causal=causal, return_lse=True,
                                            backend="reference")
        o_all = device.to_host(td.unshard(o, group, layout=args.layout))
        grads_gold = tileattn.backward(wide[3], *wide[:3], o_all.astype(np.float64),
                                       lse_gold, causal=causal, backend="reference")
        for got, want in zip((o, *grads), (o_gold, *grads_gold)):
            gathered = device.to_host(td.unshard(got, group, layout=args.layout))
            worst = max(worst, attention_error(gathered, want, dtype))
    if worst > 1:
        raise SystemExit(f"the ring is out of tolerance on a small problem ({worst:.3g}x); "
                         "not timing it")
    log(group, f"validated against the golden model at N = {n}: worst error {worst:.3g}x "
               "the tolerance")


def scaling(group, device, args):
    dtype = _dtype(args.dtype)
    causal_settings = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    validate_small(group, device, args, dtype, causal_settings)
    rows = []
    # Compile every kernel the timed runs take before timing them: the GPU's tiles depend on
    # the key count, so each N is warmed up at its own length, on one head (a 32nd of the
    # work at 32 heads).
    one_head = argparse.Namespace(**{**vars(args), "heads": 1, "kv_heads": 1})
    for n in args.seqlens:
        for causal in causal_settings:
            warm_up(group, device, one_head, n, causal, dtype)
    device.sync()
    log(group, f"# {group.size} ranks ({type(group).__name__}), {'GPU' if device.gpu else 'CPU'}"
               f", {args.dtype}, {args.heads} heads / {args.kv_heads} kv heads of D = "
               f"{args.head_dim}, layout={args.layout}")
    for n in args.seqlens:
        for causal in causal_settings:
            row = {"N": n, "causal": causal}
            if not args.no_baseline:
                row.update(baseline(group, device, args, n, causal, dtype))
            row.update(ring(group, device, args, n, causal, dtype))
            for kind in ("fwd", "fwdbwd"):
                if f"t1_{kind}" in row:
                    row[f"eff_{kind}"] = row[f"t1_{kind}"] / (group.size * row[f"tP_{kind}"])
            rows.append(row)
            if device.gpu:
                device.pool.free_all_blocks()
            log(group, "row: " + ", ".join(f"{key}={_show(value)}" for key, value in row.items()))
    log(group, "\n" + table(rows, group.size))


def warm_up(group, device, args, n, causal, dtype):
    """One untimed ring forward and backward at N (and the single-device pass on rank 0)."""
    q, k, v, do = local_problem(device, args, n, group.rank, dtype)
    o, lse = td.forward(q, k, v, group=group, layout=args.layout, causal=causal,
                        return_lse=True, backend=args.backend)
    td.backward(do, q, k, v, o, lse, group=group, layout=args.layout, causal=causal,
                backend=args.backend)
    del q, k, v, do, o, lse
    if group.rank == 0 and not args.no_baseline:
        shape = (1, 1, n, args.head_dim)
        q, k, v, do = (device.random(shape, dtype, seed) for seed in range(4))
        o, lse = tileattn.forward(q, k, v, causal=causal, return_lse=True,
                                  backend=args.backend)
        tileattn.backward(do, q, k, v, o, lse, causal=causal, backend=args.backend)
        del q, k, v, do, o, lse
    if device.gpu:
        device.pool.free_all_blocks()
    quiet_barrier(group)


def baseline(group, device, args, n, causal, dtype):
    """t(1, N): tileattn.forward/backward of the whole problem on rank 0 alone."""
    result = {}
    if group.rank == 0:
        shape_q, shape_kv = (1, args.heads, n, args.head_dim), (1, args.kv_heads, n, args.head_dim)
        q, k, v, do = (device.random(shape, dtype, seed) for shape, seed in
                       ((shape_q, 10), (shape_kv, 11), (shape_kv, 12), (shape_q, 13)))
        local = _Single()
        t_fwd, (o, lse) = timed(local, device, lambda: tileattn.forward(
            q, k, v, causal=causal, return_lse=True, backend=args.backend), args.repeats)
        t_bwd, _ = timed(local, device, lambda: tileattn.backward(
            do, q, k, v, o, lse, causal=causal, backend=args.backend), args.repeats)
        result = {"t1_fwd": t_fwd, "t1_fwdbwd": t_fwd + t_bwd}
        del q, k, v, do, o, lse
        if device.gpu:
            device.pool.free_all_blocks()
    quiet_barrier(group)
    return group.allgather(result)[0]


def quiet_barrier(group):
    """Wait for every rank without spinning: MPICH busy-polls in a blocking collective, and
    on the CPU the waiting ranks would take cores from rank 0's single-process baseline."""
    comm = getattr(group, "comm", None)
    if comm is None:
        group.allgather(None)
        return
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


class _Single:
    def allgather(self, value):
        return [value]


def ring(group, device, args, n, causal, dtype):
    q, k, v, do = local_problem(device, args, n, group.rank, dtype)
    options = {"layout": args.layout, "causal": causal, "window": None,
               "backend": args.backend}
    forward_options = {"scale": None, "softcap": None, "alibi_slopes": None, "dropout_p": 0.0,
                       "seed": None, "block_q": None, "block_k": None}
    forward_trace, backward_trace = StepTracer(device), StepTracer(device)

    def forward():
        forward_trace.begin()
        return ring_forward(group, q, k, v, return_lse=True, options=forward_options,
                            trace=forward_trace, **options)

    def backward(o, lse):
        backward_trace.begin()
        return ring_backward(group, do, q, k, v, o, lse,
                             options={**forward_options, "deterministic": True},
                             trace=backward_trace, **options)

    device.reset_peak()
    t_fwd, (o, lse) = timed(group, device, forward, args.repeats)
    t_bwd, _ = timed(group, device, lambda: backward(o, lse), args.repeats)
    peak = device.peak_bytes()
    *steps, cast = forward_trace.step_times()  # the last timed forward's
    exposed = (forward_trace.exposed(), backward_trace.exposed())
    m_fwd = m_bwd = float("nan")
    if not args.no_hidden:
        shifts = group.size - 1
        m_fwd = shift_time(group, device, [k, v], shifts, args.repeats) if shifts else 0.0
        accumulate = np.float64 if dtype == np.float64 else np.float32
        grads = [a.astype(accumulate) for a in (k, v)]
        m_bwd = m_fwd + (shift_time(group, device, grads, group.size, args.repeats)
                         if shifts else 0.0)
        del grads
    per_rank = group.allgather((min(steps), max(steps), cast, exposed, peak))

    def hidden(exposed_seconds, t_comm):
        if not t_comm > 0:
            return float("nan")
        return min(1.0, max(0.0, 1.0 - exposed_seconds / t_comm))

    worst_exposed = [max(rank[3][kind] for rank in per_rank) for kind in (0, 1)]
    return {"tP_fwd": t_fwd, "tP_fwdbwd": t_fwd + t_bwd,
            "step_min": min(rank[0] for rank in per_rank),
            "step_max": max(rank[1] for rank in per_rank),
            "tail": max(rank[2] for rank in per_rank),
            "exposed_fwd": worst_exposed[0], "exposed_fwdbwd": sum(worst_exposed),
            "hidden_fwd": hidden(worst_exposed[0], m_fwd),
            "hidden_fwdbwd": hidden(sum(worst_exposed), m_bwd),
            "comm_fwd": m_fwd, "comm_fwdbwd": m_bwd,
            "peak": max(rank[4] for rank in per_rank)}


def _show(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(rows, size) -> str:
    head = (f"| N | causal | t(1) fwd s | t({size}) fwd s | eff fwd | t(1) fwd+bwd s | "
            f"t({size}) fwd+bwd s | eff fwd+bwd | step s (min-max) | cast s | "
            f"comm hidden fwd (exposed of shifts) | comm hidden fwd+bwd | peak mem / rank |")
    lines = [head, "|" + "|".join("---" for _ in range(13)) + "|"]
    for row in rows:
        def get(key, fmt="{:.3f}", row=row):
            return fmt.format(row[key]) if key in row and not (
                isinstance(row[key], float) and math.isnan(row[key])) else "—"

        def hidden(kind, get=get):
            return (f"{get('hidden_' + kind, '{:.0%}')} ({get('exposed_' + kind)} of "
                    f"{get('comm_' + kind)} s)")
        lines.append(
            f"| {row['N']:,} | {'yes' if row['causal'] else 'no'} | {get('t1_fwd')} | "
            f"{get('tP_fwd')} | {get('eff_fwd', '{:.2f}')} | {get('t1_fwdbwd')} | "
            f"{get('tP_fwdbwd')} | {get('eff_fwdbwd', '{:.2f}')} | "
            f"{row['step_min']:.3f}-{row['step_max']:.3f} | {row['tail']:.3f} | "
            f"{hidden('fwd')} | {hidden('fwdbwd')} | {gib(row['peak'])} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- check


def check(group, device, args):
    """Ring vs one device on the same arrays, within the dtype tolerances of the tests."""
    n = args.check_seqlen
    failures = 0
    dtypes = args.check_dtypes
    log(group, f"# check: N = {n}, {args.heads}/{args.kv_heads} heads, D = {args.head_dim}, "
               f"ring of {group.size} vs tileattn.forward/backward on one device")
    for dtype_name in dtypes:
        dtype = _dtype(dtype_name)
        shape_q = (1, args.heads, n, args.head_dim)
        shape_kv = (1, args.kv_heads, n, args.head_dim)
        whole = [device.random(shape, dtype, seed) for shape, seed in
                 ((shape_q, 1), (shape_kv, 2), (shape_kv, 3), (shape_q, 4))]
        for layout in td.LAYOUTS:
            for causal in (False, True):
                start = time.perf_counter()
                local = [td.shard(a, group, layout=layout) for a in whole]
                o, lse = td.forward(*local[:3], group=group, layout=layout, causal=causal,
                                    return_lse=True, backend=args.backend)
                grads = td.backward(local[3], *local[:3], o, lse, group=group, layout=layout,
                                    causal=causal, backend=args.backend)
                device.sync()
                ring_s = time.perf_counter() - start
                o_one, lse_one = tileattn.forward(*whole[:3], causal=causal, return_lse=True,
                                                  backend=args.backend)
                grads_one = tileattn.backward(whole[3], *whole[:3], o_one, lse_one,
                                              causal=causal, backend=args.backend)
                errors = {}
                for name, got, want in zip(("o", "lse", "dq", "dk", "dv"),
                                           (o, lse, *grads), (o_one, lse_one, *grads_one)):
                    axis = -1 if name == "lse" else -2
                    mine = td.shard(want, group, layout=layout, axis=axis)
                    errors[name] = attention_error(device.to_host(got), device.to_host(mine),
                                                   dtype, lse_magnitude=1.0)
                    del mine
                worst, worst_name = max((error, name) for e in group.allgather(errors)
                                        for name, error in e.items())
                ok = worst <= 1.0
                failures += not ok
                log(group, f"{'ok  ' if ok else 'FAIL'} {dtype_name} {layout} "
                           f"causal={causal}: worst error {worst:.3g}x the tolerance "
                           f"({worst_name}; ring fwd+bwd {ring_s:.2f} s)")
                del local, o, lse, grads, o_one, lse_one, grads_one
        del whole
        if device.gpu:
            device.pool.free_all_blocks()
    log(group, f"check: {failures} failures")
    return failures


# --------------------------------------------------------------------------- reach


def estimate_bytes(args, n_local, dtype) -> int:
    """Memory a rank needs for a ring fwd+bwd at `n_local` rows: the bf16 q, k, v, o, do,
    dq, dk, dv shards, one K/V block arriving, float32 accumulators (o, dq, two dk/dv pairs),
    lse, and a quarter again for the backend's work space."""
    item = np.dtype(dtype).itemsize
    q_elems = args.heads * n_local * args.head_dim
    kv_elems = args.kv_heads * n_local * args.head_dim
    shards = item * (4 * q_elems + 4 * kv_elems) + item * 2 * kv_elems
    accumulators = 4 * (2 * q_elems + 4 * kv_elems)
    return int(1.25 * (shards + accumulators))


def reach(group, device, args):
    """Double N from --reach-start while every rank expects the ring fwd+bwd to fit."""
    dtype = _dtype(args.dtype)
    n = args.reach_start
    longest = None
    log(group, f"# reach: causal fwd+bwd, {args.heads} heads of D = {args.head_dim}, "
               f"{args.dtype}, {group.size} ranks, layout={args.layout}")
    while True:
        free = device.cupy.cuda.runtime.memGetInfo()[0] + device.pool.free_bytes() \
            if device.gpu else 1 << 62
        fits = estimate_bytes(args, n // group.size, dtype) < 0.95 * free
        if not all(group.allgather(fits)):
            log(group, f"N = {n:,}: predicted not to fit on every rank; stopping")
            break
        device.reset_peak()
        q, k, v, do = local_problem(device, args, n, group.rank, dtype)
        start = time.perf_counter()
        o, lse = td.forward(q, k, v, group=group, layout=args.layout, causal=True,
                            return_lse=True, backend=args.backend)
        td.backward(do, q, k, v, o, lse, group=group, layout=args.layout, causal=True,
                    backend=args.backend)
        device.sync()
        elapsed = max(group.allgather(time.perf_counter() - start))
        peaks = group.allgather(device.peak_bytes())
        longest = n
        log(group, f"N = {n:,} ok: fwd+bwd {elapsed:.1f} s, peak memory per rank "
                   + ", ".join(gib(p) for p in peaks))
        del q, k, v, do, o, lse
        if device.gpu:
            device.pool.free_all_blocks()
        if args.reach_stop and n >= args.reach_stop:
            break
        n *= 2
    log(group, f"reach: longest N = {longest:,}" if longest else "reach: nothing ran")


# --------------------------------------------------------------------------- main


DTYPES = ("float16", "bfloat16", "float32", "float64")


def _dtype(name):
    return bfloat16() if name == "bfloat16" else np.dtype(name)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", type=int, metavar="P",
                        help="P ranks as threads of this process (no mpiexec)")
    parser.add_argument("--gpu", action="store_true", help="CuPy arrays (NCCL under mpiexec)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--seqlens", type=int, nargs="+", default=None)
    parser.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    parser.add_argument("--layout", choices=td.LAYOUTS, default="zigzag")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip t(1, N), the single-device run")
    parser.add_argument("--no-hidden", action="store_true",
                        help="skip timing the shifts alone (the hidden-communication "
                             "columns)")
    parser.add_argument("--check", action="store_true", help="exactness mode")
    parser.add_argument("--check-seqlen", type=int, default=None,
                        help="default 65536 on GPU, 1024 on CPU")
    parser.add_argument("--check-dtypes", nargs="+", default=None,
                        help="default float16 bfloat16 float32 on GPU, float32 float64 on CPU")
    parser.add_argument("--reach", action="store_true", help="longest causal N mode")
    parser.add_argument("--reach-start", type=int, default=1 << 19)
    parser.add_argument("--reach-stop", type=int, default=1 << 23)
    args = parser.parse_args(argv)
    gpu = args.gpu
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    if args.reach:
        args.heads = args.heads or 8
        args.head_dim = args.head_dim or 128
    if args.check:
        args.heads = args.heads or (32 if gpu else 4)
        args.kv_heads = args.kv_heads or (8 if gpu else 2)
        args.head_dim = args.head_dim or (128 if gpu else 64)
        args.check_seqlen = args.check_seqlen or (65536 if gpu else 1024)
        args.check_dtypes = args.check_dtypes or (["float16", "bfloat16", "float32"] if gpu
                                                  else ["float32", "float64"])
    args.heads = args.heads or (32 if gpu else 4)
    args.kv_heads = args.kv_heads or args.heads
    args.head_dim = args.head_dim or (128 if gpu else 64)
    args.seqlens = args.seqlens or ([131072, 524288] if gpu else [2048, 4096])
    _check_arguments(parser, args)
    return args


def _check_arguments(parser, args) -> None:
    """One-line errors (exit 2) for what the ring or the kernels would refuse later."""
    positive = {"--simulate": args.simulate, "--heads": args.heads,
                "--kv-heads": args.kv_heads, "--head-dim": args.head_dim,
                "--repeats": args.repeats, "--check-seqlen": args.check_seqlen,
                "--reach-start": args.reach_start, "--reach-stop": args.reach_stop}
    for name, value in positive.items():
        if value is not None and value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    if any(n < 1 for n in args.seqlens):
        parser.error(f"--seqlens must be at least 1 each, got {args.seqlens}")
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads "
                     f"({args.kv_heads})")
    if args.reach_start > args.reach_stop:
        parser.error(f"--reach-start ({args.reach_start}) exceeds --reach-stop "
                     f"({args.reach_stop})")
    names = [args.dtype] + list(args.check_dtypes or [])
    unknown = [name for name in names if name not in DTYPES]
    if unknown:
        parser.error(f"unknown dtype {unknown[0]!r}: choose from {', '.join(DTYPES)}")


def check_divisible(args, ranks: int) -> None:
    """Every sequence length splits into the layout's chunks (P, or 2P for zigzag): a
    one-line error before any rank starts, rather than the ring's error on every rank."""
    chunks = 2 * ranks if args.layout == "zigzag" else ranks
    lengths = ([args.check_seqlen] if args.check else [args.reach_start] if args.reach
               else args.seqlens)
    uneven = [n for n in lengths if n % chunks]
    if uneven:
        raise SystemExit(f"bench_ring.py: N = {uneven[0]} does not split into the "
                         f"{chunks} chunks of layout={args.layout!r} on {ranks} ranks")


def run(group, args):
    args.ranks = group.size
    device = Device(args.gpu, getattr(group, "local_rank", 0) if args.simulate is None else 0)
    if args.check:
        return check(group, device, args)
    if args.reach:
        return reach(group, device, args)
    return scaling(group, device, args)


def main(argv=None):
    args = parse(argv)
    if args.simulate:
        check_divisible(args, args.simulate)
        results = td.simulate(args.simulate, run, args, device=0 if args.gpu else None)
        failures = results[0]
    else:
        group = td.init()
        check_divisible(args, group.size)
        try:
            failures = run(group, args)
        except BaseException:
            # A rank that fails (out of memory in --reach, say) ends every rank: the others
            # may be waiting for it in the ring. What was printed so far stands.
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            sys.stdout.flush()
            if group.size > 1 and getattr(group, "comm", None) is not None:
                group.comm.Abort(1)
            raise
    if args.check and failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
