"""GPU benchmark: tileattn (backend="gpu") beside torch SDPA (flash, cuDNN) and naive CuPy.

    PYTHONPATH=. python3 bench/bench_gpu.py            # the table
    PYTHONPATH=. python3 bench/bench_gpu.py --sweep    # also every tensor-core tile shape
    PYTHONPATH=. python3 bench/bench_gpu.py --fa       # FlashAttention's benchmark shapes
    PYTHONPATH=. python3 bench/bench_gpu.py --head-dims  # every head dim (FA's layout)

Every implementation is validated before it is timed: tileattn on a small problem against
the float64 golden model (same kernels, same options), and every implementation on the
benchmark problem itself against a float64 CuPy computation of a few heads. Timing: CUDA
events around each call, warm-up first, median of the repetitions; the inputs (>= 64 MiB
each at the main size) exceed the 50 MB L2, so repetitions do not run from cache.
`--fa` times as FlashAttention's own benchmark does (torch.utils.benchmark's
`Timer.timeit`: calls back to back, the host's work for one call overlapping the kernels
of the one before) unless `--timing per-call`, which times each call from an idle GPU, so
that the host time before the launch counts too (bench/overhead_gpu.py measures that).
FLOPs: forward 4*B*H*Nq*Nk*D (halved when causal), backward 2.5x the forward; where
Dv != D, 2*B*H*Nq*Nk*(D + Dv).

`--head-dims` runs the same table over the head dims of real models (D = 32 .. 256 and
(D, Dv) = (192, 128), (128, 64)) at FlashAttention's layout (batch * N = 16k tokens, hidden
about 2048, N = 1k, 4k, 16k). FlashAttention-2 has no Dv != D: there it runs Dv = D, more
work than tileattn's, and the table says so. cuDNN runs Dv != D where it takes it. The
ratio columns are anchor time / tileattn time.

`--fa` runs FlashAttention's benchmark shapes (batch * N = 16k tokens, hidden 2048 as 32
heads x 64 or 16 heads x 128, N = 1k..16k, causal and not, float16 and bfloat16), forward
and forward+backward, tileattn beside torch SDPA's flash (FlashAttention-2) and cuDNN
backends (and tileattn-nd: deterministic=False, the single-pass backward), and prints a
markdown table of TFLOP/s and ratios.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

import cupy
import numpy as np

import tileattn
from tileattn.gpu import tiles
from tileattn.testing import assert_attention_close, bfloat16

from gpu_timing import back_to_back_ms, median_event_ms

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # torch is optional: its rows are left out
    torch = None


@dataclass(frozen=True)
class Case:
    dtype: str
    batch: int
    heads: int
    n: int
    head_dim: int
    causal: bool = False
    direction: str = "forward"
    block_q: int | None = None
    block_k: int | None = None
    value_dim: int | None = None  # None: Dv = D

    @property
    def dv(self) -> int:
        return self.head_dim if self.value_dim is None else self.value_dim

    @property
    def name(self) -> str:
        blocks = f" {self.block_q}x{self.block_k}" if self.block_q else ""
        dv = f" Dv{self.dv}" if self.dv != self.head_dim else ""
        return (f"{self.direction} {self.dtype} B{self.batch} H{self.heads} N{self.n} "
                f"D{self.head_dim}{dv}{' causal' if self.causal else ''}{blocks}")

    @property
    def flops(self) -> float:
        forward = 2 * self.batch * self.heads * self.n * self.n * (self.head_dim + self.dv)
        forward /= 2 if self.causal else 1
        return forward * (2.5 if self.direction == "backward" else 1.0)

    @property
    def options(self) -> dict:
        return dict(causal=self.causal, block_q=self.block_q, block_k=self.block_k)


CASES = [
    Case("float16", 4, 32, 4096, 64),
    Case("float16", 4, 32, 4096, 64, causal=True),
    Case("bfloat16", 4, 32, 4096, 64),
    Case("float16", 4, 16, 4096, 128),
    Case("float16", 4, 16, 4096, 128, causal=True),
    Case("float32", 4, 32, 2048, 64),
    Case("float16", 4, 32, 2048, 64, direction="backward"),
    Case("float16", 4, 32, 2048, 64, causal=True, direction="backward"),
]


# --------------------------------------------------------------------------- inputs


def _to_dtype(x, dtype: str):
    """float32 CuPy array -> dtype; bfloat16 by round-to-nearest-even on the bits, so no
    CuPy bfloat16 arithmetic is needed."""
    if dtype != "bfloat16":
        return x.astype(dtype)
    bits = x.view(cupy.uint32)
    rounded = (bits + cupy.uint32(0x7FFF) + ((bits >> 16) & cupy.uint32(1))) >> 16
    return rounded.astype(cupy.uint16).view(bfloat16())


def make_inputs(case: Case, seed: int = 0):
    """q, k, v, do (v and do with Dv columns)."""
    cupy.random.seed(seed)
    shape = (case.batch, case.heads, case.n, case.head_dim)
    value_shape = shape[:3] + (case.dv,)
    return [_to_dtype(cupy.random.standard_normal(s, dtype=cupy.float32), case.dtype)
            for s in (shape, shape, value_shape, value_shape)]


def _as_float64(x):
    if x.dtype.name == "bfloat16":
        return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32).astype(
            cupy.float64)
    return x.astype(cupy.float64)


def _as_torch(x):
    if x.dtype.name in ("float16", "bfloat16"):
        t = torch.from_dlpack(x.view(cupy.int16))
        return t.view(torch.float16 if x.dtype.name == "float16" else torch.bfloat16)
    return torch.from_dlpack(x)


def _from_torch(t, dtype):
    if t.dtype in (torch.float16, torch.bfloat16):
        return cupy.from_dlpack(t.contiguous().view(torch.int16)).view(dtype)
    return cupy.from_dlpack(t.contiguous())


# --------------------------------------------------------------------------- references


def float64_reference(q, k, v, do, causal: bool, heads: int = 2):
    """o and (dq, dk, dv) in float64 for batch 0, the first `heads` heads."""
    q, k, v, do = (_as_float64(a[0, :heads]) for a in (q, k, v, do))
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = scale * q @ k.swapaxes(-1, -2)
    if causal:
        n = scores.shape[-1]
        scores = cupy.where(cupy.tri(n, dtype=bool), scores, -cupy.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = cupy.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    o = probs @ v
    dv = probs.swapaxes(-1, -2) @ do
    dp = do @ v.swapaxes(-1, -2)
    ds = probs * (dp - (do * o).sum(axis=-1, keepdims=True))
    return o, (scale * ds @ k, scale * ds.swapaxes(-1, -2) @ q, dv)


def relative_error(actual, expected) -> float:
    actual = _as_float64(actual)
    return float(cupy.linalg.norm(actual - expected) / cupy.linalg.norm(expected))


# --------------------------------------------------------------------------- implementations


def tileattn_impl(case: Case, q, k, v, do):
    if case.direction == "forward":
        return lambda: tileattn.forward(q, k, v, backend="gpu", **case.options)
    o, lse = tileattn.forward(q, k, v, backend="gpu", return_lse=True, **case.options)
    return lambda: tileattn.backward(do, q, k, v, o, lse, backend="gpu", **case.options)


def torch_impl(backend):
    def build(case: Case, q, k, v, do):
        tq, tk, tv, tdo = (_as_torch(a) for a in (q, k, v, do))
        if case.direction == "forward":
            def run():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(tq, tk, tv, is_causal=case.causal)
            return lambda: _from_torch(run(), q.dtype)
        tq, tk, tv = (t.detach().requires_grad_() for t in (tq, tk, tv))
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=case.causal)

        def grads():
            return tuple(_from_torch(g, q.dtype) for g in
                         torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True))
        return grads
    return build


def naive_cupy_impl(case: Case, q, k, v, do):
    """Materialises the N x N scores: cuBLAS products, float32 softmax."""
    if case.direction != "forward":
        return None
    scale = 1.0 / math.sqrt(q.shape[-1])
    if q.dtype.name == "bfloat16":
        return None  # CuPy has no bfloat16 matrix product to compare with

    def run():
        scores = (q @ k.swapaxes(-1, -2)).astype(cupy.float32) * scale
        if case.causal:
            scores = cupy.where(cupy.tri(case.n, dtype=bool), scores, -cupy.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = cupy.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        return probs.astype(q.dtype) @ v
    return run


IMPLEMENTATIONS = {"tileattn": tileattn_impl, "naive cupy": naive_cupy_impl}
if torch is not None:
    IMPLEMENTATIONS["torch flash"] = torch_impl(SDPBackend.FLASH_ATTENTION)
    IMPLEMENTATIONS["torch cudnn"] = torch_impl(SDPBackend.CUDNN_ATTENTION)


# --------------------------------------------------------------------------- measuring


def median_ms(function, repetitions: int, warmup: int = 3) -> float:
    """Median of CUDA-event times, per call from an idle GPU (L2 not flushed: the inputs
    exceed it)."""
    return median_event_ms(function, repetitions, warmup, flush_l2=False)


TIMINGS = {"back-to-back": back_to_back_ms, "per-call": median_ms}


def validate_small(case: Case):
    """tileattn with the case's kernels on a small problem against the golden model."""
    small = replace(case, batch=1, heads=2, n=300)
    q, k, v, do = make_inputs(small, seed=1)
    o, lse = tileattn.forward(q, k, v, backend="gpu", return_lse=True, **small.options)
    host = [a.get() for a in (q, k, v, do)]
    as64 = [a.astype(np.float64) for a in host[:3]]
    golden_o, golden_lse = tileattn.forward(*as64, backend="reference", return_lse=True,
                                            causal=case.causal)
    assert_attention_close(o.get(), golden_o, host[0].dtype, name="o")
    if case.direction == "backward":
        grads = tileattn.backward(do, q, k, v, o, lse, backend="gpu", **small.options)
        # SPEC: D = rowsum(do * o) from the o the backward is given.
        golden = tileattn.backward(host[3].astype(np.float64), *as64,
                                   o.get().astype(np.float64), golden_lse,
                                   backend="reference", causal=case.causal)
        for name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
            assert_attention_close(grad.get(), want, host[0].dtype, name=name)


def run_case(case: Case, repetitions: int) -> list[tuple]:
    validate_small(case)
    q, k, v, do = make_inputs(case)
    ref_o, ref_grads = float64_reference(q, k, v, do, case.causal)
    rows = []
    for name, build in IMPLEMENTATIONS.items():
        if name != "tileattn" and case.block_q is not None:
            continue
        try:
            function = build(case, q, k, v, do)
        except RuntimeError as error:  # e.g. a torch backend that rejects this problem
            print(f"  {name}: not available for {case.name}: {error}")
            continue
        if function is None:
            continue
        try:
            result = function()
        except RuntimeError as error:
            print(f"  {name}: failed on {case.name}: {str(error).splitlines()[0]}")
            continue
        if case.direction == "forward":
            error = relative_error(result[0, :2], ref_o)
        else:
            error = max(relative_error(g[0, :2], r) for g, r in zip(result, ref_grads))
        if not error < 2e-2:
            print(f"  {name}: relative error {error:.2e} on {case.name}; not timed")
            continue
        del result
        ms = median_ms(function, repetitions)
        rows.append((case.name, name, ms, case.flops / ms / 1e9, error))
    return rows


# --------------------------------------------------------------------------- FA shapes


FA_SEQUENCE_LENGTHS = (1024, 2048, 4096, 8192, 16384)


def fa_cases(dtypes=("float16", "bfloat16"), lengths=FA_SEQUENCE_LENGTHS,
             head_dims=(64, 128)) -> list[Case]:
    cases = []
    for dtype in dtypes:
        for head_dim in head_dims:
            heads = 2048 // head_dim
            for causal in (False, True):
                for n in lengths:
                    cases.append(Case(dtype, 16384 // n, heads, n, head_dim, causal=causal))
    return cases


def torch_anchors(dtype: str) -> tuple:
    """torch SDPA backends to compare with: FlashAttention-2 and cuDNN for 16-bit inputs;
    for float32, which neither takes, the memory-efficient backend (3xTF32 on sm_80+)."""
    if dtype == "float32":
        return (("efficient", SDPBackend.EFFICIENT_ATTENTION),)
    return (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))


def fa_functions(case: Case, q, k, v, do, nondeterministic: bool = True) -> dict:
    """name -> (forward, forward+backward) callables; each returns o / (dq, dk, dv).
    `nondeterministic`: also tileattn-nd, the backward with deterministic=False."""
    def ours_both():
        o, lse = tileattn.forward(q, k, v, backend="gpu", return_lse=True, causal=case.causal)
        return tileattn.backward(do, q, k, v, o, lse, backend="gpu", causal=case.causal)

    def ours_single_pass():
        o, lse = tileattn.forward(q, k, v, backend="gpu", return_lse=True, causal=case.causal)
        return tileattn.backward(do, q, k, v, o, lse, backend="gpu", causal=case.causal,
                                 deterministic=False)

    functions = {"tileattn": (lambda: tileattn.forward(q, k, v, backend="gpu",
                                                       causal=case.causal), ours_both, False)}
    if nondeterministic:  # deterministic=False (the forward is the same)
        functions["tileattn-nd"] = (None, ours_single_pass, False)
    if torch is None:
        return functions
    tq, tk, tv, tdo = (_as_torch(a) for a in (q, k, v, do))
    tq, tk, tv = (t.detach().requires_grad_() for t in (tq, tk, tv))
    for name, backend in torch_anchors(case.dtype):
        # FlashAttention-2 takes no Dv != D: it runs Dv = D (more work than ours), and so
        # does any backend that refuses the real shapes.
        equal_dims = case.dv != case.head_dim and (name == "flash" or not _accepts(
            backend, tq[:1, :1, :64], tk[:1, :1, :64], tv[:1, :1, :64], case.causal))
        bv, bdo = tv, tdo
        if equal_dims:
            bv = tk.detach().clone().requires_grad_()
            bdo = tq.detach().clone()
            name = f"{name}@Dv=D"

        def forward(backend=backend, bv=bv):
            with sdpa_kernel(backend), torch.no_grad():
                return _from_torch(F.scaled_dot_product_attention(
                    tq, tk, bv, is_causal=case.causal), q.dtype)

        def both(backend=backend, bv=bv, bdo=bdo):
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(tq, tk, bv, is_causal=case.causal)
                grads = torch.autograd.grad(out, (tq, tk, bv), bdo)
            return tuple(_from_torch(g, q.dtype) for g in grads)
        functions[name] = (forward, both, equal_dims)
    return functions


def _accepts(backend, q, k, v, causal: bool) -> bool:
    """Whether a torch SDPA backend runs these shapes (forward and backward)."""
    try:
        with sdpa_kernel(backend):
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
        return True
    except RuntimeError:
        return False


HEAD_DIM_SWEEP = (32, 40, 48, 64, 80, 96, 112, 128, 160, 192, 256, (192, 128), (128, 64))


def head_dim_cases(dtypes=("float16", "bfloat16"), lengths=(1024, 4096, 16384),
                   dims=HEAD_DIM_SWEEP) -> list[Case]:
    """FA's layout (batch * N = 16k tokens, hidden about 2048) at every head dim."""
    cases = []
    for dtype in dtypes:
        for dim in dims:
            head_dim, value_dim = dim if isinstance(dim, tuple) else (dim, dim)
            heads = max(1, round(2048 / head_dim))
            for causal in (False, True):
                for n in lengths:
                    cases.append(Case(dtype, 16384 // n, heads, n, head_dim, causal=causal,
                                      value_dim=value_dim))
    return cases


def precompile(cases: list[Case], workers: int = 16) -> None:
    """Compiles every case's kernels in `workers` processes (a problem of one head with the
    case's N needs the same kernels), so that the timed process loads them from the disk
    caches instead of compiling one after another."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.map(_compile_case, cases)


def _compile_case(case: Case) -> None:
    small = replace(case, batch=1, heads=1)
    q, k, v, do = make_inputs(small)
    o, lse = tileattn.forward(q, k, v, backend="gpu", return_lse=True, causal=case.causal)
    tileattn.backward(do, q, k, v, o, lse, backend="gpu", causal=case.causal)
    cupy.cuda.Device().synchronize()


def run_fa(repetitions: int, dtypes, lengths=FA_SEQUENCE_LENGTHS, head_dims=(64, 128),
           nondeterministic: bool = True, timing: str = "back-to-back",
           cases: list[Case] | None = None) -> None:
    """Times FA's shapes, or `cases` (`timing`: a key of `TIMINGS`); checks every
    implementation against float64 on one head first (N <= 4096: the check's N x N float64
    products are what limits it)."""
    measure = TIMINGS[timing]
    results = {}  # (case name, direction) -> {implementation: TFLOP/s}
    cases = cases if cases is not None else fa_cases(dtypes, lengths, head_dims)
    for case in cases:
        validate_small(replace(case, direction="backward"))
        q, k, v, do = make_inputs(case)
        reference = float64_reference(q, k, v, do, case.causal, heads=1) if case.n <= 4096 \
            else None
        for name, (forward, both, equal_dims) in fa_functions(case, q, k, v, do,
                                                              nondeterministic).items():
            # Timed as the case's FLOPs, so that the TFLOP/s columns compare times; an
            # anchor that ran Dv = D did more work than that (its column says so).
            for direction, function, flops in (("fwd", forward, case.flops),
                                               ("fwd+bwd", both, 3.5 * case.flops)):
                if function is None:
                    continue
                try:
                    result = function()
                except RuntimeError as error:
                    print(f"  {name}: failed on {case.name}: {str(error).splitlines()[0]}")
                    continue
                if reference is not None and not equal_dims:
                    if direction == "fwd":
                        error = relative_error(result[0, :1], reference[0])
                    else:
                        error = max(relative_error(g[0, :1], r)
                                    for g, r in zip(result, reference[1]))
                    if not error < 2e-2:
                        print(f"  {name}: relative error {error:.2e} on {case.name} "
                              f"{direction}; not timed")
                        continue
                del result
                ms = measure(function, repetitions, warmup=2)
                tflops = flops / ms / 1e9
                results.setdefault((case.name, direction), {})[name] = tflops
                print(f"  {case.name:<44} {direction:<8} {name:<9} {ms:9.3f} ms "
                      f"{tflops:7.1f} TFLOP/s", flush=True)
        del q, k, v, do, reference
        cupy.get_default_memory_pool().free_all_blocks()
    anchors = [name for name in ("flash", "flash@Dv=D", "cudnn", "cudnn@Dv=D", "efficient")
               if any(name in row for row in results.values())]
    ours = ["tileattn"] + (["tileattn-nd"] if nondeterministic else [])
    worst = {}
    for (case_name, direction), row in results.items():
        for anchor in anchors:
            if "tileattn" in row and anchor in row:
                ratio = row["tileattn"] / row[anchor]
                key = (anchor.split("@")[0], direction)
                worst[key] = min(worst.get(key, (ratio, case_name)), (ratio, case_name))
    ratios = [("tileattn", a) for a in anchors] + (
        [("tileattn-nd", anchors[0])] if nondeterministic and anchors else [])
    columns = ours + anchors + [f"{mine} / {name}" for mine, name in ratios]
    print("\n| case | pass | " + " | ".join(columns) + " |")
    print("| --- | --- |" + " ---: |" * (len(ours) + len(anchors) + len(ratios)))
    for (case_name, direction), row in results.items():

        def cell(name):
            return f"{row[name]:.1f}" if name in row else "-"

        def ratio(mine, name):
            return f"{row[mine] / row[name]:.2f}" if mine in row and name in row else "-"
        cells = [cell(name) for name in ours + anchors] + [ratio(*r) for r in ratios]
        print(f"| {case_name.replace('forward ', '')} | {direction} | " + " | ".join(cells)
              + " |")
    for (anchor, direction), (ratio, case_name) in sorted(worst.items()):
        print(f"worst tileattn / {anchor} {direction}: {ratio:.2f} ({case_name})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time every tensor-core tile")
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--only", default="", help="run cases whose name contains this")
    parser.add_argument("--fa", action="store_true",
                        help="FlashAttention's benchmark shapes only (TFLOP/s table)")
    parser.add_argument("--fa-dtypes", default="float16,bfloat16")
    parser.add_argument("--fa-n", default=",".join(map(str, FA_SEQUENCE_LENGTHS)),
                        help="sequence lengths of the FA shapes (comma-separated)")
    parser.add_argument("--fa-head-dims", default="64,128")
    parser.add_argument("--head-dims", action="store_true",
                        help="every head dim at FA's layout (N = 1k, 4k, 16k) vs FA2 and cuDNN")
    parser.add_argument("--dims", default=None,
                        help="--head-dims: D or D:Dv values, comma-separated (default: all)")
    parser.add_argument("--n", default="1024,4096,16384", help="--head-dims: sequence lengths")
    parser.add_argument("--no-nd", action="store_true",
                        help="leave out tileattn-nd (deterministic=False)")
    parser.add_argument("--timing", choices=tuple(TIMINGS), default="back-to-back",
                        help="--fa: calls back to back (FlashAttention's benchmark) or each "
                             "from an idle GPU (host time included)")
    args = parser.parse_args()
    device = cupy.cuda.Device()
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(device.id)['name'].decode()}, "
          f"CuPy {cupy.__version__}, torch {torch.__version__ if torch else 'absent'}")
    if args.head_dims:
        dims = HEAD_DIM_SWEEP if args.dims is None else tuple(
            tuple(map(int, d.split(":"))) if ":" in d else int(d) for d in args.dims.split(","))
        cases = head_dim_cases(args.fa_dtypes.split(","), tuple(map(int, args.n.split(","))),
                               dims)
        precompile(cases)
        print(f"timing: {args.timing}, {args.repetitions} calls")
        run_fa(args.repetitions, (), nondeterministic=not args.no_nd, timing=args.timing,
               cases=cases)
        return
    if args.fa:
        print(f"timing: {args.timing}, {args.repetitions} calls")
        run_fa(args.repetitions, args.fa_dtypes.split(","),
               tuple(map(int, args.fa_n.split(","))),
               tuple(map(int, args.fa_head_dims.split(","))), not args.no_nd, args.timing)
        return
    cases = [c for c in CASES if args.only in c.name]
    if args.sweep:
        for head_dim, heads in ((64, 32), (128, 16)):
            for block_q in tiles.MMA_BLOCK_Q:
                for block_k in tiles.MMA_BLOCK_K:
                    cases.append(Case("float16", 4, heads, 4096, head_dim, block_q=block_q,
                                      block_k=block_k))
    table = []
    for case in cases:
        rows = run_case(case, args.repetitions)
        for row in rows:
            print(f"  {row[0]:<48} {row[1]:<12} {row[2]:9.3f} ms {row[3]:8.1f} TFLOP/s "
                  f"rel.err {row[4]:.1e}", flush=True)
        table.extend(rows)
    print("\n| case | implementation | median ms | TFLOP/s | rel. error | tileattn speed-up |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    ours = {row[0]: row[2] for row in table if row[1] == "tileattn"}
    for case_name, name, ms, tflops, error in table:
        ratio = f"{ms / ours[case_name]:.2f}x" if case_name in ours else "-"
        print(f"| {case_name} | {name} | {ms:.3f} | {tflops:.1f} | {error:.1e} | {ratio} |")


if __name__ == "__main__":
    main()
