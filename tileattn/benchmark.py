"""``python -m tileattn bench``: correctness first, then speed and memory against anchors.

Sweeps the sequence length N (with causal on and off) for one backend, and measures in the
same process every anchor available here: naive NumPy (host) or naive CuPy (GPU)
attention, and PyTorch's ``scaled_dot_product_attention`` when torch is installed. Reports
GFLOP/s (TFLOP/s on the GPU) with FlashAttention's FLOP count (forward ``4 B H Nq Nk D``,
halved when causal; backward 2.5x forward) and each anchor's time over tileattn's (> 1 means
tileattn is faster). Peak extra memory is measured against N, each point in a fresh process
on the host, so the naive O(N^2) curve can be seen growing while tileattn's stays flat; a
naive run that the memory model says would not fit is not attempted, and the report says so
with the modelled bytes. Writes `output_files` (``bench-BACKEND.json``, ``bench-BACKEND.md``,
``speed-BACKEND.png``, ``memory-BACKEND.png``) into ``--out``, so that CPU and GPU results
can sit side by side in one folder.

Method. On each benchmark problem tileattn's result is first compared with every anchor's
(at the dtype's tolerance), then the implementations take turns, one call each per round.
On the host the best round counts (on a shared machine it is the figure least disturbed by
other work, and taking turns exposes everyone to the same disturbance), and each timed call
waits `SETTLE_SECONDS` first: OpenBLAS's worker threads behind NumPy's matmul keep spinning
for a while after a call, and whoever ran next lost half the cores to them (measured:
tileattn's forward at N=2048 ran at 85 GFLOP/s right after naive NumPy, 135 after a pause).
On the GPU the median round counts, each call synchronised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from . import anchors, backends
from .arrays import from_native, to_native
from .api import backward, forward
from .check import run_check
from .testing import attention_error

FORWARD_BACKWARD_FACTOR = 3.5  # forward + backward = (1 + 2.5) x forward FLOPs


def attention_flops(batch, heads, n_q, n_k, head_dim, causal, with_backward=False) -> float:
    """FlashAttention's FLOP count (the one its benchmarks report)."""
    flops = 4.0 * batch * heads * n_q * n_k * head_dim * (0.5 if causal else 1.0)
    return flops * (FORWARD_BACKWARD_FACTOR if with_backward else 1.0)


@dataclass
class Measurement:
    implementation: str
    head_dim: int
    n: int
    causal: bool
    direction: str  # "forward" or "forward+backward"
    seconds: float | None  # None when not run (the memory model says it would not fit)
    flops_per_second: float | None
    note: str = ""


@dataclass
class MemoryPoint:
    implementation: str
    n: int
    peak_extra_bytes: int | None
    modelled_naive_bytes: int
    note: str = ""


@dataclass
class BenchResult:
    backend: str
    device: str
    dtype: str
    batch: int
    heads: int
    head_dims: list
    measurements: list = field(default_factory=list)
    memory: list = field(default_factory=list)


# --------------------------------------------------------------------------- timing


SETTLE_SECONDS = 0.3


def _synchronize(memory):
    if memory == "cuda":
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def time_in_turns(functions: dict, memory: str, rounds: int) -> dict:
    """Seconds per implementation (name -> zero-argument callable), taking turns; see the
    module doc. Every function runs once untimed first (compilation, caches)."""
    times = {name: [] for name in functions}
    for function in functions.values():
        function()
        _synchronize(memory)
    for _ in range(rounds):
        for name, function in functions.items():
            if memory == "host":
                time.sleep(SETTLE_SECONDS)
            start = time.perf_counter()
            function()
            _synchronize(memory)
            times[name].append(time.perf_counter() - start)
    pick = min if memory == "host" else (lambda values: float(np.median(values)))
    return {name: pick(values) for name, values in times.items()}


def draw_progress(done: int, total: int, label: str, stream=None):
    """Redraw a one-line progress bar (on stderr by default); ends the line when done.
    Its signature is the ``progress(done, total, label)`` that backends' ``warmup`` call."""
    stream = stream or sys.stderr
    width = 30
    filled = int(width * done / max(total, 1))
    stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<40}")
    if done >= total:
        stream.write("\n")
    stream.flush()


class Progress:
    """A one-line progress bar on stderr, advanced one step at a time."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled

    def step(self, label: str):
        self.done += 1
        if self.enabled:
            draw_progress(self.done, self.total, label)


# --------------------------------------------------------------------------- implementations


def implementations(backend: str, memory: str, blocks: dict | None = None,
                    with_naive: bool = True) -> dict:
    """name -> (forward(q, k, v, do, causal), forward_backward(...)) in the backend's memory.

    Every forward returns ``o`` and every forward_backward ``(dq, dk, dv)``, so results can
    be compared across implementations.
    """
    blocks = blocks or {}

    def ours_forward(q, k, v, do, causal):
        return forward(q, k, v, causal=causal, backend=backend, **blocks)

    def ours_forward_backward(q, k, v, do, causal):
        o, lse = forward(q, k, v, causal=causal, backend=backend, return_lse=True, **blocks)
        return backward(do, q, k, v, o, lse, causal=causal, backend=backend, **blocks)

    table = {f"tileattn-{backend}": (ours_forward, ours_forward_backward)}
    if with_naive:
        if memory == "cuda":
            import cupy as xp

            naive_name = "cupy-naive"
        else:
            xp, naive_name = np, "numpy-naive"
        table[naive_name] = (
            lambda q, k, v, do, causal: anchors.naive_forward(xp, q, k, v, causal)[0],
            lambda q, k, v, do, causal: anchors.naive_forward_backward(xp, q, k, v, do,
                                                                       causal)[1:])
    if anchors.torch_available():
        table["torch-sdpa"] = (
            lambda q, k, v, do, causal: _from_torch(anchors.torch_sdpa(*_torch(q, k, v),
                                                                       causal)),
            lambda q, k, v, do, causal: tuple(_from_torch(g) for g in anchors.torch_sdpa(
                *_torch(q, k, v), causal, backward=True, do=_torch(do)[0])))
    return table


def _torch(*arrays):
    # Through tileattn's own conversion: DLPack has no bfloat16 for ml_dtypes arrays.
    return tuple(from_native(a, "torch") for a in arrays)


def _from_torch(tensor):
    return to_native(tensor.detach())


def _inputs(memory, batch, heads, n, head_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((batch, heads, n, head_dim)).astype(dtype) for _ in range(4)]
    if memory == "cuda":
        import cupy

        arrays = [cupy.asarray(a) for a in arrays]
    return arrays


def benchmark_bytes(batch, heads, n, head_dim, itemsize) -> int:
    """The arrays one timed problem holds on the host: q, k, v, do and o, dq, dk, dv, plus
    float32 or float64 working copies of as many (the CPU backend's contiguous inputs and
    the anchors' outputs)."""
    return 16 * batch * heads * n * head_dim * max(itemsize, 4)


def naive_bytes(batch, heads, n, itemsize) -> int:
    """What naive attention must hold at once: the scores and probabilities, N x N each."""
    return 2 * batch * heads * n * n * itemsize


# The naive forward + backward holds about three times `naive_bytes` (the backward adds dP
# and dS beside P), so it is run only where that fits the budget of `_naive_budget`.
NAIVE_HEADROOM = 3


def naive_skip_note(modelled: int, budget: int) -> str | None:
    """Why the naive anchor is not run for `modelled` bytes of N x N matrices, or None when
    it fits: a decision of the memory model, not a measured out-of-memory error."""
    if modelled * NAIVE_HEADROOM <= budget:
        return None
    return (f"not run: the memory model gives {modelled * NAIVE_HEADROOM / 1e9:.1f} GB "
            f"({NAIVE_HEADROOM} x {modelled / 1e9:.2f} GB of N x N matrices), over the "
            f"{budget / 1e9:.1f} GB budget (a quarter of the memory); not measured")


def check_agreement(table: dict, ours: str, inputs, causal: bool, direction: str, dtype):
    """On the benchmark problem itself, tileattn must agree with every anchor: within twice
    the dtype's tolerance, since two results that are each within it of the exact answer
    can differ by twice it (tileattn's own bound against the golden model is `run_check`).
    A larger gap means the anchor computes something else, and timing it would mislead."""
    index = 0 if direction == "forward" else 1
    mine = table[ours][index](*inputs, causal)
    for name, functions in table.items():
        if name == ours:
            continue
        theirs = functions[index](*inputs, causal)
        pairs = [(mine, theirs)] if direction == "forward" else list(zip(mine, theirs))
        for label, (a, b) in zip(("o",) if direction == "forward" else ("dq", "dk", "dv"),
                                 pairs):
            error = attention_error(_host(a), _host(b), dtype)
            if error > 2.0:
                raise AssertionError(f"{label}: tileattn and {name} disagree by {error:.3g}x "
                                     f"the {np.dtype(dtype).name} tolerance")


def _host(array):
    return array if isinstance(array, np.ndarray) else array.get()


# --------------------------------------------------------------------------- memory


_HOST_MEMORY_PROBE = """
import json, sys
sys.path.insert(0, {root!r})
import numpy as np
from tileattn import benchmark
name, n, head_dim, dtype, causal, backend = {args!r}
if dtype == "bfloat16":
    import ml_dtypes  # noqa: F401  (NumPy knows bfloat16 only through ml_dtypes)
table = benchmark.implementations(backend, "host")
forward_backward = table[name][1]

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field + " not in /proc/self/status")

q, k, v, do = benchmark._inputs("host", 1, 1, n, head_dim, dtype)
small = benchmark._inputs("host", 1, 1, min(n, 1024), head_dim, dtype)
forward_backward(*small, causal)  # load kernels and BLAS buffers outside the measurement
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the resident high-water mark VmHWM to the current size
before = status("VmRSS")
grads = forward_backward(q, k, v, do, causal)
peak = status("VmHWM")
outputs = sum(g.nbytes for g in grads) + q.nbytes + n * 4  # dq, dk, dv; o; a float32 lse
print(json.dumps(peak - before - outputs))
"""


def host_peak_extra_bytes(name: str, n: int, head_dim: int = 64, dtype="float32",
                          causal: bool = True, backend: str = "cpu") -> int:
    """Peak resident memory that one forward + backward of implementation `name` needs
    beyond its inputs and outputs (``o``, ``lse``, ``dq``, ``dk``, ``dv``; one head of
    length `n`), measured in a fresh
    process: the resident high-water mark is reset (Linux ``/proc/self/clear_refs``) after
    a warm-up, so compilation and BLAS set-up do not count. tracemalloc cannot see what
    Numba kernels allocate, so this counts pages."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _HOST_MEMORY_PROBE.format(root=root, args=(name, n, head_dim,
                                                      np.dtype(dtype).name, causal, backend))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"memory probe for {name} at N={n} failed: "
                           + (result.stderr.strip().splitlines() or ["no output"])[-1])
    return max(0, int(result.stdout.strip().splitlines()[-1]))


def cuda_peak_bytes_hook():
    """A CuPy memory hook (use it as a context manager) whose ``peak`` attribute is the
    highest number of bytes held in CuPy's pool at once, counted over every allocation and
    release while it is active (the pool keeps freed blocks, so its size is no gauge)."""
    import cupy

    class PeakBytes(cupy.cuda.MemoryHook):
        name = "tileattn_peak_bytes"

        def __init__(self):
            super().__init__()
            self.current = self.peak = 0

        def malloc_postprocess(self, **kwargs):
            self.current += kwargs["mem_size"]
            self.peak = max(self.peak, self.current)

        def free_postprocess(self, **kwargs):
            self.current -= kwargs["mem_size"]

    return PeakBytes()


def _cuda_peak_extra(function, inputs, causal):
    """Peak bytes that `function` holds in CuPy's memory pool beyond its outputs (``o``,
    ``lse``, ``dq``, ``dk``, ``dv``)."""
    import cupy

    q = inputs[0]
    cupy.cuda.get_current_stream().synchronize()
    with cuda_peak_bytes_hook() as hook:
        grads = function(*inputs, causal)
        cupy.cuda.get_current_stream().synchronize()
    outputs = sum(g.nbytes for g in grads) + q.nbytes + q.shape[-2] * 4  # + o and lse
    return max(0, hook.peak - outputs)


# --------------------------------------------------------------------------- the sweep


def default_sizes(memory: str, quick: bool) -> list:
    """The sequence lengths timed when the caller names none."""
    if memory == "host":
        return [256, 512, 1024] if quick else [1024, 2048, 4096, 8192]
    return [1024, 2048, 4096] if quick else [1024, 2048, 4096, 8192, 16384]


def default_memory_sizes(quick: bool) -> list[int]:
    """N of the memory sweep (one head, batch 1, the first head dim)."""
    return [1024, 4096, 16384] if quick else [1024, 4096, 16384, 65536]


def run_bench(*, backend="cpu", quick=False, out=None, dtype="float32", head_dims=(64,),
              batch=1, heads=None, sizes=None, memory_sizes=None, rounds=None, blocks=None,
              progress=True, print_fn=print) -> BenchResult:
    """Check correctness, then time tileattn and the anchors over head dims and N (causal
    and not); measure memory against N at the first head dim. See the module doc."""
    head_dims = [head_dims] if isinstance(head_dims, int) else list(head_dims)
    module = backends.load(backend)
    memory = module.MEMORY
    dtype = np.dtype(dtype)
    if heads is None:
        heads = 8 if memory == "host" else 32
    if sizes is None:
        sizes = default_sizes(memory, quick)
    if memory_sizes is None:
        memory_sizes = default_memory_sizes(quick)
    rounds = rounds or (3 if quick else 5)
    for d in head_dims:
        if not run_check(heads=2, seq_len=128, head_dim=d, dtype=dtype, names=[backend],
                         repeats=1, print_fn=lambda *a: None):
            raise RuntimeError(f"backend {backend!r} fails the correctness check at D={d}; "
                               "not timing it (run python -m tileattn check for details)")
    result = BenchResult(backend=backend, device=_device_name(memory), dtype=dtype.name,
                         batch=batch, heads=heads, head_dims=head_dims)
    ours = f"tileattn-{backend}"
    budget_bytes = _naive_budget(memory)
    naive_itemsize = anchors.naive_dtype(memory == "host", dtype).itemsize
    naive_skips = {n: naive_skip_note(naive_bytes(batch, heads, n, naive_itemsize),
                                      budget_bytes) for n in sizes}
    bar = Progress(len(head_dims) * len(sizes) * 4 + len(memory_sizes) * 2, progress)
    for head_dim, n in ((d, n) for d in head_dims for n in sizes):
        inputs = _inputs(memory, batch, heads, n, head_dim, dtype)
        table = implementations(backend, memory, blocks, with_naive=naive_skips[n] is None)
        for causal in (False, True):
            for index, direction in enumerate(("forward", "forward+backward")):
                bar.step(f"D={head_dim} N={n} {'causal' if causal else 'full'} {direction}")
                check_agreement(table, ours, inputs, causal, direction, dtype)
                seconds = time_in_turns(
                    {name: (lambda f=functions[index]: f(*inputs, causal))
                     for name, functions in table.items()}, memory, rounds)
                flops = attention_flops(batch, heads, n, n, head_dim, causal, index == 1)
                for name, value in seconds.items():
                    result.measurements.append(Measurement(name, head_dim, n, causal,
                                                           direction, value, flops / value))
                if naive_skips[n] is not None:
                    result.measurements.append(Measurement(
                        _naive_name(memory), head_dim, n, causal, direction, None, None,
                        naive_skips[n]))
    for n in memory_sizes:
        modelled = naive_bytes(1, 1, n, naive_itemsize)
        for name in (ours, _naive_name(memory)):
            bar.step(f"memory {name} N={n}")
            skip = naive_skip_note(modelled, budget_bytes)
            if name != ours and skip is not None:
                result.memory.append(MemoryPoint(name, n, None, modelled, skip))
                continue
            if memory == "host":
                peak = host_peak_extra_bytes(name, n, head_dims[0], dtype, True, backend)
            else:
                function = implementations(backend, memory)[name][1]
                inputs = _inputs(memory, 1, 1, n, head_dims[0], dtype)
                peak = _cuda_peak_extra(function, inputs, True)
            result.memory.append(MemoryPoint(name, n, peak, modelled))
    report = markdown_report(result)
    print_fn(report)
    if out:
        write_outputs(result, report, out, print_fn)
    return result


def _naive_name(memory: str) -> str:
    return "cupy-naive" if memory == "cuda" else "numpy-naive"


def _device_name(memory: str) -> str:
    if memory == "cuda":
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        return props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    model = "CPU"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores"


def _naive_budget(memory: str) -> int:
    """Memory the naive anchor may use: a quarter of the host's RAM or of the GPU's."""
    if memory == "cuda":
        import cupy

        return cupy.cuda.Device().mem_info[1] // 4
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):
        return 4 << 30


# --------------------------------------------------------------------------- reporting


def _rate(value, memory_unit):
    return "—" if value is None else f"{value / memory_unit:.1f}"


def markdown_report(result: BenchResult) -> str:
    """One table of rates and ratios, one of memory."""
    unit, unit_name = (1e12, "TFLOP/s") if "tileattn-gpu" in {
        m.implementation for m in result.measurements} else (1e9, "GFLOP/s")
    ours = f"tileattn-{result.backend}"
    names = sorted({m.implementation for m in result.measurements},
                   key=lambda n: (n != ours, n))
    index = {(m.implementation, m.head_dim, m.n, m.causal, m.direction): m
             for m in result.measurements}
    lines = [f"tileattn bench: {result.backend} on {result.device}, {result.dtype}, "
             f"B={result.batch}, H={result.heads}", "",
             "| D | N | causal | pass | " + " | ".join(f"{n} {unit_name}" for n in names)
             + " | " + " | ".join(f"vs {n}" for n in names if n != ours) + " |",
             "|" + "---|" * (4 + 2 * len(names) - 1)]
    for d, n in sorted({(m.head_dim, m.n) for m in result.measurements}):
        for causal in (False, True):
            for direction in ("forward", "forward+backward"):
                cells = [index.get((name, d, n, causal, direction)) for name in names]
                rates = [_rate(c.flops_per_second if c else None, unit) for c in cells]
                mine = index.get((ours, d, n, causal, direction))
                ratios = []
                for name, cell in zip(names, cells):
                    if name == ours:
                        continue
                    ratios.append("—" if not cell or cell.seconds is None or not mine
                                  else f"{cell.seconds / mine.seconds:.2f}x")
                lines.append(f"| {d} | {n} | {'yes' if causal else 'no'} | {direction} | "
                             + " | ".join(rates) + " | " + " | ".join(ratios) + " |")
    lines += ["", "Ratios are the anchor's time over tileattn's (> 1: tileattn is faster).", "",
              f"Memory: one head, D={result.head_dims[0]}, causal forward + backward.", "",
              "| N | implementation | peak extra memory (MB) | naive N x N matrices (MB) |",
              "|---|---|---|---|"]
    for point in result.memory:
        peak = "—" if point.peak_extra_bytes is None else f"{point.peak_extra_bytes / 1e6:.1f}"
        lines.append(f"| {point.n} | {point.implementation} | {peak} {point.note} | "
                     f"{point.modelled_naive_bytes / 1e6:.1f} |")
    return "\n".join(lines)


def output_files(backend: str) -> dict:
    """The files `write_outputs` writes for `backend`, by kind; named per backend so that
    CPU and GPU results can share a folder (the README's docs/ holds these)."""
    return {"json": f"bench-{backend}.json", "markdown": f"bench-{backend}.md",
            "speed": f"speed-{backend}.png", "memory": f"memory-{backend}.png"}


def write_outputs(result: BenchResult, report: str, out: str, print_fn=print):
    os.makedirs(out, exist_ok=True)
    files = output_files(result.backend)
    with open(os.path.join(out, files["json"]), "w") as handle:
        json.dump(asdict(result), handle, indent=1)
    with open(os.path.join(out, files["markdown"]), "w") as handle:
        handle.write(report + "\n")
    try:
        import matplotlib
    except ImportError:
        print_fn(f"wrote {files['json']} and {files['markdown']} to {out}; matplotlib is not "
                 "installed (pip install 'tileattn[bench]'): no plots")
        return
    matplotlib.use("Agg")
    _plot_speed(result, os.path.join(out, files["speed"]))
    _plot_memory(result, os.path.join(out, files["memory"]))
    print_fn(f"wrote {', '.join(files.values())} to {out}")


def _plot_speed(result: BenchResult, path: str):
    import matplotlib.pyplot as plt

    unit, unit_name = (1e12, "TFLOP/s") if result.backend == "gpu" else (1e9, "GFLOP/s")
    figure, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for row, direction in enumerate(("forward", "forward+backward")):
        for column, causal in enumerate((False, True)):
            ax = axes[row][column]
            for name, d in sorted({(m.implementation, m.head_dim)
                                   for m in result.measurements}):
                points = [(m.n, m.flops_per_second / unit) for m in result.measurements
                          if m.implementation == name and m.head_dim == d
                          and m.causal == causal and m.direction == direction
                          and m.flops_per_second]
                label = name if len(result.head_dims) == 1 else f"{name} D={d}"
                if points:
                    ax.plot(*zip(*points), marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{direction}, {'causal' if causal else 'no mask'}")
            ax.set_ylabel(unit_name)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("sequence length N")
    figure.suptitle(f"tileattn {result.backend} on {result.device} ({result.dtype}, "
                    f"B={result.batch}, H={result.heads}, "
                    f"D={', '.join(map(str, result.head_dims))})", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# The memory plot's y axis is linear below this many MB and logarithmic above: tileattn's
# extra memory can be exactly 0 (a log axis dropped those points) while the naive matrices
# reach tens of GB.
MEMORY_PLOT_LINEAR_MB = 1.0


def _plot_memory(result: BenchResult, path: str):
    import matplotlib.pyplot as plt

    figure = memory_figure(result)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def memory_figure(result: BenchResult):
    """The memory plot: measured peak extra memory against N, the naive model, the RAM."""
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(7, 5))
    for name in sorted({p.implementation for p in result.memory}):
        points = [(p.n, p.peak_extra_bytes / 1e6) for p in result.memory
                  if p.implementation == name and p.peak_extra_bytes is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=f"{name} (measured)")
    modelled = sorted({(p.n, p.modelled_naive_bytes / 1e6) for p in result.memory})
    ax.plot(*zip(*modelled), linestyle="--", color="gray", label="naive N x N matrices (model)")
    not_run = [(p.n, p.modelled_naive_bytes / 1e6) for p in result.memory
               if p.peak_extra_bytes is None]
    if not_run:
        ax.plot(*zip(*not_run), linestyle="none", marker="x", color="black", markersize=9,
                label="naive: not run, the model says it would not fit")
    on_gpu = result.backend == "gpu"
    budget = _naive_budget("cuda" if on_gpu else "host") * 4 / 1e6
    ax.axhline(budget, color="red", linewidth=0.8, label="GPU memory" if on_gpu else "RAM")
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=MEMORY_PLOT_LINEAR_MB)
    highest = max([budget] + [megabytes for _, megabytes in modelled])
    ax.set_ylim(0, highest * 4)  # room above the top markers on the log part
    ax.set_xlabel("sequence length N (one head, causal, forward + backward)")
    ax.set_ylabel(f"peak memory beyond inputs and outputs (MB)\n"
                  f"linear below {MEMORY_PLOT_LINEAR_MB:g} MB, log above")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    figure.tight_layout()
    return figure
